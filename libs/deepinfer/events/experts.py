"""Expert-load reports for EPLB: each rank of a worker publishes how many tokens its tokens routed to each expert of
each MoE layer; a view sums a replica's reports over a recent window (``parallel.rebalancer`` turns them into
placements).

::

    reporter = ExpertLoadReporter(bus, "r0", rank=1, supplier=lambda: {3: [12, 0, 7, ...], ...})
    await reporter.start()
    view = ExpertLoadView(bus, window_s=60.0); await view.start()
    view.loads("r0")  # -> {3: array([...]), ...}: the window's tokens per expert, all ranks together

Contracts:

- A report is the JSON object ``{"replica", "rank", "seq", "started_at", "sent_at", "period_s", "layers":
  {"<layer>": [count per expert]}}`` on ``deepinfer.experts.<replica>``; the counts are those since the rank's
  previous report (the supplier hands them over and starts again).
- Reports are perishable, as load reports are: while NATS is down the reporter neither asks the supplier nor
  publishes (the counts keep adding up in the model), and publishing never blocks or raises.
- The view drops a report it cannot read (not an object, negative or non-integer counts, layers of different
  expert counts than earlier reports of the replica) and counts it in ``rejected``; the rest of the stream goes on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from nats.aio.subscription import Subscription

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, quietly
from deepinfer.events.load import PeriodicReporter
from deepinfer.telemetry import get_logger

__all__ = ["ExpertLoadReporter", "ExpertLoadView"]

log = get_logger(__name__)
Supplier = Callable[[], Mapping[int, Sequence[int]]]


class ExpertLoadReporter(PeriodicReporter):
    """Publishes ``supplier()`` (tokens per expert by layer, since the last call) every ``period_s`` seconds, the
    first after a period (``load.PeriodicReporter``)."""

    first_at_once = False

    def __init__(self, bus: EventBus, replica: str, rank: int, supplier: Supplier, *, period_s: float = 10.0) -> None:
        super().__init__(bus, subjects.experts_subject(replica), supplier, period_s, "expert_load")
        self.replica, self.rank = replica, rank

    def payload(self, data: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        layers = {str(int(k)): [int(x) for x in v] for k, v in data.items()}
        return {"replica": self.replica, "rank": self.rank, "layers": layers}


class ExpertLoadView:
    """Every replica's expert loads over the last ``window_s`` seconds, fed by ``deepinfer.experts.*``."""

    def __init__(self, bus: EventBus, *, window_s: float = 600.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.bus, self.window_s = bus, window_s
        self.received = self.rejected = 0
        self._reports: dict[str, deque[tuple[float, dict[int, np.ndarray]]]] = {}
        self._widths: dict[tuple[str, int], int] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(subjects.experts_wildcard(), self._on_report)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await quietly(sub.unsubscribe(), "expert load view unsubscribe")

    def replicas(self) -> list[str]:
        """The replicas with reports in the window."""
        return sorted(r for r in list(self._reports) if self._trim(r))

    def loads(self, replica: str) -> dict[int, np.ndarray]:
        """Tokens per expert by layer, summed over the replica's ranks and the window's reports."""
        reports = self._trim(replica)
        out: dict[int, np.ndarray] = {}
        for _, layers in reports:
            for layer, counts in layers.items():
                out[layer] = out[layer] + counts if layer in out else counts.copy()
        return out

    def _trim(self, replica: str) -> deque:
        reports = self._reports.get(replica, deque())
        while reports and time.monotonic() - reports[0][0] > self.window_s:
            reports.popleft()
        return reports

    async def _on_report(self, subject: str, payload: dict[str, Any]) -> None:
        try:
            replica = subject.rsplit(".", 1)[1]
            layers = payload["layers"]
            if not isinstance(layers, dict):
                raise TypeError(f"layers is {type(layers).__name__}, not an object")
            parsed: dict[int, np.ndarray] = {}
            for key, counts in layers.items():
                layer = int(key)
                if not isinstance(counts, list) or not all(isinstance(x, int) and x >= 0 for x in counts):
                    raise ValueError(f"layer {layer}: counts must be non-negative integers")
                width = self._widths.setdefault((replica, layer), len(counts))
                if len(counts) != width:
                    raise ValueError(f"layer {layer}: {len(counts)} experts, earlier reports {width}")
                parsed[layer] = np.asarray(counts, dtype=np.int64)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self.rejected += 1
            log.warning("expert_load_report_rejected", subject=subject, error=repr(exc))
            return
        self.received += 1
        self._reports.setdefault(replica, deque()).append((time.monotonic(), parsed))
        self._trim(replica)
