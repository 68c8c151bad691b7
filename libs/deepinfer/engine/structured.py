"""From a request's ``so_args`` (and, for chat, its tools and ``tool_choice``) to the :class:`Constraint` a
worker enforces. The offline API compiles in this process (:class:`LocalConstraints`); the balancer asks
the grammar service and builds the same constraint from its answer (:func:`build_constraint`).

Thinking mode: a prompt that ends with ``<think>`` (the chat encoding's thinking mode) makes the grammar
apply from the first ``</think>`` on, so the reasoning stays free and the answer is constrained.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.chat.tokens import THINK_START
from deepinfer.engine.constraint import Constraint


def grammar_source(so_args: dict) -> tuple[str, str]:
    """``(kind, text)`` of a validated ``so_args``: "json" means "json_schema"; a schema object becomes its
    compact JSON text (a string is kept as given, so equal requests share a compile-cache entry)."""
    kind = "json_schema" if so_args["schema_type"] == "json" else so_args["schema_type"]
    schema = so_args.get("schema")
    if schema is None:
        return kind, ""
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return kind, text


def thinking_prompt(prompt_token_ids: Sequence[int], think_start_id: int | None) -> bool:
    return think_start_id is not None and bool(prompt_token_ids) and prompt_token_ids[-1] == think_start_id


def build_constraint(
    grammar: Any,
    banned_token_ids: Sequence[int],
    prompt_token_ids: Sequence[int],
    think_start_id: int | None,
    reasoning_banned_token_ids: Sequence[int] = (),
) -> Constraint | None:
    """The worker's constraint: a compiled grammar (or None) and banned tokens; None when there is neither.
    ``reasoning_banned_token_ids`` apply before ``</think>`` in a thinking prompt (and only with a grammar)."""
    if grammar is None and not banned_token_ids:
        return None
    after = grammar is not None and thinking_prompt(prompt_token_ids, think_start_id)
    reasoning = tuple(sorted(set(reasoning_banned_token_ids))) if after else ()
    return Constraint(grammar, tuple(sorted(set(banned_token_ids))), after, reasoning)


def token_ids(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """The ids of control-token texts (each one token of the vocabulary; unknown ones are skipped)."""
    return [t for t in (tokenizer.token_to_id(x) for x in texts) if t is not None]


class LocalConstraints:
    """Compiles constraints in this process (the offline ``LLM``), against the model's tokenizer.

    Each compile is time-bounded like the grammar service's (``DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S``, read per
    compile): past it the request is refused with a ``GrammarTimeout`` (a ValueError) naming the setting. xgrammar
    cannot cancel a compile, so the abandoned one runs to its end in a background thread (the grammar service
    kills its compile process instead). The tokenizer views are built before the first compile, outside the bound.
    """

    def __init__(self, model_dir: str | Path, tokenizer: Any) -> None:
        self.model_dir, self.tokenizer = model_dir, tokenizer
        self.think_start = tokenizer.token_to_id(THINK_START)
        self._compiler = None

    def _compile(self, kind: str, text: str) -> Any:
        from deepinfer.grammar import Compiler, GrammarSpec

        if self._compiler is None:
            compiler = Compiler(self.model_dir)
            compiler.warm()  # the tokenizer views (seconds, once): not part of a compile's time
            self._compiler = compiler
        return _bounded(self._compiler, GrammarSpec(kind, text), envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S)

    def for_request(
        self,
        so_args: dict | None,
        prompt_token_ids: Sequence[int],
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        thinking_mode: str = "chat",
        parallel_tool_calls: bool = True,
    ) -> Constraint | None:
        """The constraint of one request; an invalid grammar raises ValueError (``deepinfer.grammar.GrammarError``)."""
        grammar, banned, reasoning_banned = None, [], []
        if so_args is not None:
            grammar = self._compile(*grammar_source(so_args))
        if tools or tool_choice is not None:
            from deepinfer.chat.tool_choice import tool_constraint

            tc = tool_constraint(tools, tool_choice, thinking_mode, parallel_tool_calls=parallel_tool_calls)
            if tc is not None:
                if grammar is not None and tc.text:
                    raise ValueError("tool_choice: a response format and tool calls cannot both be enforced")
                if tc.text:
                    grammar = self._compile(tc.kind, tc.text)
                banned = token_ids(self.tokenizer, tc.banned_texts)
                reasoning_banned = token_ids(self.tokenizer, tc.reasoning_banned_texts)
        return build_constraint(grammar, banned, prompt_token_ids, self.think_start, reasoning_banned)


def _bounded(compiler: Any, spec: Any, limit_s: float) -> Any:
    """``compiler.compile(spec)`` within ``limit_s`` seconds, else ``GrammarTimeout`` naming the setting (the
    compile goes on in its daemon thread: xgrammar cannot stop one)."""
    from deepinfer.grammar import GrammarTimeout

    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(compiler.compile(spec))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, name="grammar-compile", daemon=True).start()
    try:
        return done.result(timeout=limit_s)
    except TimeoutError:
        raise GrammarTimeout(
            f"{spec.kind}: compile timed out after {limit_s:g} s (the limit: DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S)"
        ) from None
