"""DeepSeek-V4 prompt rendering: OpenAI-style messages -> the exact prompt text the model was trained on.

Byte-exact with `encode_messages` of DeepSeek's reference encoder (`encoding/encoding_dsv4.py` of
deepseek-ai/DeepSeek-V4-Flash, April release) on well-formed input; malformed input raises ValueError instead.
Spec: docs/chat_format.md (the prompt shape, rendering by role, the generation prompt, tools).
Tokenize the result with `add_special_tokens=False`: BOS is part of the text.
"""

from typing import Any

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.conversation import Turn, build_turns, drop_earlier_reasoning, last_user_index
from deepinfer.chat.dsml import render_tool_calls, render_tools_section, to_json
from deepinfer.chat.tokens import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    REASONING_EFFORT_MAX,
    REASONING_EFFORTS,
    RESPONSE_FORMAT_HEADER,
    TASK_TOKENS,
    THINK_END,
    THINK_START,
    THINKING_MODES,
    USER,
)

__all__ = ["encode_messages", "parse_completion"]


class _Renderer:
    """Renders the turns of one request; `keep_reasoning` is the negation of the effective drop_thinking."""

    def __init__(self, turns: list[Turn], thinking: bool, keep_reasoning: bool) -> None:
        self.turns = turns
        self.thinking = thinking
        self.keep_reasoning = keep_reasoning
        self.last_user = last_user_index(turns)

    def render(self) -> str:
        parts = []
        for i, turn in enumerate(self.turns):
            parts.append(self._body(i, turn))
            nxt = self.turns[i + 1] if i + 1 < len(self.turns) else None
            if nxt is None or nxt.role in ("assistant", "latest_reminder"):
                parts.append(self._transition(i, turn))
        return "".join(parts)

    def _body(self, i: int, turn: Turn) -> str:
        if turn.role == "system":
            return turn.content + self._instructions(turn)
        if turn.role == "developer":
            return USER + turn.content + self._instructions(turn)
        if turn.role == "user":
            texts = (f"<tool_result>{b.text}</tool_result>" if b.is_result else b.text for b in turn.blocks)
            return USER + "\n\n".join(texts)
        if turn.role == "latest_reminder":
            return LATEST_REMINDER + turn.content
        return self._assistant(i, turn)

    @staticmethod
    def _instructions(turn: Turn) -> str:
        """Tools section and response format of a system or developer turn."""
        text = ""
        if turn.tools:
            text += "\n\n" + render_tools_section(turn.tools)
        if turn.response_format:
            text += "\n\n" + RESPONSE_FORMAT_HEADER + to_json(turn.response_format)
        return text

    def _assistant(self, i: int, turn: Turn) -> str:
        after_task = i > 0 and self.turns[i - 1].task is not None
        think = ""
        if self.thinking and not after_task and (self.keep_reasoning or i > self.last_user):
            think = turn.reasoning + THINK_END
        calls = "\n\n" + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
        return think + turn.content + calls + ("" if turn.wo_eos else EOS)

    def _transition(self, i: int, turn: Turn) -> str:
        """What follows a turn that ends the prompt or precedes an assistant / latest_reminder turn."""
        if turn.task == "action":
            return ASSISTANT + (THINK_START if self.thinking else THINK_END) + TASK_TOKENS["action"]
        if turn.task is not None:
            return TASK_TOKENS[turn.task]
        if turn.role in ("user", "developer"):
            opens = self.thinking and (self.keep_reasoning or i >= self.last_user)
            return ASSISTANT + (THINK_START if opens else THINK_END)
        return ""


def encode_messages(
    messages: list[dict[str, Any]],
    thinking_mode: str = "chat",
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_bos: bool = True,
) -> str:
    """Render a chat request as a DeepSeek-V4 prompt.

    messages: OpenAI-style messages (system, user, developer, latest_reminder, assistant, tool), with the
        reference's extra fields: message-level `tools` / `response_format` on system and developer messages,
        `reasoning_content` (or `reasoning`) and `wo_eos` on assistant messages, `task` on any message.
    thinking_mode: "chat" (prompt ends with `</think>`) or "thinking" (prompt ends with `<think>`).
    drop_thinking: drop reasoning before the last user turn; forced off when any tools are present.
    reasoning_effort: None or "high" render nothing; "max" prefixes the reference's effort text in
        thinking mode.
    tools: request-level OpenAI tools, attached to the first system message (an empty system message is
        inserted at index 0 when there is none). Pass None for `tool_choice: "none"`.
    add_bos: start with BOS; False for continuing an already-encoded prefix.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode: expected one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: expected one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    turns = build_turns(messages, tools)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(turn.tools for turn in turns)
    if thinking and drop:
        turns = drop_earlier_reasoning(turns)
    prefix = BOS if add_bos else ""
    if thinking and reasoning_effort == "max" and turns:
        prefix += REASONING_EFFORT_MAX
    return prefix + _Renderer(turns, thinking, keep_reasoning=not drop).render()
