"""OpenAI chat-completion delta fragments of the streaming parser (``chat.streaming``): tool-call ids, the JSON
escaping of string arguments, writing the fragments of one parse step (:class:`DeltaWriter`) and folding fragments
together."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Delta = dict[str, Any]


def new_call_id() -> str:
    """An OpenAI-style tool-call id: "call_" and 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def json_str_body(text: str) -> str:
    """JSON string escaping without the quotes; per character, so fragments concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class OpenCall:
    """The tool call being streamed: its index, the parameters seen so far and the kind of the current value."""

    index: int
    params: set[str] = field(default_factory=set)
    value_is_string: bool = False


class DeltaWriter:
    """Builds the delta fragments of one parse step (``out``, taken with :meth:`take`): text of either kind and the
    tool calls, their ``arguments`` written as the JSON object ``{"k": v, "k2": v2}`` fragment by fragment.

    id_factory: makes the id of each tool call. ``call`` is the call being streamed (None between calls);
    ``call_count`` counts the calls started. With ``whole_calls`` a call is held back until it closes and then
    written as one fragment (id, name and the whole ``arguments``); :meth:`drop_call` discards an open one."""

    def __init__(self, id_factory: Callable[[], str], whole_calls: bool = False) -> None:
        self._id_factory = id_factory
        self.out: list[Delta] = []
        self.call: OpenCall | None = None
        self.call_count = 0
        self._whole = whole_calls
        self._held: dict[str, Any] | None = None  # the open call's entry (whole_calls)

    def take(self) -> list[Delta]:
        """The fragments written since the last call (and start anew)."""
        out, self.out = self.out, []
        return out

    def text(self, key: str, text: str) -> None:
        """``text`` as ``{key: text}`` ("content" or "reasoning_content"), joined to the last fragment of that key."""
        if not text:
            return
        last = self.out[-1] if self.out else None
        if last is not None and key in last:
            last[key] += text
        else:
            self.out.append({key: text})

    def args(self, text: str) -> None:
        """An ``arguments`` fragment of the open call (dropped when none is open)."""
        if not text or self.call is None:
            return
        if self._held is not None:
            self._held["function"]["arguments"] += text
            return
        last = self.out[-1] if self.out else None
        if last is not None and "tool_calls" in last:
            entry = last["tool_calls"][0]
            if entry["index"] == self.call.index and "id" not in entry:
                entry["function"]["arguments"] += text
                return
        self.out.append({"tool_calls": [{"index": self.call.index, "function": {"arguments": text}}]})

    def start_call(self, name: str) -> None:
        """Open the next tool call: its id, type and name, with empty ``arguments``."""
        self.call = OpenCall(index=self.call_count)
        self.call_count += 1
        call = {"name": name, "arguments": ""}
        entry = {"index": self.call.index, "id": self._id_factory(), "type": "function", "function": call}
        if self._whole:
            self._held = entry
        else:
            self.out.append({"tool_calls": [entry]})

    def end_call(self) -> None:
        """Close the open call's ``arguments`` object (if a call is open)."""
        if self.call is not None:
            self.args("}" if self.call.params else "{}")
            self.call = None
            if self._held is not None:
                self.out.append({"tool_calls": [self._held]})
                self._held = None

    def drop_call(self) -> None:
        """Discard the open call (with ``whole_calls`` none of it has been written)."""
        self.call, self._held = None, None

    def start_param(self, name: str, is_string: bool) -> None:
        """The key of a new parameter of the open call (and the opening quote of a string value)."""
        call = self.call
        self.args(("{" if not call.params else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        call.params.add(name)
        call.value_is_string = is_string
        if is_string:
            self.args('"')

    def value(self, text: str) -> None:
        """A piece of the current parameter's value: JSON-escaped in a string, verbatim otherwise."""
        if text and self.call is not None:
            self.args(json_str_body(text) if self.call.value_is_string else text)

    def end_value(self) -> None:
        """The end of the current parameter's value (the closing quote of a string)."""
        if self.call is not None and self.call.value_is_string:
            self.args('"')


def merge_adjacent(deltas: list[Delta]) -> list[Delta]:
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
