"""A slab of pinned host memory, reserved once, that the device-to-host copies of a burst carve tensors from.

``HostCopies`` queues the copies of what the worker keeps of a sequence in host memory (prefix-cache snapshots, pages
bound for the kvstore) into pinned memory. From PyTorch's caching host allocator, every block of a size it has not
cached yet is a fresh ``cudaHostAlloc``: on an H100 machine 1000 such blocks of 16 KiB - 4 MiB took 696 ms of host
time (p99 3.1 ms a block; 21 ms once cached, 24 ms from this pool: ``bench/host/pinned_alloc.py``,
``bench/results/host/2026-12-07-pinned-alloc-h100.md``), and a burst of 64 prompts finishing together, each
snapshot a few dozen tensors, stalled the pipelined loop for hundreds of milliseconds. The pool allocates its slab
once (at warm-up: ``reserve``) and hands out byte ranges of it, first fit; a range returns to the pool when the last
tensor or array viewing it is freed (``torch.frombuffer`` holds the range's numpy view; a finalizer on that view
releases it). When no range is free, the caller falls back to the caching allocator (counted in ``fallbacks``): the
pool bounds pinned memory, never correctness.

A range freed while a copy into it is still queued is safe to reuse: the copies that take it next (and the host
reads behind their events) are queued on the same stream, after it. The slab is process-wide, like pinned memory.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref

import torch

ALIGN = 512  # bytes: every range starts at a multiple (any dtype's alignment; copies of aligned rows)


class PinnedPool:
    """``nbytes`` of host memory (pinned where ``pinned``: the tests use plain memory), carved into tensors."""

    def __init__(self, nbytes: int, pinned: bool = True) -> None:
        self.nbytes = nbytes
        self.slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._bytes = self.slab.numpy()
        self._starts: list[int] = [0] if nbytes else []  # free ranges, sorted by start, never adjacent
        self._sizes: list[int] = [nbytes] if nbytes else []
        self._lock = threading.Lock()
        self.in_use = 0  # bytes handed out and not yet released
        self.peak = 0
        self.fallbacks = 0  # requests no free range could hold

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` and ``dtype`` in the slab, or None when no free range holds it (an
        empty ``shape``: a plain empty tensor, no range)."""
        count = math.prod(shape)
        if not count:  # (nothing to copy: no range)
            return torch.empty(shape, dtype=dtype)
        size = -(-count * dtype.itemsize // ALIGN) * ALIGN
        with self._lock:
            sizes, i = self._sizes, 0
            while i < len(sizes) and sizes[i] < size:  # first fit
                i += 1
            if i == len(sizes):
                self.fallbacks += 1
                return None
            start = self._starts[i]
            if self._sizes[i] == size:
                del self._starts[i], self._sizes[i]
            else:
                self._starts[i] += size
                self._sizes[i] -= size
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
        view = self._bytes[start : start + size]
        weakref.finalize(view, self._release, start, size)
        return torch.frombuffer(view, dtype=dtype, count=count).view(shape)

    def _release(self, start: int, size: int) -> None:
        """The range back into the free list, merged with its free neighbours."""
        with self._lock:
            self.in_use -= size
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and start + size == self._starts[i]:  # the next free range
                size += self._sizes[i]
                del self._starts[i], self._sizes[i]
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # the previous one
                self._sizes[i - 1] += size
                return
            self._starts.insert(i, start)
            self._sizes.insert(i, size)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, size) of each free range (tests)."""
        with self._lock:
            return list(zip(self._starts, self._sizes))


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> PinnedPool | None:
    """The process's pool (``DEEPINFER_PINNED_POOL_BYTES``; None when that is 0), its slab allocated on first use."""
    global _POOL
    if _POOL is None:
        from deepinfer import envs

        nbytes = envs.DEEPINFER_PINNED_POOL_BYTES
        if not nbytes:
            return None
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = PinnedPool(nbytes)
    return _POOL


def current() -> PinnedPool | None:
    """The process's pool if its slab was allocated (metrics: never allocates it)."""
    return _POOL


def reserve() -> PinnedPool | None:
    """Allocate the slab now (the worker's warm-up), not inside the first burst that needs it."""
    return pool()


__all__ = ["ALIGN", "PinnedPool", "current", "pool", "reserve"]
