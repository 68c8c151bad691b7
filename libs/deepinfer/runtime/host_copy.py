"""Host-to-device copies that never make the host wait for the GPU.

``torch.tensor(data, device="cuda")`` and ``t.to("cuda")`` copy synchronously: the host waits until the GPU has run
everything queued before the copy. ``ForwardBatch.build`` made two such copies per step (token ids, positions), so
the host could not queue a step's work while the GPU ran the previous layers (``bench/host/host_syncs.py`` showed them
under ``torch.cuda.set_sync_debug_mode``). A ``non_blocking`` copy from pageable memory may wait as well: the driver
stages it, and on one H200 machine such a copy of 64 integers took 11.8 ms of host time behind 25 ms of queued GPU
work (0.28 ms on another; 0.05–0.07 ms from pinned memory on both). ``to_device`` therefore stages a host tensor in
pinned memory (PyTorch's caching host allocator, which holds a block until the copies reading it have completed)
and copies it asynchronously, ordered on the current stream like any other work. Which devices take that path, and
their events and streams, the platform says (``Platform.pinned_copies``; :mod:`deepinfer.runtime.platform`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.runtime import pinned_pool
from deepinfer.runtime.platform import Event, platform_of

# True: synchronous copies, as before (the A/B of bench/engine/sweep.py --ab-h2d; a planted bug in tests)
BLOCKING = False


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for an accelerator with pinned copies goes through pinned memory,
    asynchronously (the copy is ordered on the current stream like any other work, so later kernels see the data)."""
    device = torch.device(device)
    if t.device.type != "cpu" or BLOCKING or not platform_of(device).pinned_copies:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StagedCopy:
    """``dst[:len(src)].copy_(src)`` from host memory through pinned buffers kept for it: a decode step's fixed-shape
    metadata, copied every step. ``to_device`` takes a pinned block from PyTorch's caching host allocator per copy
    (``is_pinned``, ``pin_memory`` and the copy: about 0.09 ms of host time each on an H200 machine, several a
    step before the graph's launch). Here the host writes into one of ``depth`` pinned buffers of ``dst``'s shape,
    round robin, and queues one copy; a buffer is written again only once the copy that last read it has run (its
    event), and when none is free the copy goes through ``to_device``: the host never waits for the GPU. ``take`` /
    ``send`` let the host write the buffer itself (from numpy: no host tensor made for the copy)."""

    def __init__(self, dst: torch.Tensor, depth: int = 4) -> None:
        self.dst = dst
        self.platform = platform_of(dst.device)
        pinned = self.platform.pinned_copies
        self._bufs = [torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True) for _ in range(depth)] if pinned else []
        self._arrays = [b.numpy() for b in self._bufs]  # the same memory, for writes from numpy
        self._events: list[Event | None] = [None] * len(self._bufs)
        self._next = self._taken = 0
        self.fallbacks = 0  # copies that found no free buffer (tests, benchmarks)

    def copy(self, src: torch.Tensor) -> None:
        n = src.shape[0]
        if src.device.type != "cpu" or self.take() is None:
            self.copy_unstaged(src)
            return
        self._bufs[self._taken][:n].copy_(src)
        self.send(n)

    def copy_unstaged(self, src: torch.Tensor) -> None:
        """``dst[:len(src)]`` from ``src`` through ``to_device``, none of the buffers: where ``take`` gave none."""
        self.dst[: src.shape[0]].copy_(to_device(src, self.dst.device))

    def take(self) -> np.ndarray | None:
        """A free pinned buffer of ``dst``'s shape, as a numpy array for the host to write the next copy into (then
        ``send``), or None: the copy goes through ``copy``'s other path (no pinned buffers on a host-memory ``dst``,
        ``BLOCKING``, a graph capture, or every buffer still read by a queued copy: counted in ``fallbacks``)."""
        if not self._bufs or BLOCKING or self.platform.capturing():
            return None
        for _ in range(len(self._bufs)):
            i = self._next
            self._next = (i + 1) % len(self._bufs)
            ev = self._events[i]
            if ev is None or ev.query():
                self._taken = i
                return self._arrays[i]
        self.fallbacks += 1
        return None

    def send(self, n: int) -> None:
        """Queue the copy of the first ``n`` rows of the buffer ``take`` gave into ``dst``."""
        i = self._taken
        self.dst[:n].copy_(self._bufs[i][:n], non_blocking=True)
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = self.platform.event()
        ev.record(self.platform.current_stream(self.dst.device))


def copy_to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (never ``t`` itself): from host memory to an accelerator through ``to_device``,
    without waiting for the device (a snapshot restored, a fetched resume point's pages written)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type != "cpu":
        return to_device(t, device)
    return t.to(device, copy=True)


def tensor(data: Sequence | float | int, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without waiting for the GPU (``to_device``)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
    """``t`` copied to pinned host memory without waiting, and the event that marks the copy done (None: ``t`` is on
    a platform without pinned copies, the host's among them: ``t`` itself). Read the copy only after
    ``event.synchronize()``."""
    platform = platform_of(t.device)
    if not platform.pinned_copies:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = platform.event()
    event.record(platform.current_stream(t.device))  # the copy's stream, whatever this thread's current device
    return host, event


class HostCopies:
    """Copies of a device's tensors in host memory, queued without waiting for the device: each call returns a
    pinned host tensor its copy is queued into (``to_host``'s path), and :meth:`done` the one event that marks them
    all complete (None: nothing was queued; on the host, or on a platform without pinned copies, each call copies
    at once, as ``t.to("cpu", copy=True)`` does). What reads the copies on the host waits for that event first; a
    copy back to the device on the same stream needs no wait (stream order). Used for what the worker keeps of a
    sequence in host memory (prefix-cache snapshots, pages bound for the kvstore): a synchronous copy would stall the
    host until the device has run every step queued before it, the pipelined loop's lead lost. The host tensors come
    from the process's pinned pool where it has room (``deepinfer.runtime.pinned_pool``: a burst of fresh pinned
    blocks costs milliseconds each)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.platform = platform_of(self.device)
        self.queued = False

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" or BLOCKING or not self.platform.pinned_copies:
            return t.to("cpu", copy=True)
        slab = pinned_pool.pool()
        host = slab.empty(t.shape, t.dtype) if slab is not None else None
        if host is None:  # no pool, or no free range in it: the caching host allocator's block
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        self.queued = True
        return host

    def done(self) -> Event | None:
        """The event after every copy queued so far (None when none was)."""
        if not self.queued:
            return None
        event = self.platform.event()
        event.record(self.platform.current_stream(self.device))
        return event


__all__ = ["HostCopies", "StagedCopy", "copy_to", "tensor", "to_device", "to_host"]
