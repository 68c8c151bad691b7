"""OpenAI-compatible request models and their mapping to ``deepinfer.v1`` requests (the chat output's parsing:
``chat_output``).

Requests are strict pydantic models: a field neither endpoint knows is refused naming it (as OpenAI's API does;
vLLM ignores it with a warning), and so is a value of the wrong type (``"temperature": true``). Fields the engine
cannot honour (penalties, ``echo``, ``logit_bias``, ``n`` over ``MAX_N``, ``best_of`` other than ``n``, ``store``,
another ``service_tier``, OpenAI's audio, predicted outputs, web search, legacy functions) are refused with a
ValueError naming the field rather than silently ignored; fields that change nothing generated (``user``,
``metadata``, ``safety_identifier``, ``prompt_cache_key``) are taken as they are. Structured output comes from
``response_format`` (json_object, json_schema; on both endpoints) or, in the extra body, vLLM's
``structured_outputs`` / ``guided_*`` fields or DeepInfer's ``so_args``; ``tool_choice`` (auto, none, required, a
named function) travels to the balancer, which compiles the tool-call grammar.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer import envs
from deepinfer.chat import encode_messages
from deepinfer.chat.tokens import THINK_START
from deepinfer.image_inputs import image_bytes
from deepinfer.rpc.convert import structured_output_to_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.v1 import common_pb2, generation_pb2
from services.balancer.openai_structured import check_strict, so_args_of, strict_of, tool_choice_of
from services.balancer.prompt import chat_to_messages

# reasoning_effort -> (thinking, the encoder's effort); DeepSeek's API maps low/medium up and xhigh to max.
REASONING_EFFORTS = {"none": (False, ""), "low": (True, "high"), "medium": (True, "high"), "high": (True, "high"),
                     "xhigh": (True, "max"), "max": (True, "max")}  # fmt: skip
MAX_N = 16  # the most samples (``n``) one request may ask for: each is a request of its own on a replica


_STRICT = ConfigDict(extra="forbid", strict=True)
SERVICE_TIERS = (None, "auto", "default")  # OpenAI's tiers that ask for nothing else than serving the request


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extra fields included)."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's identifiers and tags: nothing generated depends on them
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # (refused when true: this server keeps no completions)
    service_tier: str | None = None
    cache_salt: str | None = None  # vLLM's prefix-cache isolation between tenants
    response_format: dict[str, Any] | None = None  # (on /v1/completions too, as vLLM takes it)
    # structured output beyond response_format (extra body): vLLM's structured_outputs {json | regex | grammar |
    # choice | json_object}, its older guided_* fields, and DeepInfer's so_args {schema_type, schema}
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    so_args: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: an integer in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name}: not supported (must be 0)")
        if self.repetition_penalty not in (None, 1):
            raise ValueError("repetition_penalty: not supported (must be 1)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:  # (as OpenAI's API: it would do nothing)
            raise ValueError("stream_options: only with stream=true")
        if self.store:
            raise ValueError("store: not supported (this server keeps no completions; must be false)")
        if self.service_tier not in SERVICE_TIERS:
            raise ValueError(f"service_tier: only 'auto' or 'default' are served, got {self.service_tier!r}")

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        self._refuse_unsupported()
        p = common_pb2.SamplingParams()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or 0, "min_p": self.min_p,
            "max_tokens": max_tokens, "min_tokens": self.min_tokens, "seed": self.seed, "logprobs": logprobs,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }  # fmt: skip
        for name, value in values.items():
            if value is not None:
                try:
                    setattr(p, name, value)
                except (ValueError, TypeError) as e:  # out of the wire type's range
                    raise ValueError(f"{name}: {value!r} is out of range ({e})") from None
        try:
            p.stop.extend(stop or [])
            p.stop_token_ids.extend(self.stop_token_ids or [])
        except ValueError as e:
            raise ValueError(f"stop_token_ids: out of range ({e})") from None
        so = so_args_of(self)
        if so is not None:
            SamplingParams(so_args=so)  # validates, naming the field
            p.structured_output.CopyFrom(structured_output_to_proto(so))
        return p


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # absent: the balancer's default (16, at most what the context leaves)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_proto(self, request_id: str) -> generation_pb2.GenerateRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of: only best_of == n ({self.n}) is supported, got {self.best_of}")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"prompt: one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        sampling = self._sampling(self.max_tokens, self.logprobs)
        req = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling, cache_salt=self.cache_salt)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            try:
                req.token_ids.ids.extend(prompt)
            except ValueError as e:
                raise ValueError(f"prompt: token id out of range ({e})") from None
        return req


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # OpenAI features this server does not have (refused when set): audio output, predicted outputs, web search,
    # the legacy function calling (``tools`` replaces it), output verbosity
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    verbosity: str | None = None

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        for name in ("audio", "prediction", "web_search_options", "functions", "function_call", "verbosity"):
            if getattr(self, name) is not None:
                hint = " (use tools and tool_choice)" if name.startswith("function") else ""
                raise ValueError(f"{name}: not supported{hint}")
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"modalities: only ['text'] is supported, got {self.modalities}")

    def thinking(self) -> tuple[bool, str]:
        """(thinking on, reasoning effort for the encoder): chat mode unless asked for."""
        kwargs = self.chat_template_kwargs or {}
        for key in kwargs:
            if key not in ("thinking", "enable_thinking"):
                raise ValueError(f"chat_template_kwargs.{key}: not supported (thinking and enable_thinking are)")
        flag = kwargs.get("thinking", kwargs.get("enable_thinking"))
        if flag is not None and not isinstance(flag, bool):
            raise ValueError("chat_template_kwargs.thinking: expected a boolean")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort: expected one of {list(REASONING_EFFORTS)}")
        on, effort = REASONING_EFFORTS[self.reasoning_effort or "none"]
        on = on if flag is None else flag
        return on, effort if on else ""

    def to_proto(
        self, request_id: str, max_model_len: int | None = None, image_placeholder: str | None = None
    ) -> tuple[generation_pb2.GenerateRequest, bool]:
        """The wire request and whether the rendered prompt opens reasoning (ends with ``<think>``).

        Without ``max_tokens`` / ``max_completion_tokens`` the wire field stays unset: the balancer then gives the
        chat what the context leaves after the prompt, at most ``DEEPINFER_DEFAULT_MAX_TOKENS`` (``max_model_len``
        is no longer needed here and only kept for callers that pass it). ``image_placeholder``: the model's image
        placeholder token (None: the model takes no images, and an ``image_url`` part is refused naming it)."""
        if self.top_logprobs is not None and not (self.logprobs and 0 <= self.top_logprobs <= 20):
            raise ValueError("top_logprobs: an int in [0, 20], with logprobs=true")
        thinking, effort = self.thinking()
        chat = generation_pb2.ChatInput(thinking_mode="thinking" if thinking else "chat", reasoning_effort=effort)
        chat.messages.extend(_message(m, i, image_placeholder) for i, m in enumerate(self.messages))
        tools = [_tool(t, i) for i, t in enumerate(self.tools or [])]  # (checked whether rendered or not)
        choice, function = tool_choice_of(self.tool_choice, [t.name for t in tools])
        if tools and choice != "none":  # "none": tools are not rendered (docs/chat_format.md, "Tools section")
            chat.tools.extend(tools)
        chat.tool_choice, chat.tool_choice_function = choice, function
        if self.parallel_tool_calls is not None:
            chat.parallel_tool_calls = self.parallel_tool_calls
        messages, tools = chat_to_messages(chat, image_placeholder)
        prompt = encode_messages(messages, chat.thinking_mode, reasoning_effort=effort or None, tools=tools)
        max_tokens = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), None)
        sampling = self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        req = generation_pb2.GenerateRequest(
            request_id=request_id, chat=chat, sampling=sampling, cache_salt=self.cache_salt
        )
        return req, prompt.endswith(THINK_START)


def _text(value: Any, where: str, tool: bool) -> str:
    """Message content as text: text parts joined by a blank line (tool results keep other parts as a marker)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a string, null or a list of content parts")
    texts = []
    for k, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{k}]: expected an object")
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif tool:
            texts.append(f"[Unsupported {part.get('type')}]")
        else:
            raise ValueError(f"{where}[{k}]: only text and image_url parts are supported")
    return "\n\n".join(texts)


