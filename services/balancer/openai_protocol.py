"""OpenAI-compatible request models, their mapping to ``deepinfer.v1`` requests, and the chat output parser.

Requests are pydantic models that ignore unknown fields (as vLLM does). Fields the engine cannot honour
(penalties, ``echo``, ``logit_bias``, ``n`` over ``MAX_N``, ``best_of`` other than ``n``) are refused with a
ValueError naming the field rather than silently ignored. Structured output comes from ``response_format``
(json_object, json_schema) or, in the extra body, vLLM's ``structured_outputs`` / ``guided_*`` fields or
DeepInfer's ``so_args``; ``tool_choice`` (auto, none, required, a named function) travels to the balancer, which
compiles the tool-call grammar. Chat output is split into reasoning, content and tool calls by
``ReasoningSplitter``, a subset of the state machine of the completion parser (docs/chat_format.md, "Streaming
parser") that works on streamed text deltas; output cut by ``max_tokens`` goes through the streaming parser,
which drops a tool call cut short.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer import envs
from deepinfer.chat import encode_messages, merge_deltas, parse_completion
from deepinfer.chat.dsml import parse_tool_calls
from deepinfer.chat.streaming import StreamingParser
from deepinfer.chat.tokens import EOS, THINK_END, THINK_START, TOOL_CALLS_START
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extra fields included)."""

    model_config = ConfigDict(extra="ignore")

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
    user: str | None = None
    cache_salt: str | None = None  # vLLM's prefix-cache isolation between tenants
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
    response_format: dict[str, Any] | None = None

    def thinking(self) -> tuple[bool, str]:
        """(thinking on, reasoning effort for the encoder): chat mode unless asked for."""
        kwargs = self.chat_template_kwargs or {}
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
        choice, function = tool_choice_of(self.tool_choice, bool(self.tools))
        if self.tools and choice != "none":  # "none": tools are not rendered (docs/chat_format.md, "Tools section")
            chat.tools.extend(_tool(t, i) for i, t in enumerate(self.tools))
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


def _message(m: dict[str, Any], i: int, image_placeholder: str | None = None) -> generation_pb2.ChatMessage:
    where = f"messages[{i}]"
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
    fn = t.get("function") if isinstance(t, dict) else None
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


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental split of streamed completion text into reasoning, content and tool calls.

    The initial state comes from the rendered prompt: reasoning when it ends with ``<think>``. In reasoning,
    ``</think>`` switches to content; in content, ``\\n\\n<｜DSML｜tool_calls`` starts a tool-call block that is
    held back and parsed at the end (on a parse failure it is returned as content). Text that could be the
    start of a marker is held back until the next delta decides it.
    """

    def __init__(self, reasoning: bool) -> None:
        self.state = "reasoning" if reasoning else "content"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; returns the (reasoning, content) text that is now certain."""
        self.buf += text
        out = {"reasoning": "", "content": ""}
        while self.state != "tool":
            marker, nxt = (THINK_END, "content") if self.state == "reasoning" else (TOOL_CALLS_START, "tool")
            at = self.buf.find(marker)
            if at == -1:
                keep = _held(self.buf, marker)
                out[self.state] += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            out[self.state] += self.buf[:at]
            self.buf, self.state = self.buf[at + len(marker) :], nxt
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str, list[dict[str, str]]]:
        """End of the stream: the held-back (reasoning, content) and the parsed tool calls."""
        buf, self.buf = self.buf.removesuffix(EOS), ""
        if self.state == "reasoning":
            return buf, "", []
        if self.state == "content":
            return "", buf, []
        try:
            calls, pos = parse_tool_calls(buf, 0)
            if buf[pos:]:
                raise ValueError("text after the tool-call block")
        except ValueError:
            return "", TOOL_CALLS_START + buf, []
        return "", "", calls


def parse_chat_output(text: str, reasoning: bool, finish_reason: str) -> tuple[str, str, list[dict[str, str]]]:
    """(reasoning_content, content, tool calls) of a whole completion.

    Output cut by ``max_tokens`` (``length``) goes through the streaming parser in its ``whole_calls`` mode, as a
    stream does: a tool call cut short is dropped, and so is a cut-off start of DSML markup; the content is the
    text before the markup began, the calls are the ones that closed. Otherwise the project's strict parser first;
    when the output is malformed, the tolerant splitter. Reasoning that never closed stays reasoning on ``length``
    and becomes content on ``stop`` (docs/chat_format.md, "Parsing completions").
    """
    if finish_reason == "length":
        parser = StreamingParser("thinking" if reasoning else "chat", whole_calls=True)
        message = merge_deltas(parser.feed(text) + parser.finish())
        calls = [c["function"] for c in message["tool_calls"]]
        return message["reasoning_content"], message["content"], calls
    try:
        parsed = parse_completion(text if text.endswith(EOS) else text + EOS, "thinking" if reasoning else "chat")
        calls = [c["function"] for c in parsed["tool_calls"]]
        return parsed["reasoning_content"], parsed["content"], calls
    except ValueError:
        pass
    splitter = ReasoningSplitter(reasoning)
    r, c = splitter.feed(text)
    r2, c2, calls = splitter.finish()
    if splitter.state == "reasoning" and finish_reason == "stop":
        return "", r + r2, []
    return r + r2, c + c2, calls
