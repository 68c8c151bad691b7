"""Request messages -> validated turns, ready to render as a DeepSeek-V4 prompt.

Implements the preprocessing of DeepSeek's reference encoder (`encoding/encoding_dsv4.py`,
DeepSeek-V4-Flash): tool results merged into user turns, consecutive user messages merged, tool results
re-ordered by the preceding assistant's call ids, and earlier reasoning dropped.
Spec: docs/chat_format.md, "Preprocessing of messages", "Edge cases and validation", "Tools section" and
"Tool results".
Bad input raises ValueError naming the message index and field.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from deepinfer.chat.dsml import ToolCall, to_json
from deepinfer.chat.tokens import TASK_TOKENS

ROLES = ("system", "user", "developer", "latest_reminder", "assistant", "tool")
_TOOL_ROLES = ("system", "developer")  # the roles that may carry `tools` / `response_format`


@dataclass(frozen=True)
class Block:
    """A piece of a user turn: plain text, or a tool result when `tool_call_id` is not None."""

    text: str
    tool_call_id: str | None = None

    @property
    def is_result(self) -> bool:
        return self.tool_call_id is not None


@dataclass
class Turn:
    """One message after validation; user text and tool results live in `blocks`."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    response_format: Any = None
    task: str | None = None
    wo_eos: bool = False
    blocks: list[Block] = field(default_factory=list)


def _text(value: Any, where: str) -> str:
    """Message text: a string, None (""), or OpenAI text parts joined by a blank line."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}[{k}]: only text parts ({{'type': 'text', 'text': str}}) are supported")
            texts.append(part["text"])
        return "\n\n".join(texts)
    raise ValueError(f"{where}: expected a string, null or a list of text parts, got {type(value).__name__}")


def _tool_result_text(value: Any, where: str) -> str:
    """Tool-result text; in a list, non-text parts become `[Unsupported <type>]` as in the reference."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a string, null or a list of parts, got {type(value).__name__}")
    texts = []
    for k, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{k}]: expected an object, got {type(part).__name__}")
        texts.append(part.get("text", "") if part.get("type") == "text" else f"[Unsupported {part.get('type')}]")
    return "\n\n".join(texts)


def _json_value(value: Any, where: str) -> Any:
    try:
        to_json(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: not JSON-serializable ({err})") from None
    return value


def _functions(tools: Any, where: str) -> list[dict[str, Any]]:
    """The `function` objects of OpenAI-format tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"{where}: expected a list of tools, got {type(tools).__name__}")
    functions = []
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"{where}[{k}]: expected {{'type': 'function', 'function': {{...}}}}")
        functions.append(_json_value(function, f"{where}[{k}].function"))
    return functions


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    """Decode `function.arguments`; it must be a JSON object (a dict is taken as its JSON text)."""
    if isinstance(raw, dict):
        raw = to_json(_json_value(raw, where))
    if not isinstance(raw, str):
        raise ValueError(f"{where}: expected a JSON object string, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must decode to a JSON object, got {type(value).__name__}")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ValueError(f"{where}: expected a list, got {type(calls).__name__}")
    parsed = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"{where}[{k}]: expected {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}[{k}].function.name: expected a non-empty string")
        arguments = _arguments(function.get("arguments"), f"{where}[{k}].function.arguments")
        call_id = _optional_str(call.get("id") or function.get("id"), f"{where}[{k}].id") or ""
        parsed.append(ToolCall(name=name, arguments=arguments, call_id=call_id))
    return parsed


def _turn(msg: Any, i: int) -> Turn:
    """Validate one request message and convert it to a Turn."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    task = msg.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise ValueError(f"{where}.task: unknown task {task!r} (expected one of {', '.join(TASK_TOKENS)})")
    for key in ("tools", "response_format"):
        if msg.get(key) and role not in _TOOL_ROLES:
            raise ValueError(f"{where}.{key}: only allowed on system or developer messages, not {role!r}")
    turn = Turn(role=role, task=task, wo_eos=bool(msg.get("wo_eos", False)))
    if role == "tool":
        call_id = _optional_str(msg.get("tool_call_id"), f"{where}.tool_call_id") or ""
        text = _tool_result_text(msg.get("content"), f"{where}.content")
        turn.blocks = [Block(text, tool_call_id=call_id)]
        return turn
    content = _text(msg.get("content"), f"{where}.content")
    if role == "user":
        turn.blocks = [Block(content)]
    turn.content = content
    if role == "developer" and not content:
        raise ValueError(f"{where}.content: a developer message needs non-empty content")
    if role in _TOOL_ROLES:
        turn.tools = _functions(msg.get("tools"), f"{where}.tools")
        turn.response_format = _json_value(msg.get("response_format"), f"{where}.response_format")
    if role == "assistant":
        key = "reasoning_content" if msg.get("reasoning_content") is not None else "reasoning"
        turn.reasoning = _optional_str(msg.get(key), f"{where}.{key}") or ""
        turn.tool_calls = _tool_calls(msg.get("tool_calls"), f"{where}.tool_calls")
    return turn


def _attach_request_tools(turns: list[Turn], tools: Any) -> None:
    """Put request-level tools on the first system turn, inserting an empty one at index 0 if none."""
    functions = _functions(tools, "tools")
    if not functions:
        return
    for i, turn in enumerate(turns):
        if turn.role == "system":
            if turn.tools:
                raise ValueError(f"tools: messages[{i}] (the first system message) already has its own tools")
            turn.tools = functions
            return
    turns.insert(0, Turn(role="system", tools=functions))


def _merge_user_turns(turns: list[Turn]) -> list[Turn]:
    """Fold tool results and consecutive user messages into single user turns (not after a task)."""
    merged: list[Turn] = []
    for turn in turns:
        prev = merged[-1] if merged and merged[-1].role == "user" else None
        if turn.role == "tool":
            if prev is not None:
                prev.blocks = prev.blocks + turn.blocks
            else:
                merged.append(Turn(role="user", blocks=list(turn.blocks)))
        elif turn.role == "user" and prev is not None and prev.task is None:
            prev.blocks = prev.blocks + turn.blocks
        else:
            merged.append(replace(turn))
    return merged


def _ordered_results(blocks: list[Block], order: dict[str, int]) -> Iterator[Block]:
    results = sorted((b for b in blocks if b.is_result), key=lambda b: order.get(b.tool_call_id or "", 0))
    it = iter(results)
    return (next(it) if b.is_result else b for b in blocks)


def _order_tool_results(turns: list[Turn]) -> None:
    """Sort each user turn's tool results by the call order of the latest assistant turn with calls."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call.call_id: k for k, call in enumerate(turn.tool_calls) if call.call_id}
        elif turn.role == "user":
            turn.blocks = list(_ordered_results(turn.blocks, order))


def build_turns(messages: Any, tools: Any = None) -> list[Turn]:
    """Validate `messages` (and request-level `tools`) and return the merged, ordered turns."""
    if not isinstance(messages, list):
        raise ValueError(f"messages: expected a list, got {type(messages).__name__}")
    turns = [_turn(msg, i) for i, msg in enumerate(messages)]
    _attach_request_tools(turns, tools)
    turns = _merge_user_turns(turns)
    _order_tool_results(turns)
    return turns


def last_user_index(turns: list[Turn]) -> int:
    """Index of the last user or developer turn, or -1."""
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def drop_earlier_reasoning(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: strip assistant reasoning and delete developer turns."""
    last = last_user_index(turns)
    kept = []
    for i, turn in enumerate(turns):
        if i >= last or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=""))
    return kept
