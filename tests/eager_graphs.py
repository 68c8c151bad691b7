"""CUDA graphs' plumbing without CUDA, for the host's tests: a mix-in that makes a ``runtime.decode_graphs
.SegmentGraphs`` subclass apply on any device and "capture" a bucket by keeping its segments, each replayed
eagerly from the bucket's static inputs."""

from __future__ import annotations

from typing import Any


class _Segment:
    """Stands in for a captured graph: ``replay`` runs the segment eagerly."""

    def __init__(self, seg) -> None:
        self.replay = seg


class EagerCapture:
    """Mix in before the graphs class (``class X(EagerCapture, DecodeGraphs)``)."""

    def applies(self, batch: Any) -> bool:
        return self.graphable(batch)

    def _capture(self, size: int, device: Any, extra: tuple = (), before=None) -> Any:
        bk = self._bucket(size, device, *extra)
        if before is not None:
            before(bk)
        bk.graphs = [_Segment(seg) for seg in self._segments(bk)]
        return bk
