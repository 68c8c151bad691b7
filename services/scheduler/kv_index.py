"""KV events of the prefix cache on NATS, both ways. Events carry hashes only (``kvstore/keys.py``): a one-way
``tag`` naming the blob, the ``anchor`` of its chain hash and its ``position``; never a key, a chain hash or a token.

* :class:`KVIndexFollower`: every kvstore publishes what it stores and removes, per tier
  (``deepinfer.kv.kvstore.<instance>``). A scheduler whose worker moves resume points to and from a kvstore
  indexes the resume points stored for its own model fingerprint, so a prefix offloaded by any replica is a
  hit on every replica with the same cache salt and tokens (the key is derived from them at lookup). An entry
  leaves the index when no kvstore tier holds it any more (or when a fetch of it fails). Device-tier events
  (other replicas' own caches) are not fetchable and are ignored.
* :class:`DeviceKVPublisher`: a scheduler's own resume points, stored (snapshot taken) and removed (evicted
  or offloaded), tier ``device``, in the kvstore's message format on ``deepinfer.kv.scheduler.<instance>``,
  batched every 100 ms or 64 events, with the replica's address and page size (what a balancer's cache-aware
  routing needs: ``services/balancer/cache_index.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from deepinfer.engine.prefix_cache import ResumePoint
from deepinfer.engine.prefix_scheduling import event_fields
from deepinfer.engine.scheduler import Scheduler
from deepinfer.events import subjects
from deepinfer.events.bus import EventBus
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class KVIndexFollower:
    def __init__(self, scheduler: Scheduler, fingerprint: str) -> None:
        self.scheduler, self.fingerprint = scheduler, fingerprint
        self.tiers: dict[bytes, set[str]] = {}  # tag -> tiers holding it

    async def start(self, bus: EventBus) -> None:
        await bus.subscribe(subjects.kv_wildcard("kvstore"), self.on_message)

    async def on_message(self, subject: str, payload: dict[str, Any]) -> None:
        for ev in payload.get("events", []):
            try:
                self.apply(ev)
            except (KeyError, ValueError, TypeError) as e:  # a malformed event must not stop the others
                log.warning("kv_event_ignored", subject=subject, error=str(e))

    def apply(self, ev: dict[str, Any]) -> None:
        if ev.get("fingerprint") != self.fingerprint or not ev.get("resume_point") or ev.get("tier") == "device":
            return
        tag = bytes.fromhex(ev["tag"])
        if ev["type"] == "stored":
            if "anchor" not in ev:  # a blob stored without its binding (refused by a current kvstore)
                return
            self.tiers.setdefault(tag, set()).add(str(ev["tier"]))
            self.scheduler.add_remote(bytes.fromhex(ev["anchor"]), int(ev["position"]), tag)
        elif ev["type"] == "removed":
            held = self.tiers.get(tag, set())
            held.discard(str(ev["tier"]))
            if not held:
                self.tiers.pop(tag, None)
                self.scheduler.remove_remote(tag)


class DeviceKVPublisher:
    """``address`` and ``page_size`` go with every message: a balancer routes to the replica at ``address`` by the
    resume points it holds (it hashes a prompt's pages as the replica does)."""

    def __init__(self, instance: str, fingerprint: str, address: str = "", page_size: int = 0, period_s: float = 0.1,
                 batch: int = 64) -> None:  # fmt: skip
        self.instance, self.fingerprint, self.period_s, self.batch = instance, fingerprint, period_s, batch
        self.address, self.page_size = address, page_size
        self.queue: list[dict[str, Any]] = []
        self.bus: EventBus | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def on_event(self, kind: str, rp: ResumePoint, reason: str) -> None:
        """A :attr:`Scheduler.kv_listeners` callback (runs on the scheduler's event loop)."""
        self.queue.append({"type": kind, "tier": "device", "fingerprint": self.fingerprint,
                           **event_fields(rp, self.fingerprint), "resume_point": True, "reason": reason})  # fmt: skip
        if len(self.queue) > 65536:  # NATS unreachable for long: keep the newest
            del self.queue[: len(self.queue) - 65536]
        if len(self.queue) >= self.batch:
            self._wake.set()

    async def start(self, bus: EventBus) -> None:
        self.bus = bus
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.period_s)
            except TimeoutError:
                pass
            self._wake.clear()
            while self.queue and self.bus is not None:
                events, self.queue = self.queue[: self.batch], self.queue[self.batch :]
                message = {"instance": self.instance, "address": self.address, "page_size": self.page_size,
                           "events": events}  # fmt: skip
                await self.bus.publish(subjects.kv_subject("scheduler", self.instance), message)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
