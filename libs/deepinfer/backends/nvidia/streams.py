"""``Ops.parallel`` on CUDA: the second of two independent pieces of work on a side stream of the device, forked
from and joined back to its current stream, so that the device may run them at once (the MoE's shared expert
beside its routed experts, forked after the router: small GEMMs that leave most of the device idle, next to kernels
that leave part of it idle too). The fork and the join are stream waits, which CUDA graph capture records as edges:
a captured step replays the two branches concurrently. The results are the kernels' own, so bit for bit those of
running the two one after the other; off (``DEEPINFER_STREAM_OVERLAP=0``, ``overlap = False``, or a tensor off
CUDA) they run so.

Shared device state: the split-K kernels' tickets (``small_gemm.counters``) are per lane, the side branch's its
own. Memory: the side branch's tensors are allocated on the side stream, which waits for the current stream at
every fork, and the current stream waits for the side stream at every join; so a block freed by either is reused
only after the other's earlier work is ordered before it."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StreamOps:
    """``parallel`` on two streams while ``overlap`` (default ``DEEPINFER_STREAM_OVERLAP``; False: one after the
    other)."""

    @property
    def overlap(self) -> bool:
        if "_overlap" not in self.__dict__:
            from deepinfer import envs

            self._overlap = bool(envs.get("DEEPINFER_STREAM_OVERLAP"))
        return self._overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._overlap = value

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = self.__dict__.setdefault("_side_streams", {})
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in streams:
            streams[index] = torch.cuda.Stream(index)
        return streams[index]

    def parallel(
        self, first: Callable[[], object], second: Callable[[], object], device: torch.device
    ) -> tuple[object, object]:
        if not self.overlap or device.type != "cuda":
            return first(), second()
        from deepinfer.kernels import small_gemm

        main = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        side.wait_stream(main)
        try:
            lane = small_gemm.LANE.set(1)  # the split-K kernels' tickets: the side branch's own counters
            try:
                with torch.cuda.stream(side):
                    b = second()
            finally:
                small_gemm.LANE.reset(lane)
            a = first()
        finally:  # joined even when a branch raises: nothing on the side stream outlives the call
            main.wait_stream(side)
        return a, b


__all__ = ["StreamOps"]
