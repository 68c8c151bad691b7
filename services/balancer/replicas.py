"""The balancer's scheduler replicas: which exist (static list ∪ NATS registry), which can serve now, and the
choice of one for a request (by cache, session and load: docs/routing.md).

A replica leaves routing the moment one of its streams fails (UNAVAILABLE) or a health probe finds it not
SERVING, and comes back when a probe finds it SERVING again; probes run every ``DEEPINFER_REPLICA_PROBE_S``.
So a dead replica stops getting requests within about one probe period, long before its registry entry's TTL.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer import envs
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.errors import Unavailable
from deepinfer.telemetry import get_logger
from deepinfer.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.balancer.session_client import SessionClient

log = get_logger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class RouteHint:
    """What cache-aware routing knows of a request: the prompt's length, the tokens of it each replica's prefix cache
    holds (by address: ``cache_index.CacheIndex.cached``), its session; ``reason``: what chose the replica."""

    prompt_len: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    session: str = ""
    reason: str = ""


@dataclass
class Replica:
    address: str
    stub: scheduler_pb2_grpc.SchedulerStub
    channel: grpc.aio.Channel | None = None
    in_flight: int = 0
    healthy: bool = True  # routable: its last probe said SERVING and no stream failed since
    late_probes: int = 0  # health probes in a row that timed out
    health: health_pb2_grpc.HealthStub | None = field(default=None, repr=False)
    role: str | None = None  # mixed, prefill or decode (GetReplicaInfo, asked once it serves); None: not known yet
    session: SessionClient | None = field(default=None, repr=False)  # its Session stream (GetReplicaInfo.sessions)

    @classmethod
    def connect(cls, address: str) -> Replica:
        channel = open_channel(address)
        return cls(address, scheduler_pb2_grpc.SchedulerStub(channel), channel,
                   health=health_pb2_grpc.HealthStub(channel))  # fmt: skip

    def submit(
        self, request: scheduler_pb2.SubmitRequest, timeout: float | None, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterable[scheduler_pb2.TokenEvent]:
        """The request's stream from this replica, used as a ``Submit`` call (iterate it, ``cancel()`` it): one
        request of the replica's session stream where it takes one (and ``DEEPINFER_REPLICA_SESSIONS`` is on), else
        a ``Submit`` call of its own."""
        s = self.session
        if s is not None and not s.unsupported and envs.DEEPINFER_REPLICA_SESSIONS:
            return s.submit(request, timeout, metadata)
        return self.stub.Submit(request, timeout=timeout, metadata=metadata)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.channel is not None:
            await self.channel.close()

    async def probe(self, timeout: float, patience: int = 3) -> bool:
        """Ask the replica's gRPC health service: routable when it says SERVING. An answer of NOT_SERVING or a
        refused connection takes it out at once; a probe that only timed out (a busy balancer's own event loop can
        make it late) needs ``patience`` in a row."""
        if self.health is None:
            return self.healthy
        try:
            res = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                return False
            self.late_probes += 1
            return self.healthy and self.late_probes < patience
        self.late_probes = 0
        if res.status == SERVING and self.role is None:
            try:
                info = await self.stub.GetReplicaInfo(scheduler_pb2.GetReplicaInfoRequest(), timeout=timeout)
                self.role = info.role or "mixed"
                if info.sessions and self.session is None:
                    self.session = SessionClient(self.stub, self.address)
            except grpc.aio.AioRpcError:
                pass  # asked again with the next probe; routed as mixed meanwhile
        return res.status == SERVING


class ReplicaSet:
    """The replicas and their routing state (kept across ``set``: a known replica keeps its channel)."""

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        self.replicas: list[Replica] = []
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None
        self.on_probed: list[Callable[[], None]] = []  # called after each round of probes (the role gauge)
        self.set(list(addresses))

    def set(self, addresses: list[str]) -> None:
        known = {r.address: r for r in self.replicas}
        wanted = list(dict.fromkeys(addresses))
        self.replicas = [known.pop(a, None) or Replica.connect(a) for a in wanted]
        for gone in known.values():  # no longer registered: close its channel once its streams are done
            if gone.channel is not None and _has_loop():
                asyncio.get_running_loop().create_task(_close_when_idle(gone))

    def routable(self, role: str | None = None) -> list[Replica]:
        """The replicas that serve now (of ``role`` only, when given: ``prefill`` or ``decode``)."""
        return [r for r in self.replicas if r.healthy and (role is None or r.role == role)]

    def disaggregated(self) -> bool:
        """Whether a prefill and a decode replica serve now: requests then prefill on one and decode on the other."""
        return bool(self.routable("prefill")) and bool(self.routable("decode"))

    def pick(self, prefer: str | None = None, hint: RouteHint | None = None, role: str | None = None) -> Replica:
        """The replica for a request (docs/routing.md); ``prefer`` (an address) wins while it is routable (the
        samples of one prompt go where its prefix is cached). ``hint``: what cache-aware routing knows of the
        request; its ``reason`` is set to what chose the replica. ``role``: among the replicas of that role only
        (disaggregation); without one, a prefill replica only while no other serves."""
        ready = self.routable(role)
        if role is None and any(r.role != "prefill" for r in ready):
            ready = [r for r in ready if r.role != "prefill"]  # whole requests go to mixed and decode replicas
        if not ready:
            why = "no scheduler replica is registered" if not self.replicas else "no scheduler replica is serving"
            raise Unavailable(why if role is None else f"no {role} replica is serving")
        hint = hint if hint is not None else RouteHint()
        if prefer is not None and (same := next((r for r in ready if r.address == prefer), None)) is not None:
            hint.reason = "prefer"
            return same
        start = next(self._rr) % len(ready)
        ready = ready[start:] + ready[:start]  # ties: round robin
        policy = envs.DEEPINFER_ROUTER_POLICY
        if policy == "round_robin":
            hint.reason = "round_robin"
            return ready[0]
        if policy == "cache" and any(hint.cached.get(r.address, 0) for r in ready):
            hint.reason = "cache"
            w = envs.DEEPINFER_ROUTER_LOAD_TOKENS
            return min(ready, key=lambda r: hint.prompt_len - hint.cached.get(r.address, 0) + w * r.in_flight)
        if policy == "cache" and hint.session:
            hint.reason = "session"  # rendezvous hashing: stable while replicas come and go
            return max(ready, key=lambda r: hashlib.blake2b(f"{hint.session}|{r.address}".encode()).digest())
        hint.reason = "load"
        return min(ready, key=lambda r: r.in_flight)

    async def wait_pick(self, timeout: float) -> Replica:
        """:meth:`pick`, waiting up to ``timeout`` seconds for a replica to become routable (a restarting one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            try:
                return self.pick()
            except Unavailable:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))

    def failed(self, replica: Replica, reason: str) -> None:
        """A stream to ``replica`` failed as a dead replica's would: out of routing until a probe says SERVING."""
        if replica.healthy:
            log.warning("replica_down", replica=replica.address, reason=reason)
        replica.healthy = False

    async def probe_all(self, timeout: float) -> None:
        replicas = list(self.replicas)
        found = await asyncio.gather(*(r.probe(timeout) for r in replicas))
        for r, ok in zip(replicas, found):
            if ok != r.healthy:
                log.info("replica_up" if ok else "replica_down", replica=r.address, reason="health probe")
            r.healthy = ok
        for cb in self.on_probed:
            cb()

    def start(self, period_s: float | None = None) -> None:
        period = envs.DEEPINFER_REPLICA_PROBE_S if period_s is None else period_s
        self._task = asyncio.create_task(self._probe_forever(period))

    async def _probe_forever(self, period: float) -> None:
        while True:
            try:
                await self.probe_all(timeout=max(1.0, 2 * period))
            except Exception as e:  # noqa: BLE001 - a round that failed must not end probing: no replica would return
                log.warning("replica_probe_failed", error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(period)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for r in self.replicas:
            await r.close()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _close_when_idle(replica: Replica, poll_s: float = 1.0) -> None:
    while replica.in_flight:
        await asyncio.sleep(poll_s)
    await replica.close()
