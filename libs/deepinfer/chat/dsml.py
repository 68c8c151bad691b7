"""DSML, the tool markup of DeepSeek-V4: the tools section, rendering tool calls, parsing a tool-call block.

Byte-exact with `render_tools`, `encode_arguments_to_dsml` and `parse_tool_calls` of DeepSeek's reference
encoder (`encoding/encoding_dsv4.py`, DeepSeek-V4-Flash). Spec: docs/chat_format.md, "Tools section", "Tool calls
in DSML", "Tool calls in history" and "Parsing completions". The parser is stricter than the reference in one way:
an unterminated block is an error.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from deepinfer.chat.tokens import (
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_OPEN,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOLS_SECTION,
)

_PARAMETER_END = f"/{DSML}parameter"
_INVOKE_HEADER = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
_PARAMETER_BODY = re.compile(r' name="(.*?)" string="(true|false)">(.*)<', re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant turn: the function name, its arguments (a JSON object) and the call id."""

    name: str
    arguments: dict[str, Any]
    call_id: str = ""


def to_json(value: Any) -> str:
    """Serialize like the reference (`json.dumps(..., ensure_ascii=False)`)."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_section(functions: list[dict[str, Any]]) -> str:
    """The "## Tools" section listing `functions` (the `function` objects of OpenAI tools), one per line."""
    return TOOLS_SECTION.replace("{schemas}", "\n".join(to_json(f) for f in functions))


def _render_parameter(key: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    flag = "true" if is_string else "false"
    return f'<{DSML}parameter name="{key}" string="{flag}">{text}</{DSML}parameter>'


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The `<｜DSML｜tool_calls>` block (without the leading blank line) for a non-empty list of calls."""
    invokes = []
    for call in calls:
        params = "\n".join(_render_parameter(k, v) for k, v in call.arguments.items())
        invokes.append(f'{INVOKE_OPEN} name="{call.name}">\n{params}\n{INVOKE_CLOSE}>')
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _arguments_json(params: dict[str, tuple[str, bool]]) -> str:
    """Rebuild the OpenAI `arguments` string: string values are JSON-quoted, others pasted verbatim."""
    items = [f"{to_json(k)}: {to_json(v) if is_str else v}" for k, (v, is_str) in params.items()]
    return "{" + ", ".join(items) + "}"


def _expect(text: str, pos: int, literal: str, where: str) -> int:
    if not text.startswith(literal, pos):
        if literal.startswith(text[pos:]):
            raise ValueError(f"malformed tool-call block: unterminated, the text ends where {literal!r} is due")
        found = text[pos : pos + len(literal) + 20]
        raise ValueError(f"malformed tool-call block: expected {literal!r} {where}, found {found!r}")
    return pos + len(literal)


def _next_tag(text: str, pos: int, tags: tuple[str, ...], where: str) -> tuple[int, str]:
    """Position and identity of the earliest of `tags` at or after `pos`."""
    hits = [(text.find(tag, pos), tag) for tag in tags]
    hits = [(at, tag) for at, tag in hits if at != -1]
    if not hits:
        raise ValueError(f"malformed tool-call block: unterminated {where} (expected one of {list(tags)})")
    return min(hits)


def _parse_parameter(text: str, pos: int, params: dict[str, tuple[str, bool]]) -> int:
    """Parse one parameter starting right after `<｜DSML｜parameter`; return the position after it."""
    end = text.find(_PARAMETER_END, pos)
    if end == -1:
        raise ValueError("malformed tool-call block: unterminated parameter")
    match = _PARAMETER_BODY.fullmatch(text, pos, end)
    if match is None:
        raise ValueError(f"malformed tool-call parameter: {text[pos:end]!r}")
    name, flag, value = match.groups()
    if name in params:
        raise ValueError(f"malformed tool-call block: duplicate parameter name {name!r}")
    params[name] = (value, flag == "true")
    return end + len(_PARAMETER_END)


def _parse_invoke(text: str, pos: int) -> tuple[dict[str, str], int]:
    """Parse one invoke starting right after `<｜DSML｜invoke`; return the call and the position after it."""
    at, tag = _next_tag(text, pos, (PARAMETER_OPEN, INVOKE_CLOSE), "invoke")
    header = _INVOKE_HEADER.fullmatch(text, pos, at)
    if header is None:
        raise ValueError(f"malformed tool-call invoke header: {text[pos:at]!r}")
    params: dict[str, tuple[str, bool]] = {}
    pos = at + len(tag)
    while tag == PARAMETER_OPEN:
        pos = _parse_parameter(text, pos, params)
        pos = _expect(text, pos, ">\n", "after a parameter")
        tag = next((t for t in (PARAMETER_OPEN, INVOKE_CLOSE) if text.startswith(t, pos)), "")
        if not tag:
            problem = "unterminated invoke" if pos == len(text) else "expected a parameter or the end of the invoke"
            raise ValueError(f"malformed tool-call block: {problem}")
        pos += len(tag)
    return {"name": header.group(1), "arguments": _arguments_json(params)}, pos


def parse_tool_calls(text: str, pos: int) -> tuple[list[dict[str, str]], int]:
    """Parse a tool-call block whose `\\n\\n<｜DSML｜tool_calls` opener ends at `pos`.

    Returns the calls as {"name", "arguments"} dicts and the position just after `</｜DSML｜tool_calls>`.
    """
    calls = []
    while True:
        pos = _expect(text, pos, ">\n", "before an invoke or the end of the block")
        if text.startswith(TOOL_CALLS_CLOSE, pos):
            return calls, pos + len(TOOL_CALLS_CLOSE)
        pos = _expect(text, pos, INVOKE_OPEN, "at the start of an invoke")
        call, pos = _parse_invoke(text, pos)
        calls.append(call)
