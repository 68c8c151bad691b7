"""The worker side of ``schema_conformance.py``: four grammar engines over the DeepSeek-V4 tokenizer, each compiling
a JSON schema and generating from it token by token under its own mask, no model involved.

* ``ours``: :class:`deepinfer.grammar.Compiler` with ``backend="xgrammar"`` (limits check, schema pass, xgrammar,
  ``serialize_json``), the matcher rebuilt from the serialized grammar as a worker does;
* ``auto``: the same with ``backend="auto"`` (xgrammar unless the pass or xgrammar refuses, then llguidance on the
  raw schema); the matcher the grammar's backend says, rebuilt from its text as a worker does. ``auto_llg`` is
  its llguidance compile alone (what the grammar service falls back to when xgrammar runs out of time);
* ``xgrammar``: xgrammar's ``GrammarCompiler.compile_json_schema`` on the raw schema, same options (strict mode,
  compact JSON), no pass;
* ``llguidance``: ``LLMatcher.grammar_from_json_schema`` on the raw schema (compact JSON), its ``LLMatcher``.

A walk picks each token at random among those the mask allows: 45 % of the steps among the adversarial ones
(control characters, quotes, backslashes, non-ASCII bytes), 15 % the longest allowed token, and past half the
token budget only closing tokens (quotes, brackets, short literals), ending with EOS as soon as EOS is allowed there
(before that with probability 0.2). It reports how it ended: ``eos`` (the grammar accepted EOS: a finished output),
``length`` (the budget ran out), ``stuck`` (the mask allowed nothing) or ``rejected`` (the matcher refused a token
its own mask allowed). The parent process judges the text; a worker runs in its own process so that a compile past
its time limit can be killed.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import numpy as np

EOS = 1
ENGINES = ("ours", "xgrammar", "llguidance", "auto")
CLOSERS = (b'"', b"}", b"]", b'"}', b'"]', b"}]", b"0", b"1", b"null", b"true", b"false")


def available_engines() -> tuple[str, ...]:
    """The engines this environment can run (without llguidance: ours and xgrammar)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return ENGINES[:2]
    return ENGINES


class Engines:
    """The tokenizer's vocabulary and the three compilers, built once per worker process."""

    def __init__(self) -> None:
        import xgrammar

        from deepinfer.grammar import Compiler, build_tokenizer_info
        from deepinfer.grammar.vocab import tokenizer_path

        self.info = build_tokenizer_info()
        self.vocab_size = self.info.vocab_size
        self.tokens = [bytes(t) for t in self.info.decoded_vocab]
        self.lengths = np.array([len(t) for t in self.tokens])
        self.adversarial = np.array([bool(t) and any(b < 0x20 or b in b'"\\' or b >= 0x80 for b in t)
                                     for t in self.tokens])  # fmt: skip
        self.closers = np.array([t in CLOSERS for t in self.tokens])
        self.ours = Compiler(cache_bytes=0, json_whitespace=0, backend="xgrammar")
        self.auto = Compiler(cache_bytes=0, json_whitespace=0, backend="auto") if len(available_engines()) > 2 else None
        self.xgr = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.llg_tokenizer = None
        if "llguidance" in available_engines():
            import llguidance

            text = tokenizer_path().read_text(encoding="utf-8")
            self.llg_tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=EOS)

    # --- compiling: returns (state, message); state None when refused -------------------------------------------

    def compile(self, engine: str, schema: str) -> tuple[Any, str]:
        if engine in ("ours", "auto", "auto_llg"):
            from deepinfer.grammar import GrammarError, GrammarSpec

            compiler, backend = (self.ours, None) if engine == "ours" else (self.auto, engine[5:] and "llguidance")
            try:
                grammar = compiler.compile(GrammarSpec("json_schema", schema), backend or None)
            except GrammarError as e:
                return None, f"{e.outcome}: {e}"
            return (grammar if engine != "ours" else grammar.compiled_json), ""
        if engine == "xgrammar":
            try:
                return self.xgr.compile_json_schema(schema, strict_mode=True, any_whitespace=False,
                                                    separators=(",", ":")), ""  # fmt: skip
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, pydantic's, TypeError
                return None, f"{type(e).__name__}: {str(e)[:400]}"
        import llguidance

        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except Exception as e:  # noqa: BLE001
            return None, f"{type(e).__name__}: {str(e)[:400]}"
        error = llguidance.LLMatcher.validate_grammar(grammar, self.llg_tokenizer)
        return (None, error[:400]) if error else (grammar, "")

    def matcher(self, engine: str, state: Any) -> Matcher:
        if engine in ("auto", "auto_llg"):  # a CompiledGrammar, rebuilt from its text by its backend
            if state.backend == "llguidance":
                from deepinfer.grammar.llg import parser_limits

                return LlgMatcher(self, state.compiled_json, parser_limits())
            return XgrMatcher(self, None, state.compiled_json)
        if engine == "llguidance":
            return LlgMatcher(self, state)
        return XgrMatcher(self, state if engine == "xgrammar" else None, state if engine == "ours" else None)

    # --- generating ---------------------------------------------------------------------------------------------

    def walk(self, matcher: Matcher, seed: int, max_tokens: int) -> tuple[str, str, int]:
        """One output under ``matcher``'s mask: (how it ended, the text, tokens)."""
        rng, out = random.Random(seed), []
        for step in range(max_tokens):
            allowed = matcher.allowed()
            if allowed is None or not len(allowed):
                return "stuck", _text(out), step
            closing = step > max_tokens // 2
            if EOS in allowed and (closing or rng.random() < 0.2 or len(allowed) == 1):
                return ("eos" if matcher.accept(EOS) else "rejected"), _text(out), step
            allowed = allowed[allowed != EOS]
            pool, r = (allowed[self.closers[allowed]] if closing else allowed), rng.random()
            if not closing and r < 0.45:
                pool = allowed[self.adversarial[allowed]]
            elif not closing and r < 0.6:
                pool = allowed[np.argmax(self.lengths[allowed])][None]
            pool = pool if len(pool) else allowed
            token = int(pool[rng.randrange(len(pool))])
            if not matcher.accept(token):
                return "rejected", _text(out), step
            out.append(self.tokens[token])
        return "length", _text(out), max_tokens


