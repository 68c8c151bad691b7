"""Rebalancing running requests between decode replicas by moving their state (docs/routing.md, "Rebalancing").

Routing places a request once; a replica's share can still drift (long outputs pile up on one, short ones finish on
another). Every ``DEEPINFER_REBALANCE_INTERVAL_S`` the balancer compares the requests it has in flight on each
replica that decodes (the decode replicas under disaggregation, else the mixed ones). When the busiest has at least
``DEEPINFER_REBALANCE_MIN_GAP`` more than the idlest, it moves half the gap: it asks the busiest replica to hand off
that many of its requests (``Scheduler.HandOff``), those with the most tokens still to generate among the ones that
have streamed a token (their state is on the device). The replica exports each one's state to the kvstore after the
token it has in flight and ends its stream with ``handoff``; the relay then continues it on the idlest replica,
which fetches that state instead of recomputing it (``core.Balancer._relay``). A request moves at most once per
interval. A replica without a kvstore refuses (FAILED_PRECONDITION) and is left alone.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import grpc

from deepinfer import envs
from deepinfer.telemetry import get_logger
from deepinfer.v1 import scheduler_pb2
from services.balancer.replicas import Replica

log = get_logger(__name__)


class Rebalancer:
    """The balancer's loop moving requests from its busiest decoding replica to its idlest (module docstring).
    ``live()``: the balancer's requests in flight, ``(replica, the replica's request id, tokens still to generate,
    tokens streamed)`` by request id; ``targets``: where a request asked to hand off goes next (the relay takes it
    with ``arrived``); ``on_moved``: called for each request that did move."""

    def __init__(self, replicas: Callable[[], list[Replica]], live: Callable[[], dict[str, tuple]],
                 on_moved: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.replicas, self.live, self.on_moved = replicas, live, on_moved
        self.targets: dict[str, Replica] = {}
        self.moved = 0  # requests asked to hand off so far (a request may finish before it does)
        self.refused: set[str] = set()  # replicas that cannot hand off (no kvstore)
        self._task: asyncio.Task | None = None

    def start(self, interval_s: float | None = None) -> None:
        interval = envs.DEEPINFER_REBALANCE_INTERVAL_S if interval_s is None else interval_s
        if interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval))

    async def _run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.once()
            except Exception as e:  # noqa: BLE001 (a replica's failure is the relay's to handle; keep balancing)
                log.warning("rebalance_failed", error=f"{type(e).__name__}: {e}")

    def _decoding(self) -> list[Replica]:
        ready = [r for r in self.replicas() if r.healthy and r.address not in self.refused]
        decode = [r for r in ready if r.role == "decode"]
        return decode or [r for r in ready if r.role in ("mixed", None)]

    async def once(self, min_gap: int | None = None) -> int:
        """One round: the requests asked to move (0: balanced enough, or nothing to move)."""
        gap_min = envs.DEEPINFER_REBALANCE_MIN_GAP if min_gap is None else min_gap
        ready = self._decoding()
        if len(ready) < 2:
            return 0
        live = self.live()
        for rid in [r for r in self.targets if r not in live]:  # ended before handing off (a finish, a cancel)
            del self.targets[rid]
        # moves asked for and not done yet count where they are going (else the next round would see the same gap)
        leaving = Counter(live[rid][0].address for rid in self.targets if rid in live)
        coming = Counter(t.address for rid, t in self.targets.items() if rid in live)

        def load(r: Replica) -> int:
            return r.in_flight - leaving[r.address] + coming[r.address]

        busy, idle = max(ready, key=load), min(ready, key=load)
        gap = load(busy) - load(idle)
        if gap < max(gap_min, 2):
            return 0
        movable = [(left, rid, sid) for rid, (rep, sid, left, sent) in live.items()
                   if rep is busy and sent and rid not in self.targets]  # fmt: skip
        chosen = sorted(movable, reverse=True)[: gap // 2]
        if not chosen:
            return 0
        for _, rid, _ in chosen:
            self.targets[rid] = idle
        try:
            res = await busy.stub.HandOff(scheduler_pb2.HandOffRequest(request_ids=[s for _, _, s in chosen]),
                                          timeout=10.0)  # fmt: skip
        except grpc.aio.AioRpcError as e:
            for _, rid, _ in chosen:
                self.targets.pop(rid, None)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.refused.add(busy.address)
            log.warning("rebalance_refused", replica=busy.address, error=f"{e.code().name}: {e.details()}")
            return 0
        taken = set(res.request_ids)
        for _, rid, sid in chosen:
            if sid not in taken:
                self.targets.pop(rid, None)
        self.moved += len(taken)
        log.info("rebalancing", source=busy.address, target=idle.address, requests=len(taken), gap=gap)
        return len(taken)

    def arrived(self, rid: str) -> Replica | None:
        """Where a request that just handed off goes, when rebalancing moved it (counted: ``on_moved``); None:
        it handed off for another reason, or rebalancing did not move it."""
        target = self.targets.pop(rid, None)
        if target is not None and self.on_moved is not None:
            self.on_moved(1)
        return target

    def forget(self, rid: str) -> None:
        """A request whose stream ended otherwise (finished, failed, cancelled) is not moving any more."""
        self.targets.pop(rid, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


__all__ = ["Rebalancer"]
