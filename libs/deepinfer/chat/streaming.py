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

Truncation (the text ends without EOS, e.g. max_tokens): `finish()` releases held-back text, except a cut-off
start of DSML markup (from its `<｜`), which is dropped; a call that was started but not closed sets
`unfinished_call` (report finish_reason "length"). By default such a call has streamed its partial arguments;
with `whole_calls=True` each call is held back until its invoke closes and then sent whole, so a cut call is
dropped and never reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.deltas import Delta, DeltaWriter, held_suffix, merge_adjacent, merge_deltas, new_call_id
from deepinfer.chat.stream_headers import Header, read_invoke_header, read_param_header
from deepinfer.chat.stream_states import (
    AFTER_BLOCK,
    BLOCK,
    BLOCK_START_BARE,
    CONTENT,
    DONE,
    EXPECT_GT,
    INVOKE,
    INVOKE_HEADER,
    PARAM_HEADER,
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
    partial_markup,
)
from deepinfer.chat.tokens import THINK_END, THINKING_MODES, TOOL_CALLS_START

__all__ = ["StreamingParser", "merge_deltas", "new_call_id"]


class StreamingParser:
    """Incremental DeepSeek-V4 completion parser; one per generated choice.

    thinking_mode: "thinking" when the prompt ends with `<think>` (the output starts inside the reasoning),
        "chat" when it ends with `</think>`: the same value the prompt was rendered with.
    id_factory: makes the id of each tool call (default `new_call_id`).
    whole_calls: send each tool call as one delta once its invoke closes (a call cut short is dropped).

    `feed(text)` returns the deltas the new text completes; `finish()` the rest, once, when the generation
    has ended. Afterwards: `issues` (deviations from the reference format, empty for a well-formed
    completion), `malformed`, `saw_eos`, `tool_call_count`, `unfinished_call`.
    """

    def __init__(
        self, thinking_mode: str, id_factory: Callable[[], str] | None = None, whole_calls: bool = False
    ) -> None:
        if thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode: expected one of {THINKING_MODES}, got {thinking_mode!r}")
        self.thinking_mode = thinking_mode
        self._writer = DeltaWriter(id_factory or new_call_id, whole_calls)
        self._state = REASONING if thinking_mode == "thinking" else CONTENT
        self._after_gt = BLOCK  # the state after EXPECT_GT
        self._return_state = CONTENT  # the state after STRAY
        self._buf = ""
        self._text: list[str] = []  # everything fed, for the reference check at finish()
        self._final = False
        self._finished = False
        self._stray_len = 0
        self._blocks = 0
        self.issues: list[str] = []
        self.saw_eos = False
        self.unfinished_call = False

    @property
    def malformed(self) -> bool:
        """Whether the completion deviated from the well-formed DSML / reasoning format so far."""
        return bool(self.issues)

    @property
    def tool_call_count(self) -> int:
        """How many tool calls were started so far."""
        return self._writer.call_count

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
        if self._writer.call is not None:
            self.unfinished_call = True
            self._writer.drop_call()  # with whole_calls nothing of it was sent; otherwise its arguments stay open
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
        self._writer.take()
        try:
            while self._step():
                pass
        except Exception as e:  # never raise into the server: drop the rest
            self._issue(f"internal error: {type(e).__name__}: {e}")
            self._state = DONE
            self._buf = ""
        return self._writer.take()

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
            # is a cut-off start of DSML markup (a truncated tool-call opener), which is dropped.
            if not partial_markup(self._buf):
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
            self._writer.text("reasoning_content", text)
        elif state == CONTENT:
            self._writer.text("content", text)
        elif state in (SKIP_INVOKE, SKIP_PARAM):
            pass
        elif text.strip():  # non-whitespace text between DSML tags: keep it, as content
            self._issue(f"text inside the tool-call markup: {text[:40]!r}")
            if state == AFTER_BLOCK:
                self._state = CONTENT
                text = text.lstrip()
            self._writer.text("content", text)

    def _on_marker(self, state: str, action: str, marker: str) -> None:
        if action == "eos":
            self.saw_eos = True
            if state == REASONING:
                self._issue("EOS inside the reasoning (no '</think>')")
            elif state in (BLOCK, INVOKE, SKIP_INVOKE, SKIP_PARAM):
                self._issue("tool-call block not terminated before EOS")
                self._writer.end_call()
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
            self._writer.end_call()
            self._state = AFTER_BLOCK
        elif action == "invoke_end":
            self._writer.end_call()
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
            self._writer.end_call()
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
        header = read_invoke_header(self._buf, self._final)
        if not self._take_header(header):
            return False
        if header.name is None:
            self._state = SKIP_INVOKE
        else:
            self._writer.start_call(header.name)
            self._state = INVOKE
        return True

    # Parameter header ------------------------------------------------------------------------------------

    def _step_param_header(self) -> bool:
        call = self._writer.call
        if call is None:  # a parameter outside an invoke (after a malformed invoke header)
            self._state = SKIP_PARAM
            return True
        header = read_param_header(self._buf, self._final)
        if not self._take_header(header):
            return False
        if header.name is not None and header.name in call.params:
            self._issue(f"duplicate parameter {header.name!r} dropped")
        elif header.name is not None:
            self._writer.start_param(header.name, header.is_string)
            self._state = VALUE
            return True
        self._state = SKIP_PARAM
        return True

    def _take_header(self, header: Header | None) -> bool:
        """Consume a header read at the start of the buffer; False: undecided yet, or truncated (text dropped)."""
        if header is None:
            return False
        if header.truncated:
            self._buf = ""
            return False
        if header.issue is not None:
            self._issue(header.issue)
        self._buf = self._buf[header.end :]
        return True

    # Parameter value -------------------------------------------------------------------------------------

    def _step_value(self) -> bool:
        buf = self._buf
        at = buf.find(VALUE_END)
        if at == -1:
            keep = 0 if self._final else held_suffix(buf, VALUE_END)
            self._writer.value(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._writer.value(buf[:at])
        self._writer.end_value()
        self._buf = buf[at + len(VALUE_END) :]
        self._after_gt = INVOKE
        self._state = EXPECT_GT
        return True