def _text(out: list[bytes]) -> str:
    return b"".join(out).decode("utf-8", errors="replace")


def _allowed(words: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class Matcher:
    def allowed(self) -> np.ndarray | None:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError


class XgrMatcher(Matcher):
    """xgrammar's matcher over a compiled grammar, or over our serialized one (rebuilt as a worker does)."""

    def __init__(self, engines: Engines, compiled: Any, serialized: str | None) -> None:
        import xgrammar

        if serialized is not None:
            compiled = xgrammar.CompiledGrammar.deserialize_json(serialized, engines.info)
        self.m, self.size = xgrammar.GrammarMatcher(compiled), engines.vocab_size
        self.mask = xgrammar.allocate_token_bitmask(1, self.size)

    def allowed(self) -> np.ndarray:
        self.m.fill_next_token_bitmask(self.mask)
        return _allowed(self.mask[0].numpy(), self.size)

    def accept(self, token: int) -> bool:
        ok = self.m.accept_token(token)
        return ok and (token != EOS or self.m.is_terminated())


class LlgMatcher(Matcher):
    def __init__(self, engines: Engines, grammar: str, limits: Any = None) -> None:
        import llguidance
        import llguidance.numpy as lnp

        self.m = llguidance.LLMatcher(engines.llg_tokenizer, grammar, log_level=0, limits=limits)
        self.size, self.fill = engines.vocab_size, lnp.fill_next_token_bitmask
        self.mask = lnp.allocate_token_bitmask(1, self.size)

    def allowed(self) -> np.ndarray | None:
        self.fill(self.m, self.mask)
        return None if self.m.is_error() else _allowed(self.mask[0], self.size)

    def accept(self, token: int) -> bool:
        ok = self.m.consume_token(token)
        return ok and not self.m.is_error() and (token != EOS or self.m.is_stopped())


def serve(conn: Any) -> None:
    """The worker loop: ``(engine, schema, seeds, max_tokens)`` in; ``("compiled", ms, first_mask_ms, message)``
    then ``("walks", [(ended, text, tokens), ...])`` out (no walks when the compile refused). ``None`` ends it."""
    engines = Engines()
    conn.send(("ready",))
    while (task := conn.recv()) is not None:
        engine, schema, seeds, max_tokens = task
        t0 = time.perf_counter()
        state, message = engines.compile(engine, schema)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        first_ms = None
        if state is not None:
            t0 = time.perf_counter()
            engines.matcher(engine, state).allowed()
            first_ms = 1e3 * (time.perf_counter() - t0)
        conn.send(("compiled", compile_ms, first_ms, message if state is None else ""))
        walks = [] if state is None else [engines.walk(engines.matcher(engine, state), s, max_tokens) for s in seeds]
        conn.send(("walks", walks))


def compact(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
