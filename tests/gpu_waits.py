"""Shared by the GPU tests that a decode step never makes the host wait for the GPU (``kernels/test_graphs*.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_steps_never_wait(step: Callable[[list[int]], object], steps: Sequence[list[int]], warm: int = 4) -> None:
    """Run ``step(ids)`` for each of ``steps``: the first ``warm`` to capture the buckets and fill the pinned-memory
    caches, then each with about half a second of GPU time queued ahead of it, under sync debug mode "error" (no
    synchronising call), and check that the queued work still runs when the step returns."""
    for ids in steps[:warm]:
        step(ids)
    torch.cuda.synchronize()
    for ids in steps[warm:]:
        torch.cuda._sleep(1_000_000_000)
        queued = torch.cuda.Event()
        queued.record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert not queued.query(), "the host waited for the GPU during a decode step"
        torch.cuda.synchronize()
