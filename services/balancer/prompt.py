"""The prompt of a request: text, token ids, or a chat rendered with DeepSeek's chat encoding, then tokenized."""

from __future__ import annotations

import json

from deepinfer.chat import encode_messages
from deepinfer.tokenizer import encode_ids
from deepinfer.v1 import generation_pb2


def chat_to_messages(
    chat: generation_pb2.ChatInput, placeholder: str | None = None
) -> tuple[list[dict], list[dict] | None]:
    """The wire conversation as the OpenAI-style dicts the chat encoding takes; an image part becomes a text part
    holding ``placeholder`` (the model's image placeholder token; None: the model takes no images)."""
    messages = []
    for i, m in enumerate(chat.messages):
        d: dict = {"role": m.role, "content": _parts(m, i, placeholder) if m.parts else m.content}
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


def _parts(m: generation_pb2.ChatMessage, i: int, placeholder: str | None) -> list[dict]:
    where = f"chat.messages[{i}]"
    if m.content:
        raise ValueError(f"{where}.content: must be empty when parts are given")
    out = []
    for k, part in enumerate(m.parts):
        which = part.WhichOneof("part")
        if which is None:
            raise ValueError(f"{where}.parts[{k}]: text or image required")
        if which == "image" and placeholder is None:
            raise ValueError(f"{where}.parts[{k}].image: this model takes no image input")
        out.append({"type": "text", "text": part.text if which == "text" else placeholder})
    return out


def prompt_images(which: str | None, req: generation_pb2.GenerateRequest) -> list[bytes]:
    """The request's images, in prompt order (chat: its messages' image parts; text / token ids: ``images``)."""
    if which == "chat":
        return [p.image for m in req.chat.messages for p in m.parts if p.WhichOneof("part") == "image"]
    if req.images and which not in ("text", "token_ids"):
        raise ValueError("images: only with text or token_ids input (chat carries images in its messages' parts)")
    return list(req.images)


def check_images(ids: list[int], images: list[bytes], image_token_id: int | None, sampling: object) -> None:
    """ValueError naming the field unless ``images`` fit the prompt: the model takes images, one placeholder per
    image, and no option that reads prompt positions (they change once the placeholders are expanded)."""
    if not images:
        return
    if image_token_id is None:
        raise ValueError("images: this model takes no image input")
    if any(not b for b in images):
        raise ValueError("images: an image is empty")
    count = ids.count(image_token_id)
    if count != len(images):
        raise ValueError(f"images: {len(images)} image(s) but the prompt has {count} image placeholder token(s)")
    if sampling.HasField("prompt_logprobs"):
        raise ValueError("prompt_logprobs: not supported with images")


def build_prompt(
    tokenizer: object,
    which: str | None,
    req: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest,
    placeholder: str | None = None,
) -> tuple[list[int], str | None, list[dict] | None]:
    """Prompt ids, prompt text and (chat) the tools it renders (``placeholder``: the model's image placeholder
    token, which an image part of a chat renders as; None: the model takes no images)."""
    if which == "text":
        return encode_ids(tokenizer, req.text), req.text, None
    if which == "token_ids":
        return list(req.token_ids.ids), None, None
    if which == "chat":
        messages, tools = chat_to_messages(req.chat, placeholder)
        text = encode_messages(
            messages,
            thinking_mode=req.chat.thinking_mode or "chat",
            reasoning_effort=req.chat.reasoning_effort or None,
            tools=tools,
        )
        return encode_ids(tokenizer, text), text, tools
    raise ValueError("input: one of text, token_ids or chat is required")
