"""Timing helpers shared by the kernel benchmarks (``bench/moe_wgmma.py``, ``bench/attention_prefill.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """µs per call of ``fn`` from CUDA events around ``calls`` back-to-back calls, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3