def _image_parts(content: list, where: str, placeholder: str | None) -> list[generation_pb2.ContentPart]:
    """Content with ``image_url`` parts as wire parts: text, and each image's bytes (a ``data:`` URL, or a local
    file under ``DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH``; never fetched over the network)."""
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{k}]: expected an object")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(generation_pb2.ContentPart(text=part["text"]))
            continue
        if kind != "image_url":
            raise ValueError(f"{where}[{k}]: only text and image_url parts are supported")
        if placeholder is None:
            raise ValueError(f"{where}[{k}].image_url: this model takes no image input")
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError(f"{where}[{k}].image_url: expected {{'url': str}}")
        local, setting = envs.DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH, "DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH on the balancer"
        data = image_bytes(url, f"{where}[{k}].image_url", local, setting)
        parts.append(generation_pb2.ContentPart(image=data))
    return parts


# message fields that would change the prompt and that the chat encoding has no form for: DeepSeek's chat prefix
# completion (``prefix`` on the last assistant message), a legacy function call, an audio reference
_MESSAGE_FEATURES = ("prefix", "function_call", "audio")


def _message(m: dict[str, Any], i: int, image_placeholder: str | None = None) -> generation_pb2.ChatMessage:
    where = f"messages[{i}]"
    for key in _MESSAGE_FEATURES:  # (other keys a client echoes back, e.g. refusal or annotations, change nothing)
        if m.get(key):
            raise ValueError(f"{where}.{key}: not supported")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role: required")
    content = m.get("content")
    images = isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)
    if images and role != "tool":  # a tool result keeps other parts as a text marker
        out = generation_pb2.ChatMessage(role=role)
        out.parts.extend(_image_parts(content, f"{where}.content", image_placeholder))
    else:
        out = generation_pb2.ChatMessage(role=role, content=_text(content, f"{where}.content", role == "tool"))
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    for name, value in (
        ("reasoning_content", reasoning),
        ("tool_call_id", m.get("tool_call_id")),
        ("name", m.get("name")),
    ):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{name}: expected a string")
        setattr(out, name, value or "")
    for k, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{k}].function: expected {{'name': str, 'arguments': str}}")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.tool_calls.add(id=str(call.get("id") or ""), name=fn["name"], arguments=args)
    return out


def _tool(t: dict[str, Any], i: int) -> generation_pb2.Tool:
    if t.get("type", "function") != "function":
        raise ValueError(f"tools[{i}].type: only 'function' tools are supported, got {t.get('type')!r}")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tools[{i}].function: expected {{'name': str, 'description': str, 'parameters': {{...}}}}")
    params = fn.get("parameters")
    if strict_of(fn, f"tools[{i}].function"):
        check_strict(params, f"tools[{i}].function.parameters")
    return generation_pb2.Tool(
        name=fn["name"],
        description=str(fn.get("description") or ""),
        parameters=json.dumps(params, ensure_ascii=False) if params is not None else "",
    )
