"""Host-to-device copies that never make the host wait for the GPU.

``torch.tensor(data, device="cuda")`` and ``t.to("cuda")`` copy synchronously: the host waits until the GPU has run
everything queued before the copy. ``ForwardBatch.build`` made two such copies per step (token ids, positions), so
the host could not queue a step's work while the GPU ran the previous layers (``bench/host_syncs.py`` showed them
under ``torch.cuda.set_sync_debug_mode``). A ``non_blocking`` copy from pageable memory may wait as well: the driver
stages it, and on one H200 machine such a copy of 64 integers took 11.8 ms of host time behind 25 ms of queued GPU
work (0.28 ms on another; 0.05–0.07 ms from pinned memory on both). ``to_device`` therefore stages a host tensor in
pinned memory (PyTorch's caching host allocator, which holds a block until the copies reading it have completed)
and copies it asynchronously, ordered on the current stream like any other work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCKING = False  # True: synchronous copies, as before (the A/B of bench/sweep.py --ab-h2d; a planted bug in tests)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a CUDA device goes through pinned memory, asynchronously (the
    copy is ordered on the current stream like any other work, so later kernels see the data)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or BLOCKING:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor(data: Sequence | float | int, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without waiting for the GPU (``to_device``)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


__all__ = ["tensor", "to_device"]
