"""Strict parser of a DeepSeek-V4 completion into reasoning, content and tool calls.

Follows `parse_message_from_completion_text` of DeepSeek's reference encoder (`encoding/encoding_dsv4.py`,
DeepSeek-V4-Flash). Spec: docs/chat_format.md, "Parsing completions". The text is the raw generation
(prompt excluded) including the EOS text; any deviation from the well-formed grammar raises ValueError.
For a tolerant streaming parser see ``chat.streaming`` (docs/chat_format.md, "Streaming parser").
"""

from typing import Any

from deepinfer.chat.dsml import parse_tool_calls
from deepinfer.chat.tokens import BOS, DSML, EOS, THINK_END, THINK_START, THINKING_MODES, TOOL_CALLS_START

_FORBIDDEN_IN_TEXT = (BOS, EOS, THINK_START, THINK_END, DSML)


def _split_reasoning(text: str) -> tuple[str, int]:
    """Reasoning (up to the first `</think>`) and the position after `</think>`."""
    end = text.find(THINK_END)
    if end == -1:
        raise ValueError("malformed completion: thinking mode but no '</think>'")
    block = text.find(TOOL_CALLS_START)
    if block != -1 and block < end:
        raise ValueError("malformed completion: tool-call block starts before '</think>'")
    return text[:end], end + len(THINK_END)


def parse_completion(text: str, thinking_mode: str) -> dict[str, Any]:
    """Parse a completion into {"reasoning_content", "content", "tool_calls"}.

    tool_calls is a list of {"type": "function", "function": {"name", "arguments"}} with `arguments` a JSON
    object string (string parameters JSON-quoted, others pasted verbatim, as the reference does); no ids.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode: expected one of {THINKING_MODES}, got {thinking_mode!r}")
    if not isinstance(text, str):
        raise ValueError(f"completion: expected a string, got {type(text).__name__}")
    reasoning, pos = _split_reasoning(text) if thinking_mode == "thinking" else ("", 0)
    eos = text.find(EOS, pos)
    block = text.find(TOOL_CALLS_START, pos)
    calls: list[dict[str, str]] = []
    if block != -1 and (eos == -1 or block < eos):
        content = text[pos:block]
        calls, pos = parse_tool_calls(text, block + len(TOOL_CALLS_START))
        # Only EOS may follow the block; like the reference, a block that ends the text is accepted.
        if text[pos:] not in ("", EOS):
            raise ValueError(f"malformed completion: unexpected text after the tool-call block: {text[pos:]!r}")
    elif eos != -1:
        content = text[pos:eos]
        if text[eos + len(EOS) :]:
            raise ValueError(f"malformed completion: text after EOS: {text[eos + len(EOS) :]!r}")
    else:
        raise ValueError("malformed completion: no EOS (truncated output?)")
    for token in _FORBIDDEN_IN_TEXT:
        for field, value in (("content", content), ("reasoning_content", reasoning)):
            if token in value:
                raise ValueError(f"malformed completion: {token!r} inside {field}")
    return {
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": [{"type": "function", "function": call} for call in calls],
    }
