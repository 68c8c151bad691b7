"""KV events of one kvstore instance on NATS: what was stored or removed, per tier (hashes only, batched).

Each message on ``subjects.kv_subject("kvstore", <instance id>)`` is::

    {"instance": "kvstore-host-123",
     "events": [{"type": "stored" | "removed", "tier": "host" | "disk", "fingerprint": "...",
                 "tag": "<hex>", "anchor": "<hex>", "position": 512, "resume_point": true, "reason": "put" | ...}]}

An event never carries the blob's key, its meta or a token id: ``tag`` is a one-way hash of the key, ``anchor``
one of the resume point's chain hash (``kvstore/keys.py``); ``anchor`` and ``position`` come from the blob's
binding meta and are absent when it has none (a blob that is not a resume point).

Stored reasons: ``put``, ``promoted`` (a disk read copied into host memory), ``indexed`` (found on disk at
start). Removed reasons: ``evicted``, ``expired``, ``corrupt``, ``removed`` (a Remove call), ``missing``.

Contracts: :meth:`KVEventPublisher.on_event` is a :class:`~services.kvstore.store.Store` listener, safe
from any thread, and never waits for NATS. Events are sent every ``period_s`` or as soon as ``batch``
are waiting. Until the bus is connected they wait in a bounded buffer (the oldest are dropped beyond
``max_buffered``); once connected, :class:`~deepinfer.events.bus.EventBus` buffers through outages. Every
event that is not handed to the client is counted through ``on_drop``. Subscribers must be idempotent.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, stop_tasks, wait_event
from deepinfer.kvstore.keys import anchor, key_tag, parse_binding
from deepinfer.telemetry import get_logger
from services.kvstore.store import StoreEvent

__all__ = ["KVEventPublisher", "event_payload"]

log = get_logger(__name__)


def event_payload(event: StoreEvent) -> dict[str, Any] | None:
    """The JSON form of one store event (``None`` for a corrupt file whose key is unknown)."""
    if event.key is None:
        return None
    key = event.key
    out: dict[str, Any] = {
        "type": event.type,
        "tier": event.tier.value,
        "fingerprint": key.fingerprint,
        "tag": key_tag(key.fingerprint, key.hash).hex(),
        "resume_point": key.resume_point,
        "reason": event.reason,
    }
    binding = parse_binding(event.meta)
    if binding is not None:
        out["anchor"], out["position"] = anchor(binding[0]).hex(), binding[2]
    return out


class KVEventPublisher:
    """Batches store events into messages on the instance's KV subject (see the module docstring)."""

    def __init__(
        self,
        instance: str,
        bus: Callable[[], EventBus | None],
        *,
        period_s: float = 0.1,
        batch: int = 64,
        max_buffered: int = 65_536,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.instance = instance
        self.subject = subjects.kv_subject("kvstore", instance)
        self.bus, self.period_s, self.batch, self.max_buffered = bus, period_s, batch, max_buffered
        self.on_drop = on_drop
        self.published = self.dropped = 0  # events
        self._buffer: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running = False

    def on_event(self, event: StoreEvent) -> None:
        """Queue one event (any thread; never blocks on NATS)."""
        payload = event_payload(event)
        if payload is None:
            return
        with self._lock:
            overflow = len(self._buffer) >= self.max_buffered
            if overflow:
                self._buffer.popleft()
            self._buffer.append(payload)
            full = len(self._buffer) >= self.batch
        if overflow:
            self._count_drop(1)
        loop = self._loop
        if full and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._kick.set)
            except RuntimeError:  # the loop closed in between
                pass

    async def start(self) -> None:
        """Start sending in the background (events queued before are sent on the first tick)."""
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._running = True
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.instance}")

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Stop the background task and send what is queued (for at most ``flush_timeout_s``)."""
        self._running = False
        await stop_tasks(self._task)
        self._task = None
        try:
            async with asyncio.timeout(flush_timeout_s):
                await self.flush()
        except TimeoutError:
            log.warning("kv_events_flush_timeout", pending=len(self._buffer))

    async def _run(self) -> None:
        while self._running:
            await wait_event(self._kick, self.period_s)
            try:
                await self.flush()
            except Exception as exc:  # never let a bug end event publishing silently
                log.error("kv_events_flush_failed", error=repr(exc))

    async def flush(self) -> int:
        """Send every queued event now, in batches; returns how many were handed to NATS."""
        bus = self.bus()
        if bus is None:  # not connected yet: keep them (bounded)
            return 0
        sent = 0
        while True:
            with self._lock:
                events = [self._buffer.popleft() for _ in range(min(self.batch, len(self._buffer)))]
            if not events:
                return sent
            if await bus.publish(self.subject, {"instance": self.instance, "events": events}):
                self.published += len(events)
                sent += len(events)
            else:
                self._count_drop(len(events))

    def _count_drop(self, n: int) -> None:
        self.dropped += n
        if self.on_drop is not None:
            self.on_drop(n)
        if self.dropped == n or self.dropped % 1000 < n:
            log.warning("kv_events_dropped", dropped=self.dropped)
