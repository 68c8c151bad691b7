"""The chat output of a completion split into reasoning, content and tool calls: streamed (``ReasoningSplitter``,
a subset of the state machine of the completion parser, docs/chat_format.md "Streaming parser", working on text
deltas) and whole (``parse_chat_output``); output cut by ``max_tokens`` goes through the streaming parser, which
drops a tool call cut short."""

from __future__ import annotations

from deepinfer.chat import merge_deltas, parse_completion
from deepinfer.chat.dsml import parse_tool_calls
from deepinfer.chat.streaming import StreamingParser
from deepinfer.chat.tokens import EOS, THINK_END, TOOL_CALLS_START


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental split of streamed completion text into reasoning, content and tool calls.

    The initial state comes from the rendered prompt: reasoning when it ends with ``<think>``. In reasoning,
    ``</think>`` switches to content; in content, ``\\n\\n<｜DSML｜tool_calls`` starts a tool-call block that is
    held back and parsed at the end (on a parse failure it is returned as content). Text that could be the
    start of a marker is held back until the next delta decides it.
    """

    def __init__(self, reasoning: bool) -> None:
        self.state = "reasoning" if reasoning else "content"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; returns the (reasoning, content) text that is now certain."""
        self.buf += text
        out = {"reasoning": "", "content": ""}
        while self.state != "tool":
            marker, nxt = (THINK_END, "content") if self.state == "reasoning" else (TOOL_CALLS_START, "tool")
            at = self.buf.find(marker)
            if at == -1:
                keep = _held(self.buf, marker)
                out[self.state] += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            out[self.state] += self.buf[:at]
            self.buf, self.state = self.buf[at + len(marker) :], nxt
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str, list[dict[str, str]]]:
        """End of the stream: the held-back (reasoning, content) and the parsed tool calls."""
        buf, self.buf = self.buf.removesuffix(EOS), ""
        if self.state == "reasoning":
            return buf, "", []
        if self.state == "content":
            return "", buf, []
        try:
            calls, pos = parse_tool_calls(buf, 0)
            if buf[pos:]:
                raise ValueError("text after the tool-call block")
        except ValueError:
            return "", TOOL_CALLS_START + buf, []
        return "", "", calls


def parse_chat_output(text: str, reasoning: bool, finish_reason: str) -> tuple[str, str, list[dict[str, str]]]:
    """(reasoning_content, content, tool calls) of a whole completion.

    Output cut by ``max_tokens`` (``length``) goes through the streaming parser in its ``whole_calls`` mode, as a
    stream does: a tool call cut short is dropped, and so is a cut-off start of DSML markup; the content is the
    text before the markup began, the calls are the ones that closed. Otherwise the project's strict parser first;
    when the output is malformed, the tolerant splitter. Reasoning that never closed stays reasoning on ``length``
    and becomes content on ``stop`` (docs/chat_format.md, "Parsing completions").
    """
    if finish_reason == "length":
        parser = StreamingParser("thinking" if reasoning else "chat", whole_calls=True)
        message = merge_deltas(parser.feed(text) + parser.finish())
        calls = [c["function"] for c in message["tool_calls"]]
        return message["reasoning_content"], message["content"], calls
    try:
        parsed = parse_completion(text if text.endswith(EOS) else text + EOS, "thinking" if reasoning else "chat")
        calls = [c["function"] for c in parsed["tool_calls"]]
        return parsed["reasoning_content"], parsed["content"], calls
    except ValueError:
        pass
    splitter = ReasoningSplitter(reasoning)
    r, c = splitter.feed(text)
    r2, c2, calls = splitter.finish()
    if splitter.state == "reasoning" and finish_reason == "stop":
        return "", r + r2, []
    return r + r2, c + c2, calls
