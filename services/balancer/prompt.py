"""The prompt of a request: text, token ids, or a chat rendered with DeepSeek's chat encoding, then tokenized."""

from __future__ import annotations

import json

from deepinfer.chat import encode_messages
from deepinfer.tokenizer import encode_ids
from deepinfer.v1 import generation_pb2


def chat_to_messages(chat: generation_pb2.ChatInput) -> tuple[list[dict], list[dict] | None]:
    """The wire conversation as the OpenAI-style dicts the chat encoding takes."""
    messages = []
    for i, m in enumerate(chat.messages):
        d: dict = {"role": m.role, "content": m.content}
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        messages.append(d)
        if not m.role:
            raise ValueError(f"chat.messages[{i}].role: required")
    tools = None
    if chat.tools:
        tools = []
        for i, t in enumerate(chat.tools):
            try:
                params = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
            except json.JSONDecodeError as e:
                raise ValueError(f"chat.tools[{i}].parameters: not valid JSON ({e})") from e
            tools.append(
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": params}}
            )
    return messages, tools


def build_prompt(
    tokenizer: object, which: str | None, req: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest
) -> tuple[list[int], str | None, list[dict] | None]:
    """Prompt ids, prompt text and (chat) the tools it renders."""
    if which == "text":
        return encode_ids(tokenizer, req.text), req.text, None
    if which == "token_ids":
        return list(req.token_ids.ids), None, None
    if which == "chat":
        messages, tools = chat_to_messages(req.chat)
        text = encode_messages(
            messages,
            thinking_mode=req.chat.thinking_mode or "chat",
            reasoning_effort=req.chat.reasoning_effort or None,
            tools=tools,
        )
        return encode_ids(tokenizer, text), text, tools
    raise ValueError("input: one of text, token_ids or chat is required")
