"""Streaming parser of DeepSeek-V4 completions into OpenAI chat-completion deltas.

Spec: docs/chat_format.md, "Streaming parser" (the state machine) on top of "Tool calls in DSML" and "Parsing
completions" (the DSML grammar). Input is detokenized generated text with special tokens kept (EOS text included), split
anywhere. Output is OpenAI delta fragments::

    {"reasoning_content": "..."}
    {"content": "..."}
    {"tool_calls": [{"index": i, "id": "call_...", "type": "function", "function": {"name": ..., "arguments": ""}}]}
    {"tool_calls": [{"index": i, "function": {"arguments": "<fragment>"}}]}

Guarantees:

- On a completion that `parse_completion` accepts, the concatenated deltas give exactly its `reasoning_content`,
  `content` and tool calls (name, and `arguments` byte for byte: string parameters JSON-quoted, others verbatim,
  in the reference's `{"k": v, "k2": v2}` layout), whatever the chunking, and `malformed` stays False.
- DSML markup, `<think>` / `</think>`, BOS and EOS text never reach `content` or `reasoning_content`. Text that
  could be the start of such a marker is held back until it is decided; at `finish()` held-back text that did
  not become a marker is released as text (a lone `｜DSML｜` never is).
- It never raises on model output: what it cannot parse it degrades (non-markup text becomes content, markup
  is dropped) and records in `issues` (`malformed` is True then).

Deviations the parser repairs (each recorded in `issues`; the reference parser would reject the text):

- A tool-call block (or a bare `<｜DSML｜invoke`) before `</think>` is closed in thinking mode ends the
  reasoning, as vLLM's unified DeepSeek-V4 parser, Dynamo #10646 and vllm-ascend #14511 do; a `</think>`
  that follows the block is swallowed. The block's calls are returned as tool calls.
- A block without its leading blank line, or without its `<｜DSML｜tool_calls>` wrapper, is still parsed.
- Stray `<think>`, `</think>` (in content), BOS and unknown DSML tags are dropped; whitespace between DSML
  tags is not checked; text after the block becomes content; text after EOS is ignored.
- Reasoning that never sees `</think>` stays reasoning (it has already been streamed as such).

Truncation (the text ends without EOS, e.g. max_tokens): `finish()` releases held-back text; a call that was
started but not closed keeps its partial arguments (`unfinished_call` is True: report finish_reason "length").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.deltas import Delta, held_suffix, json_str_body, merge_adjacent, merge_deltas, new_call_id
from deepinfer.chat.stream_states import (
    AFTER_BLOCK,
    BLOCK,
    BLOCK_START_BARE,
    CONTENT,
    DONE,
    EXPECT_GT,
    HEADER_LIMIT,
    INVOKE,
    INVOKE_HEADER,
    INVOKE_HEADER_ENDS,
    INVOKE_HEADER_RE,
    LENIENT_NAME_RE,
    LENIENT_PARAM_RE,
    PARAM_ATTR_RE,
    PARAM_HEADER,
    PARAM_HEADER_ENDS,
    PARAM_NAME_PREFIX,
    PIECE,
    PREFIXES,
    REASONING,
    SKIP_INVOKE,
    SKIP_PARAM,
    STRAY,
    STRAY_LIMIT,
    TABLES,
    VALUE,
    VALUE_END,
)
from deepinfer.chat.tokens import DSML, INVOKE_CLOSE, PARAMETER_OPEN, THINK_END, THINKING_MODES, TOOL_CALLS_START

__all__ = ["StreamingParser", "merge_deltas", "new_call_id"]


@dataclass
class _Call:
    index: int
    params: set[str] = field(default_factory=set)
    value_is_string: bool = False


class StreamingParser:
    """Incremental DeepSeek-V4 completion parser; one per generated choice.

    thinking_mode: "thinking" when the prompt ends with `<think>` (the output starts inside the reasoning),
        "chat" when it ends with `</think>`: the same value the prompt was rendered with.
    id_factory: makes the id of each tool call (default `new_call_id`).

    `feed(text)` returns the deltas the new text completes; `finish()` the rest, once, when the generation
    has ended. Afterwards: `issues` (deviations from the reference format, empty for a well-formed
    completion), `malformed`, `saw_eos`, `tool_call_count`, `unfinished_call`.
    """

    def __init__(self, thinking_mode: str, id_factory: Callable[[], str] | None = None) -> None:
        if thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode: expected one of {THINKING_MODES}, got {thinking_mode!r}")
        self.thinking_mode = thinking_mode
        self._id_factory = id_factory or new_call_id
        self._state = REASONING if thinking_mode == "thinking" else CONTENT
        self._after_gt = BLOCK  # the state after EXPECT_GT
        self._return_state = CONTENT  # the state after STRAY
        self._buf = ""
        self._text: list[str] = []  # everything fed, for the reference check at finish()
        self._out: list[Delta] = []
        self._final = False
        self._finished = False
        self._call: _Call | None = None
        self._stray_len = 0
        self._blocks = 0
        self.issues: list[str] = []
        self.saw_eos = False
        self.tool_call_count = 0
        self.unfinished_call = False

    @property
    def malformed(self) -> bool:
        """Whether the completion deviated from the well-formed DSML / reasoning format so far."""
        return bool(self.issues)

    @property
    def in_reasoning(self) -> bool:
        """Whether the parser is still inside the reasoning."""
        return REASONING in (self._state, self._return_state if self._state == STRAY else None)

    def feed(self, delta_text: str) -> list[Delta]:
        """Consume more generated text; return the delta fragments it completes (possibly none)."""
        if self._finished:
            self._issue("text fed after finish()")
            return []
        if not delta_text:
            return []
        self._text.append(delta_text)
        out: list[Delta] = []
        for i in range(0, len(delta_text), PIECE):  # bounded pieces keep the buffer (and each step) short
            self._buf += delta_text[i : i + PIECE]
            out += self._run()
        return merge_adjacent(out)

    def finish(self) -> list[Delta]:
        """End of the generation: release held-back text and return the last deltas."""
        if self._finished:
            return []
        self._final = True
        out = self._run()
        self._finished = True
        if self._call is not None:
            self.unfinished_call = True
            if self.saw_eos:
                self._issue("tool call not terminated before EOS")
        if self.saw_eos:
            try:
                parse_completion("".join(self._text), self.thinking_mode)
            except ValueError as e:
                self._issue(f"reference parser: {e}")
        return out

    # ---------------------------------------------------------------------------------------------------

    def _run(self) -> list[Delta]:
        self._out = []
        try:
            while self._step():
                pass
        except Exception as e:  # never raise into the server: drop the rest
            self._issue(f"internal error: {type(e).__name__}: {e}")
            self._state = DONE
            self._buf = ""
        out, self._out = self._out, []
        return out

    def _issue(self, message: str) -> None:
        if len(self.issues) < 100:
            self.issues.append(message)

    def _step(self) -> bool:
        """Advance once; False when nothing more can be done with the buffered text."""
        state = self._state
        if state == DONE:
            if self._buf.strip():
                self._issue("text after EOS ignored")
            self._buf = ""
            return False
        if not self._buf:
            return False
        if state in TABLES:
            return self._step_tags(state)
        return getattr(self, f"_step_{state}")()

    # Emitting ------------------------------------------------------------------------------------------

    def _emit_text(self, key: str, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if last is not None and key in last:
            last[key] += text
        else:
            self._out.append({key: text})

    def _emit_args(self, text: str) -> None:
        if not text or self._call is None:
            return
        last = self._out[-1] if self._out else None
        if last is not None and "tool_calls" in last:
            entry = last["tool_calls"][0]
            if entry["index"] == self._call.index and "id" not in entry:
                entry["function"]["arguments"] += text
                return
        self._out.append({"tool_calls": [{"index": self._call.index, "function": {"arguments": text}}]})

    def _start_call(self, name: str) -> None:
        self._call = _Call(index=self.tool_call_count)
        self.tool_call_count += 1
        call = {"name": name, "arguments": ""}
        entry = {"index": self._call.index, "id": self._id_factory(), "type": "function", "function": call}
        self._out.append({"tool_calls": [entry]})

    def _end_call(self) -> None:
        if self._call is not None:
            self._emit_args("}" if self._call.params else "{}")
            self._call = None

    # Between tags: reasoning, content, block, invoke, after the block, skipping ------------------------

    def _scan(self, state: str) -> tuple[int, str | None]:
        """(end, marker): buf[:end] is plain text, followed by `marker`, or (marker None) by the start of a
        marker the buffer ends inside (held back), or by nothing (end == len(buf))."""
        buf = self._buf
        table = TABLES[state]
        at, marker = len(buf), None
        for m in table:
            i = buf.find(m, 0, at + len(m))
            if i != -1 and (i < at or (i == at and marker is not None and len(m) > len(marker))):
                at, marker = i, m
        prefixes, longest = PREFIXES[state]
        for i in range(max(0, len(buf) - longest + 1), min(at, len(buf) - 1) + 1):
            if buf[i:] in prefixes:
                return i, None
        return at, marker

    def _step_tags(self, state: str) -> bool:
        end, marker = self._scan(state)
        text, self._buf = self._buf[:end], self._buf[end:]
        if marker is None and self._final and self._buf:
            # The generation ended inside what could have been a marker: release it as text, unless it
            # holds DSML (a truncated tool-call opener), which is dropped.
            if DSML not in self._buf:
                text += self._buf
            self._buf = ""
        self._on_text(state, text)
        if marker is None:
            return self._state != state and bool(self._buf)  # rescan what is held back in the new state
        self._buf = self._buf[len(marker) :]
        self._on_marker(state, TABLES[state][marker], marker)
        return True

    def _on_text(self, state: str, text: str) -> None:
        if not text:
            return
        if state == REASONING:
            self._emit_text("reasoning_content", text)
        elif state == CONTENT:
            self._emit_text("content", text)
        elif state in (SKIP_INVOKE, SKIP_PARAM):
            pass
        elif text.strip():  # non-whitespace text between DSML tags: keep it, as content
            self._issue(f"text inside the tool-call markup: {text[:40]!r}")
            if state == AFTER_BLOCK:
                self._state = CONTENT
                text = text.lstrip()
            self._emit_text("content", text)

    def _on_marker(self, state: str, action: str, marker: str) -> None:
        if action == "eos":
            self.saw_eos = True
            if state == REASONING:
                self._issue("EOS inside the reasoning (no '</think>')")
            elif state in (BLOCK, INVOKE, SKIP_INVOKE, SKIP_PARAM):
                self._issue("tool-call block not terminated before EOS")
                self._end_call()
            self._state = DONE
        elif action == "end_reasoning":
            self._state = CONTENT
        elif action == "drop":
            self._issue(f"{marker!r} dropped")
            if state == AFTER_BLOCK and marker == THINK_END:
                self._state = CONTENT
        elif action == "stray":
            self._issue(f"unexpected DSML tag {marker!r}… dropped")
            self._return_state = state
            self._stray_len = 0
            self._state = STRAY
        elif action in ("block", "invoke"):
            self._open_block(state, marker)
            self._state = INVOKE_HEADER
            if action == "block":
                self._after_gt = BLOCK
                self._state = EXPECT_GT
        elif action == "block_end":
            if state in (INVOKE, SKIP_PARAM):
                self._issue("invoke not terminated before the end of the block")
            self._end_call()
            self._state = AFTER_BLOCK
        elif action == "invoke_end":
            self._end_call()
            self._after_gt = BLOCK
            self._state = EXPECT_GT
        elif action == "param":
            self._state = PARAM_HEADER
        elif action == "param_skipped":
            self._state = INVOKE

    def _open_block(self, state: str, marker: str) -> None:
        """Bookkeeping and issues for a block or invoke opener found in `state`."""
        if state in (REASONING, CONTENT, AFTER_BLOCK):
            if state == REASONING:
                self._issue("tool call before '</think>': the reasoning ends there")
            if self._blocks:
                self._issue("second tool-call block")
            elif marker != TOOL_CALLS_START:
                self._issue(f"tool-call block opened by {marker!r} instead of {TOOL_CALLS_START!r}")
            self._blocks += 1
            return
        if state in (INVOKE, SKIP_PARAM):
            self._issue("invoke not terminated before the next one")
            self._end_call()
        if marker in (TOOL_CALLS_START, BLOCK_START_BARE):
            self._issue("nested tool-call block")

    # The ">" closing a tag ------------------------------------------------------------------------------

    def _step_expect_gt(self) -> bool:
        if self._buf[0] == ">":
            self._buf = self._buf[1:]
        else:
            self._issue(f"expected '>', found {self._buf[:20]!r}")
        self._state = self._after_gt
        return True

    # Unknown DSML tag -----------------------------------------------------------------------------------

    def _step_stray(self) -> bool:
        buf = self._buf
        limit = STRAY_LIMIT - self._stray_len
        ends = [i for i in (buf.find(">", 0, limit), buf.find("\n", 0, limit), buf.find("<", 0, limit)) if i != -1]
        if ends:
            end = min(ends)
            self._buf = buf[end + 1 :] if buf[end] == ">" else buf[end:]
        elif len(buf) >= limit or self._final:
            self._buf = buf[limit:]
        else:
            self._stray_len += len(buf)
            self._buf = ""
            return False
        self._state = self._return_state
        return True

    # Invoke header ---------------------------------------------------------------------------------------

    def _step_invoke_header(self) -> bool:
        buf = self._buf
        hits = [(i, t) for t in INVOKE_HEADER_ENDS if (i := buf.find(t)) != -1]
        if not hits and not self._final and len(buf) <= HEADER_LIMIT:
            return False
        at, tag = min(hits) if hits else (len(buf), "")
        header = buf[:at]
        match = INVOKE_HEADER_RE.fullmatch(header) if tag in (PARAMETER_OPEN, INVOKE_CLOSE) else None
        if match is None:
            if not tag and self._final:
                self._buf = ""  # truncated inside the header: the call never started
                return False
            self._issue(f"malformed invoke header {header[:60]!r}")
            match = LENIENT_NAME_RE.search(header)
        self._buf = buf[at:]
        if match is None:
            self._state = SKIP_INVOKE
        else:
            self._start_call(match.group(1))
            self._state = INVOKE
        return True

    # Parameter header ------------------------------------------------------------------------------------

    def _step_param_header(self) -> bool:
        buf = self._buf
        call = self._call
        if call is None:  # a parameter outside an invoke (after a malformed invoke header)
            self._state = SKIP_PARAM
            return True
        stop = min((i for t in PARAM_HEADER_ENDS if (i := buf.find(t)) != -1), default=-1)
        prefixed = buf.startswith(PARAM_NAME_PREFIX)
        attr = PARAM_ATTR_RE.search(buf, len(PARAM_NAME_PREFIX)) if prefixed else None
        undecided = stop == -1 and not self._final and len(buf) <= HEADER_LIMIT
        if attr is not None and (stop == -1 or stop >= attr.end()):
            # As the reference: the name runs up to the first `" string="true|false">`.
            name, is_string, rest = buf[len(PARAM_NAME_PREFIX) : attr.start()], attr.group(1) == "true", attr.end()
        elif undecided and (prefixed or PARAM_NAME_PREFIX.startswith(buf)):
            return False
        else:
            lenient = LENIENT_PARAM_RE.match(buf)
            if lenient is None or (stop != -1 and lenient.end() > stop):
                if undecided and ">" not in buf:
                    return False
                if stop == -1 and self._final:
                    self._buf = ""  # truncated inside the header
                    return False
                self._issue(f"malformed parameter header {buf[:60]!r} dropped")
                self._state = SKIP_PARAM
                return True
            self._issue(f"malformed parameter header {buf[: lenient.end()]!r}")
            name, is_string, rest = lenient.group(1), lenient.group(2) == "true", lenient.end()
        self._buf = buf[rest:]
        if name in call.params:
            self._issue(f"duplicate parameter {name!r} dropped")
            self._state = SKIP_PARAM
            return True
        self._emit_args(("{" if not call.params else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        call.params.add(name)
        call.value_is_string = is_string
        if is_string:
            self._emit_args('"')
        self._state = VALUE
        return True

    # Parameter value -------------------------------------------------------------------------------------

    def _step_value(self) -> bool:
        buf = self._buf
        at = buf.find(VALUE_END)
        if at == -1:
            keep = 0 if self._final else held_suffix(buf, VALUE_END)
            self._emit_value(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._emit_value(buf[:at])
        if self._call is not None and self._call.value_is_string:
            self._emit_args('"')
        self._buf = buf[at + len(VALUE_END) :]
        self._after_gt = INVOKE
        self._state = EXPECT_GT
        return True

    def _emit_value(self, text: str) -> None:
        if text and self._call is not None:
            self._emit_args(json_str_body(text) if self._call.value_is_string else text)
