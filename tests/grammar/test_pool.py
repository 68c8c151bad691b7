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
