"""Where a profiled run leaves the device idle: the union of its device activities (kernels, copies, memsets on any
stream) against the span from the first one's start to the last one's end, and the longest gaps with the activities
on either side (``sweep.py --profile-prefill``).

A gap is device time with nothing running on any stream: the host had not yet queued the next work (launch cost,
Python, a sync). ``torch.profiler`` slows the host's side, so the gaps of a profiled run are an upper bound of the
unprofiled run's; a long gap next to the same kernels in both is a host-side stall worth finding.
"""

from __future__ import annotations

from typing import Any


def device_gaps(prof: Any, top: int = 12, min_us: float = 5.0) -> dict[str, Any]:
    """The device's busy union, span, idle time and its ``top`` longest gaps (µs, the activities before and after)
    from a finished ``torch.profiler.profile``; gaps under ``min_us`` are only summed."""
    from torch.autograd import DeviceType

    acts = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not acts:
        return {"activities": 0}
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    start, end, last = acts[0]
    for s, e, name in acts[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, last, name))
            start, end, last = s, e, name
        elif e > end:
            end, last = e, name
    busy += end - start
    span = max(a[1] for a in acts) - acts[0][0]
    long = sorted((g for g in gaps if g[0] >= min_us), reverse=True)
    return {
        "activities": len(acts),
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps": len(gaps),
        "idle_in_gaps_over_min_ms": round(sum(g[0] for g in long) / 1e3, 3),
        "top_gaps": [{"us": round(us, 1), "after": a[:80], "before": b[:80]} for us, a, b in long[:top]],
    }


__all__ = ["device_gaps"]
