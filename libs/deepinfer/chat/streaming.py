"""Streaming parser of DeepSeek-V4 completions into OpenAI chat-completion deltas.

Spec: /work/shared/design/CHAT_ENCODING.md §4.2 (the recommended state machine) on top of §3.2 / §4.1 (the
DSML grammar). Input is detokenized generated text with special tokens kept (EOS text included), split
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
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.tokens import (
    BOS,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
    THINKING_MODES,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_START,
)

__all__ = ["StreamingParser", "merge_deltas", "new_call_id"]

Delta = dict[str, Any]

# States.
_REASONING = "reasoning"
_CONTENT = "content"
_EXPECT_GT = "expect_gt"  # the ">" that ends `<｜DSML｜tool_calls`, `</｜DSML｜invoke` or `</｜DSML｜parameter`
_BLOCK = "block"  # inside `<｜DSML｜tool_calls>`, between invokes
_INVOKE_HEADER = "invoke_header"  # after `<｜DSML｜invoke`, up to the first parameter / end of the invoke
_INVOKE = "invoke"  # inside an invoke, between parameters
_PARAM_HEADER = "param_header"  # after `<｜DSML｜parameter`, up to `string="…">`
_VALUE = "value"  # a parameter value, up to `</｜DSML｜parameter`
_SKIP_INVOKE = "skip_invoke"  # an invoke without a usable name: dropped up to its end
_SKIP_PARAM = "skip_param"  # a parameter that cannot be used: dropped up to its end
_AFTER_BLOCK = "after_block"  # after `</｜DSML｜tool_calls>`: only EOS is expected
_STRAY = "stray"  # an unknown DSML tag: dropped up to its ">"
_DONE = "done"  # after EOS

_BLOCK_START_BARE = TOOL_CALLS_OPEN[:-1]  # "<｜DSML｜tool_calls" (no leading blank line)
_INVOKE_START = "\n\n" + INVOKE_OPEN  # an invoke without the block wrapper, after a blank line
_VALUE_END = f"</{DSML}parameter"
_PARAMETER_CLOSE = _VALUE_END + ">"
_STRAY_LIMIT = 256  # an unknown DSML tag is dropped up to its ">", a newline or this many characters
_HEADER_LIMIT = 4096  # an invoke / parameter header longer than this is given up
_PIECE = 1024  # feed() takes long texts this many characters at a time

# Same as the reference parser (dsml.py): the invoke header, and a parameter's `string` attribute.
_INVOKE_HEADER_RE = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
_LENIENT_NAME_RE = re.compile(r'name="([^"\n]*)"')
_PARAM_NAME_PREFIX = ' name="'
_PARAM_ATTR_RE = re.compile(r'" string="(true|false)">')
_LENIENT_PARAM_RE = re.compile(r'\s*name="([^"\n]*)"\s+string="(true|false)"\s*>')

# Markers of each "between tags" state -> action. At one position the longest marker wins, and a marker
# that could still complete (the buffer ends inside it) holds the text back.
_OPENERS = {
    EOS: "eos",
    BOS: "drop",
    THINK_START: "drop",
    DSML: "drop",
    f"<{DSML}": "stray",
    f"</{DSML}": "stray",
    TOOL_CALLS_START: "block",
    _BLOCK_START_BARE: "block",
    _INVOKE_START: "invoke",
    INVOKE_OPEN: "invoke",
}
_TABLES: dict[str, dict[str, str]] = {
    _REASONING: {**_OPENERS, THINK_END: "end_reasoning"},
    _CONTENT: {**_OPENERS, THINK_END: "drop"},
    _BLOCK: {**_OPENERS, THINK_END: "drop", TOOL_CALLS_CLOSE: "block_end"},
    _INVOKE: {
        **_OPENERS,
        THINK_END: "drop",
        PARAMETER_OPEN: "param",
        INVOKE_CLOSE: "invoke_end",
        TOOL_CALLS_CLOSE: "block_end",
    },
    _AFTER_BLOCK: {**_OPENERS, THINK_END: "drop"},
    _SKIP_INVOKE: {EOS: "eos", INVOKE_CLOSE: "invoke_end", TOOL_CALLS_CLOSE: "block_end", INVOKE_OPEN: "invoke"},
    _SKIP_PARAM: {
        EOS: "eos",
        _PARAMETER_CLOSE: "param_skipped",
        PARAMETER_OPEN: "param",
        INVOKE_CLOSE: "invoke_end",
        TOOL_CALLS_CLOSE: "block_end",
        INVOKE_OPEN: "invoke",
    },
}
_PREFIXES = {
    state: (frozenset(m[:i] for m in table for i in range(1, len(m))), max(map(len, table)))
    for state, table in _TABLES.items()
}
# Where the header of an invoke / parameter certainly ends.
_INVOKE_HEADER_ENDS = (PARAMETER_OPEN, INVOKE_CLOSE, EOS, TOOL_CALLS_CLOSE, INVOKE_OPEN)
_PARAM_HEADER_ENDS = (f"/{DSML}parameter", EOS, INVOKE_CLOSE, TOOL_CALLS_CLOSE, PARAMETER_OPEN, INVOKE_OPEN)


def new_call_id() -> str:
    """An OpenAI-style tool-call id: "call_" and 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _json_str_body(text: str) -> str:
    """JSON string escaping without the quotes; per character, so fragments concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


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
        self._state = _REASONING if thinking_mode == "thinking" else _CONTENT
        self._after_gt = _BLOCK  # the state after _EXPECT_GT
        self._return_state = _CONTENT  # the state after _STRAY
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
        return _REASONING in (self._state, self._return_state if self._state == _STRAY else None)

    def feed(self, delta_text: str) -> list[Delta]:
        """Consume more generated text; return the delta fragments it completes (possibly none)."""
        if self._finished:
            self._issue("text fed after finish()")
            return []
        if not delta_text:
            return []
        self._text.append(delta_text)
        out: list[Delta] = []
        for i in range(0, len(delta_text), _PIECE):  # bounded pieces keep the buffer (and each step) short
            self._buf += delta_text[i : i + _PIECE]
            out += self._run()
        return _merge_adjacent(out)

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
            self._state = _DONE
            self._buf = ""
        out, self._out = self._out, []
        return out

    def _issue(self, message: str) -> None:
        if len(self.issues) < 100:
            self.issues.append(message)

    def _step(self) -> bool:
        """Advance once; False when nothing more can be done with the buffered text."""
        state = self._state
        if state == _DONE:
            if self._buf.strip():
                self._issue("text after EOS ignored")
            self._buf = ""
            return False
        if not self._buf:
            return False
        if state in _TABLES:
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
        table = _TABLES[state]
        at, marker = len(buf), None
        for m in table:
            i = buf.find(m, 0, at + len(m))
            if i != -1 and (i < at or (i == at and marker is not None and len(m) > len(marker))):
                at, marker = i, m
        prefixes, longest = _PREFIXES[state]
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
        self._on_marker(state, _TABLES[state][marker], marker)
        return True

    def _on_text(self, state: str, text: str) -> None:
        if not text:
            return
        if state == _REASONING:
            self._emit_text("reasoning_content", text)
        elif state == _CONTENT:
            self._emit_text("content", text)
        elif state in (_SKIP_INVOKE, _SKIP_PARAM):
            pass
        elif text.strip():  # non-whitespace text between DSML tags: keep it, as content
            self._issue(f"text inside the tool-call markup: {text[:40]!r}")
            if state == _AFTER_BLOCK:
                self._state = _CONTENT
                text = text.lstrip()
            self._emit_text("content", text)

    def _on_marker(self, state: str, action: str, marker: str) -> None:
        if action == "eos":
            self.saw_eos = True
            if state == _REASONING:
                self._issue("EOS inside the reasoning (no '</think>')")
            elif state in (_BLOCK, _INVOKE, _SKIP_INVOKE, _SKIP_PARAM):
                self._issue("tool-call block not terminated before EOS")
                self._end_call()
            self._state = _DONE
        elif action == "end_reasoning":
            self._state = _CONTENT
        elif action == "drop":
            self._issue(f"{marker!r} dropped")
            if state == _AFTER_BLOCK and marker == THINK_END:
                self._state = _CONTENT
        elif action == "stray":
            self._issue(f"unexpected DSML tag {marker!r}… dropped")
            self._return_state = state
            self._stray_len = 0
            self._state = _STRAY
        elif action in ("block", "invoke"):
            self._open_block(state, marker)
            self._state = _INVOKE_HEADER
            if action == "block":
                self._after_gt = _BLOCK
                self._state = _EXPECT_GT
        elif action == "block_end":
            if state in (_INVOKE, _SKIP_PARAM):
                self._issue("invoke not terminated before the end of the block")
            self._end_call()
            self._state = _AFTER_BLOCK
        elif action == "invoke_end":
            self._end_call()
            self._after_gt = _BLOCK
            self._state = _EXPECT_GT
        elif action == "param":
            self._state = _PARAM_HEADER
        elif action == "param_skipped":
            self._state = _INVOKE

    def _open_block(self, state: str, marker: str) -> None:
        """Bookkeeping and issues for a block or invoke opener found in `state`."""
        if state in (_REASONING, _CONTENT, _AFTER_BLOCK):
            if state == _REASONING:
                self._issue("tool call before '</think>': the reasoning ends there")
            if self._blocks:
                self._issue("second tool-call block")
            elif marker != TOOL_CALLS_START:
                self._issue(f"tool-call block opened by {marker!r} instead of {TOOL_CALLS_START!r}")
            self._blocks += 1
            return
        if state in (_INVOKE, _SKIP_PARAM):
            self._issue("invoke not terminated before the next one")
            self._end_call()
        if marker in (TOOL_CALLS_START, _BLOCK_START_BARE):
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
        limit = _STRAY_LIMIT - self._stray_len
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
        hits = [(i, t) for t in _INVOKE_HEADER_ENDS if (i := buf.find(t)) != -1]
        if not hits and not self._final and len(buf) <= _HEADER_LIMIT:
            return False
        at, tag = min(hits) if hits else (len(buf), "")
        header = buf[:at]
        match = _INVOKE_HEADER_RE.fullmatch(header) if tag in (PARAMETER_OPEN, INVOKE_CLOSE) else None
        if match is None:
            if not tag and self._final:
                self._buf = ""  # truncated inside the header: the call never started
                return False
            self._issue(f"malformed invoke header {header[:60]!r}")
            match = _LENIENT_NAME_RE.search(header)
        self._buf = buf[at:]
        if match is None:
            self._state = _SKIP_INVOKE
        else:
            self._start_call(match.group(1))
            self._state = _INVOKE
        return True

    # Parameter header ------------------------------------------------------------------------------------

    def _step_param_header(self) -> bool:
        buf = self._buf
        call = self._call
        if call is None:  # a parameter outside an invoke (after a malformed invoke header)
            self._state = _SKIP_PARAM
            return True
        stop = min((i for t in _PARAM_HEADER_ENDS if (i := buf.find(t)) != -1), default=-1)
        prefixed = buf.startswith(_PARAM_NAME_PREFIX)
        attr = _PARAM_ATTR_RE.search(buf, len(_PARAM_NAME_PREFIX)) if prefixed else None
        undecided = stop == -1 and not self._final and len(buf) <= _HEADER_LIMIT
        if attr is not None and (stop == -1 or stop >= attr.end()):
            # As the reference: the name runs up to the first `" string="true|false">`.
            name, is_string, rest = buf[len(_PARAM_NAME_PREFIX) : attr.start()], attr.group(1) == "true", attr.end()
        elif undecided and (prefixed or _PARAM_NAME_PREFIX.startswith(buf)):
            return False
        else:
            lenient = _LENIENT_PARAM_RE.match(buf)
            if lenient is None or (stop != -1 and lenient.end() > stop):
                if undecided and ">" not in buf:
                    return False
                if stop == -1 and self._final:
                    self._buf = ""  # truncated inside the header
                    return False
                self._issue(f"malformed parameter header {buf[:60]!r} dropped")
                self._state = _SKIP_PARAM
                return True
            self._issue(f"malformed parameter header {buf[: lenient.end()]!r}")
            name, is_string, rest = lenient.group(1), lenient.group(2) == "true", lenient.end()
        self._buf = buf[rest:]
        if name in call.params:
            self._issue(f"duplicate parameter {name!r} dropped")
            self._state = _SKIP_PARAM
            return True
        self._emit_args(("{" if not call.params else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        call.params.add(name)
        call.value_is_string = is_string
        if is_string:
            self._emit_args('"')
        self._state = _VALUE
        return True

    # Parameter value -------------------------------------------------------------------------------------

    def _step_value(self) -> bool:
        buf = self._buf
        at = buf.find(_VALUE_END)
        if at == -1:
            keep = 0 if self._final else _held_suffix(buf, _VALUE_END)
            self._emit_value(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._emit_value(buf[:at])
        if self._call is not None and self._call.value_is_string:
            self._emit_args('"')
        self._buf = buf[at + len(_VALUE_END) :]
        self._after_gt = _INVOKE
        self._state = _EXPECT_GT
        return True

    def _emit_value(self, text: str) -> None:
        if text and self._call is not None:
            self._emit_args(_json_str_body(text) if self._call.value_is_string else text)


def _merge_adjacent(deltas: list[Delta]) -> list[Delta]:
    """Join consecutive text fragments of one kind, and consecutive argument fragments of one call."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and delta.keys() == last.keys() and "tool_calls" not in delta:
            key = next(iter(delta))
            out[-1] = {key: last[key] + delta[key]}
            continue
        if last is not None and "tool_calls" in delta and "tool_calls" in last:
            entry, prev = delta["tool_calls"][0], last["tool_calls"][0]
            if "id" not in entry and entry["index"] == prev["index"] and "id" not in prev:
                arguments = prev["function"]["arguments"] + entry["function"]["arguments"]
                out[-1] = {"tool_calls": [{"index": entry["index"], "function": {"arguments": arguments}}]}
                continue
        out.append(delta)
    return out


def merge_deltas(deltas: list[Delta]) -> dict[str, Any]:
    """Fold delta fragments into a message: {"reasoning_content", "content", "tool_calls"}.

    tool_calls is a list of {"id", "type": "function", "function": {"name", "arguments"}} in index order.
    """
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        reasoning.append(delta.get("reasoning_content", ""))
        content.append(delta.get("content", ""))
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(
                entry["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if "id" in entry:
                call["id"] = entry["id"]
            function = entry.get("function", {})
            call["function"]["name"] += function.get("name", "")
            call["function"]["arguments"] += function.get("arguments", "")
    return {
        "reasoning_content": "".join(reasoning),
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
