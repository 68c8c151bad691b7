"""OpenAI chat-completion delta fragments of the streaming parser (``chat.streaming``): tool-call ids, the JSON
escaping of string arguments, and folding fragments together."""

from __future__ import annotations

import json
import secrets
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
