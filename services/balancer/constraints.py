"""The balancer's side of structured outputs: a request's ``so_args`` and tool choice, compiled by the grammar
service into the constraint that travels with the request to the worker.

Errors: an invalid or abusive grammar, or a tool choice that does not fit the tools → ValueError (the
caller's INVALID_ARGUMENT / HTTP 400), with the grammar service's reason. The grammar service down or too
slow → :class:`Unavailable` (UNAVAILABLE / HTTP 503) for requests that need a grammar — except plain
``tool_choice: auto``, which then runs unconstrained (the model's own DSML, parsed tolerantly) and logs it.
Requests without a constraint never touch the grammar service.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deepinfer.chat.tokens import DSML, THINK_START
from deepinfer.engine.structured import build_constraint, grammar_source, token_ids
from deepinfer.rpc.convert import constraint_to_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.errors import Unavailable
from deepinfer.telemetry import get_logger
from deepinfer.v1 import common_pb2, generation_pb2

log = get_logger(__name__)
# a deployment without a grammar service (no DEEPINFER_GRAMMAR_URL: ``deepinfer up --no-grammar``) serves no structured
# output: a request for one is invalid there (400 / INVALID_ARGUMENT), not worth retrying as a grammar service down is
NOT_SERVED = (
    "{where}: structured output is not served here (this balancer has no grammar service: DEEPINFER_GRAMMAR_URL)"
)


def tool_choice_of(chat: generation_pb2.ChatInput) -> Any:
    """The OpenAI-style tool_choice of a wire chat: None, "auto", "none", "required" or a named function."""
    if chat.tool_choice == "function":
        if not chat.tool_choice_function:
            raise ValueError("chat.tool_choice_function: required with tool_choice 'function'")
        if chat.tool_choice_function not in [t.name for t in chat.tools]:
            raise ValueError(f"chat.tool_choice_function: {chat.tool_choice_function!r} is not among chat.tools")
        return {"type": "function", "function": {"name": chat.tool_choice_function}}
    if chat.tool_choice not in ("", "auto", "none", "required"):
        raise ValueError(f"chat.tool_choice: expected auto, none, required or function, got {chat.tool_choice!r}")
    if chat.tool_choice:
        return chat.tool_choice
    return "auto" if chat.tools else None


class ConstraintCompiler:
    """Builds requests' constraints with the grammar service at ``address`` (None: no grammar service)."""

    def __init__(self, tokenizer: Any, address: str | None, tokenizer_fingerprint: str, timeout_s: float) -> None:
        self.fingerprint, self.timeout_s = tokenizer_fingerprint, timeout_s
        self.think_start = tokenizer.token_to_id(THINK_START)
        self.dsml = [t for t in (tokenizer.token_to_id(DSML),) if t is not None]
        self.tokenizer = tokenizer
        self.client = None
        if address:
            from deepinfer.grammar import GrammarClient

            self.client = GrammarClient(address)

    @property
    def kinds(self) -> list[str]:
        """The structured-output kinds this balancer serves (none without a grammar service)."""
        if self.client is None:
            return []
        from deepinfer.grammar import KINDS

        return list(KINDS)

    async def build(
        self,
        request: generation_pb2.GenerateRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        tools: list[dict] | None,
    ) -> common_pb2.Constraint | None:
        """The wire constraint of one request, or None when it has none."""
        spec, where, optional, banned, reasoning_banned = None, "so_args", False, [], []
        if params.so_args is not None:
            spec = grammar_source(params.so_args)
        chat = request.chat if request.WhichOneof("input") == "chat" else None
        choice = tool_choice_of(chat) if chat is not None else None
        if choice == "none":
            banned = list(self.dsml)  # no tool call, whatever the model would like to do
        elif choice is not None and tools:
            from deepinfer.chat.tool_choice import tool_constraint

            parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
            tc = tool_constraint(tools, choice, chat.thinking_mode or "chat", parallel_tool_calls=parallel)
            if tc is not None:
                banned = token_ids(self.tokenizer, tc.banned_texts)
                reasoning_banned = token_ids(self.tokenizer, tc.reasoning_banned_texts)
                if tc.text:
                    if spec is not None:
                        raise ValueError("tool_choice: a response format and tool calls cannot both be enforced")
                    spec, where, optional = (tc.kind, tc.text), "tool_choice", choice == "auto"
        grammar = None
        if spec is not None:
            grammar = await self._compile(spec, where, optional)
            if grammar is None and not banned:
                return None
        c = build_constraint(grammar, banned, prompt_ids, self.think_start, reasoning_banned)
        return None if c is None else constraint_to_proto(c)

    async def _compile(self, spec: tuple[str, str], where: str, optional: bool) -> Any:
        from deepinfer.grammar import GrammarError, GrammarSpec, GrammarUnavailable, check_limits

        # the cheap checks here: an abusive grammar never leaves the balancer (large texts off the loop); the schema
        # pass is the grammar service's, whose backend (DEEPINFER_GRAMMAR_BACKEND) decides what a refusal of it means
        try:
            if len(spec[1]) > 65536:
                await asyncio.to_thread(check_limits, GrammarSpec(*spec), None, "skip")
            else:
                check_limits(GrammarSpec(*spec), schema_pass="skip")
        except GrammarError as e:
            raise ValueError(f"{where}: {e}") from None
        if self.client is None:
            if optional:
                return None
            raise ValueError(NOT_SERVED.format(where=where))
        try:
            return await self.client.compile(GrammarSpec(*spec), self.fingerprint, self.timeout_s)
        except GrammarError as e:
            raise ValueError(f"{where}: {e}") from None
        except GrammarUnavailable as e:
            if optional:
                log.warning("tool_grammar_unavailable", error=str(e))
                return None
            raise Unavailable(f"{where}: the grammar service is unavailable ({e})") from None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
