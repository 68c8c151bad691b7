"""The open loop: sessions start on their own schedule (``workload.arrival_gaps``), whatever the server does; with
``max_concurrency`` a request waits for one of that many slots before it is sent (its clock starts when it is sent,
as ``vllm bench serve`` counts). Within a session each turn goes after the previous answer, carrying the
conversation so far."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Protocol

from deepinfer.loadgen.outcome import Outcome
from deepinfer.loadgen.workload import Session, Turn, arrival_gaps


class Client(Protocol):
    async def send(self, out: Outcome, turn: Turn, history: list[dict[str, str]], params: dict[str, Any]) -> None: ...


async def run(
    client: Client,
    sessions: list[Session],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    session_ids: bool = False,
) -> tuple[list[Outcome], float]:
    """Every turn's outcome, in session order, and the run's wall time in seconds. ``session_ids``: each request
    names its session (OpenAI ``user``, gRPC ``session_id``: ``loadgen-<index>``), for session-affine routing."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    gaps = arrival_gaps(len(sessions), request_rate, burstiness, random.Random(seed + 1))
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[list[Outcome]] = [[] for _ in sessions]

    async def session(s: Session) -> None:
        history: list[dict[str, str]] = [{"role": "system", "content": s.system}] if s.system else []
        own = {**(params or {}), **({"user": f"loadgen-{s.index}"} if session_ids else {})}
        for k, turn in enumerate(s.turns):
            out = Outcome(s.index, k)
            if slots is None:
                await client.send(out, turn, history, own)
            else:
                async with slots:
                    await client.send(out, turn, history, own)
            results[s.index].append(out)
            if not out.ok:
                return  # a failed turn ends its session: the next one would carry a broken conversation
            history += [{"role": "user", "content": turn.text}, {"role": "assistant", "content": out.text}]

    t0 = time.perf_counter()
    tasks = []
    for s, gap in zip(sessions, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(session(s)))
    await asyncio.gather(*tasks)
    return [o for r in results for o in r], time.perf_counter() - t0


__all__ = ["Client", "run"]
