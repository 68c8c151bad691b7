"""The compile pool's failure modes that need no running service: compile processes that cannot start."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer.grammar import GrammarError, GrammarSpec, GrammarUnavailable
from services.grammar.pool import CompilerPool


def test_a_pool_whose_processes_cannot_start_is_unavailable() -> None:
    async def scenario() -> None:
        pool = CompilerPool(workers=1, memory_bytes=64 * 1024**2)  # far below what loading xgrammar needs
        try:
            t0 = time.perf_counter()
            with pytest.raises(GrammarUnavailable, match="did not start .*memory cap is 67108864 bytes"):
                await pool.start()
            assert time.perf_counter() - t0 < 30
            with pytest.raises(GrammarError, match="repetition count"):  # refusals need no process
                await pool.compile(GrammarSpec("regex", "a{1000000}"))
        finally:
            await pool.close()
        with pytest.raises(GrammarUnavailable, match="closed"):
            await pool.compile(GrammarSpec("regex", "a"))

    asyncio.run(scenario())


def test_the_pools_processes_compile_with_the_json_indent() -> None:
    """DEEPINFER_GRAMMAR_JSON_INDENT reaches the compile processes (their config), and the cache key says so."""
    import json

    import xgrammar

    from deepinfer.grammar import build_tokenizer_info

    async def scenario() -> str:
        pool = CompilerPool(workers=1, json_indent=2)
        try:
            assert "json_indent=2" in pool.options
            grammar, _ = await pool.compile(
                GrammarSpec("json_schema", '{"type":"object","properties":{"a":{"enum":[1]}}}')
            )
            return grammar.compiled_json
        finally:
            await pool.close()

    compiled = xgrammar.CompiledGrammar.deserialize_json(asyncio.run(scenario()), build_tokenizer_info())
    assert xgrammar.GrammarMatcher(compiled).accept_string(json.dumps({"a": 1}, indent=2))
    assert not xgrammar.GrammarMatcher(compiled).accept_string(json.dumps({"a": 1}))
