"""Load reports: each replica publishes its load every ``period_s``; balancers keep the latest per instance.

::

    reporter = LoadReporter(bus, "worker", "w0", lambda: {"running_requests": 3, "free_kv_pages": 900})
    await reporter.start()
    view = LoadView(bus); await view.start()
    view.latest("worker")  # -> {"w0": LoadSample(load={...}, age_s=0.2, ...)}

Contracts:

- A report is the JSON object ``{"instance_id", "kind", "seq", "sent_at", "period_s", "load": {...}}`` on
  ``deepinfer.load.<kind>.<instance_id>``; ``load`` is whatever the supplier returns, by convention the
  fields of the ``deepinfer.v1.ReplicaLoad`` message (:class:`ReplicaLoad`).
- Reports are perishable: the reporter skips them while NATS is down (counted in ``skipped``) rather than
  buffering stale numbers, and publishing never blocks or raises (``EventBus.publish``). A supplier that
  raises is logged once per distinct error and the report is skipped.
- :class:`LoadView` keeps the newest report per instance; an older ``seq`` from the same sender start is
  ignored. A sample older than ``3 × period_s`` (the sender's period) is dropped: no load is better than
  a stale one, so during an outage the view empties.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from nats.aio.subscription import Subscription

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, OnceLog, quietly, stop_tasks
from deepinfer.telemetry import get_logger

__all__ = ["STALE_PERIODS", "LoadReporter", "LoadSample", "LoadView", "PeriodicReporter", "ReplicaLoad"]

log = get_logger(__name__)
STALE_PERIODS = 3.0


class ReplicaLoad(TypedDict, total=False):
    """The conventional ``load`` fields: those of the ``deepinfer.v1.ReplicaLoad`` protobuf message."""

    replica_id: str
    waiting_requests: int
    running_requests: int
    queued_prefill_tokens: int
    free_kv_pages: int
    total_kv_pages: int
    step_time_ms: float
    draining: bool
    max_queued: int
    max_running: int


class PeriodicReporter:
    """Publishes ``supplier()``, shaped by ``payload``, on ``subject`` every ``period_s`` seconds (``first_at_once``:
    the first report at start, else after a period). Perishable, never raising: module docstring. Subclasses give
    the subject and the payload (``LoadReporter``, ``events.experts.ExpertLoadReporter``)."""

    first_at_once = True

    def __init__(self, bus: EventBus, subject: str, supplier: Callable[[], Any], period_s: float, name: str) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.bus, self.subject, self.supplier, self.period_s, self.name = bus, subject, supplier, period_s, name
        self.seq = 0
        self.sent = 0
        self.skipped = 0  # reports not published because NATS was down or the supplier failed
        self._started_at = time.time()
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._errors = OnceLog(f"{name}_supplier_failed")

    def payload(self, data: Any) -> dict[str, Any]:
        """The report of one ``supplier()`` result (``seq``, ``started_at``, ``sent_at`` and ``period_s`` added)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Start publishing in the background."""
        self._running = True
        self._task = asyncio.create_task(self._loop(), name=f"{self.name}-reporter-{self.subject}")

    async def report(self) -> bool:
        """Publish one report now; ``True`` if it was handed to NATS. Never raises."""
        if not self.bus.connected:
            self.skipped += 1
            return False
        try:
            report = self.payload(self.supplier())
        except Exception as exc:
            self._errors.failed(exc, subject=self.subject)
            self.skipped += 1
            return False
        self._errors.ok()
        self.seq += 1
        report.update(seq=self.seq, started_at=self._started_at, sent_at=time.time(), period_s=self.period_s)
        try:
            ok = await self.bus.publish(self.subject, report)
        except (TypeError, ValueError) as exc:  # the supplier returned something that is not JSON
            log.warning(f"{self.name}_report_not_json", subject=self.subject, error=repr(exc))
            ok = False
        self.sent += ok
        self.skipped += not ok
        return ok

    async def _loop(self) -> None:
        if not self.first_at_once:
            await asyncio.sleep(self.period_s)
        while self._running:  # a flag as well as cancellation (see bus.stop_tasks)
            await self.report()
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        """Stop publishing. Idempotent."""
        self._running = False
        await stop_tasks(self._task)
        self._task = None


class LoadReporter(PeriodicReporter):
    """Publishes ``supplier()`` on the instance's load subject every ``period_s`` seconds (the first report at
    once)."""

    def __init__(
        self,
        bus: EventBus,
        kind: str,
        instance_id: str,
        supplier: Callable[[], Mapping[str, Any]],
        *,
        period_s: float = 1.0,
    ) -> None:
        super().__init__(bus, subjects.load_subject(kind, instance_id), supplier, period_s, "load")
        self.kind, self.instance_id = kind, instance_id  # (the subject validated both)

    def payload(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "kind": self.kind, "load": dict(data)}


@dataclass
class LoadSample:
    """The newest report of one instance, as received."""

    instance_id: str
    kind: str
    load: dict[str, Any]
    seq: int
    started_at: float  # the sender's start (unix seconds); with seq, orders reports of one sender
    sent_at: float  # sender's clock (unix seconds)
    period_s: float
    received_at: float = field(default_factory=time.monotonic)  # this process's monotonic clock

    @property
    def age_s(self) -> float:
        """Seconds since this sample was received."""
        return time.monotonic() - self.received_at

    @property
    def stale(self) -> bool:
        """Older than ``STALE_PERIODS`` × the sender's period."""
        return self.age_s > STALE_PERIODS * self.period_s


class LoadView:
    """The latest load report per instance, fed by a subscription to ``deepinfer.load.>``."""

    def __init__(self, bus: EventBus, *, kind: str | None = None) -> None:
        self.bus = bus
        self.subject = subjects.load_wildcard(kind)
        self.received = 0
        self._samples: dict[str, LoadSample] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe (the subscription survives reconnects)."""
        self._sub = await self.bus.subscribe(self.subject, self._on_report)

    async def close(self) -> None:
        """Unsubscribe; never raises."""
        sub, self._sub = self._sub, None
        if sub is not None:
            await quietly(sub.unsubscribe(), "load view unsubscribe")

    def latest(self, kind: str | None = None) -> dict[str, LoadSample]:
        """Fresh samples by instance id (of ``kind`` if given); stale ones are dropped here."""
        for key in [k for k, s in self._samples.items() if s.stale]:
            del self._samples[key]
        return {s.instance_id: s for s in self._samples.values() if kind is None or s.kind == kind}

    def get(self, kind: str, instance_id: str) -> LoadSample | None:
        """One instance's fresh sample, or ``None``."""
        sample = self._samples.get(f"{kind}.{instance_id}")
        return None if sample is None or sample.stale else sample

    async def _on_report(self, subject: str, payload: dict[str, Any]) -> None:
        try:
            kind, instance_id = subjects.parse_load_subject(subject)
            sample = LoadSample(
                instance_id=instance_id,
                kind=kind,
                load=dict(payload["load"]),
                seq=int(payload["seq"]),
                started_at=float(payload.get("started_at", 0.0)),
                sent_at=float(payload["sent_at"]),
                period_s=float(payload["period_s"]),
            )
            if not sample.period_s > 0:
                raise ValueError(f"period_s {sample.period_s!r} is not positive")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("load_bad_report", subject=subject, error=repr(exc))
            return
        key = f"{kind}.{instance_id}"
        old = self._samples.get(key)
        if old is not None and (old.started_at, old.seq) >= (sample.started_at, sample.seq):
            return  # a late or duplicate delivery of an older report
        self._samples[key] = sample
        self.received += 1
