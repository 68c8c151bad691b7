"""The worker's Python heap after start-up: frozen out of the garbage collector's way.

CPython's full collection walks every tracked container object. A worker holds a few hundred thousand after its
start-up (the model's modules and parameters, torch, Triton and the other imported libraries, compiled kernels,
captured CUDA graphs) that live as long as the process, and a full collection comes whenever enough new objects
have survived into the oldest generation: each is a pause of the step loop as long as that walk (about 0.2 s on the
tiny model's CPU worker, `bench/host/gc_heap.py`). ``gc.freeze`` moves the objects alive now to a permanent generation
that collections skip (vLLM freezes the heap after its warm-up; SGLang has a freeze call and warns of long
collections). Frozen objects are still freed by reference counting; only reference cycles among them stay, which
is why a worker that replaces its model thaws the heap first (``thaw_heap``).
"""

from __future__ import annotations

import gc
import time


def freeze_heap() -> dict[str, float]:
    """Collect once, then freeze everything alive (``gc.freeze``): ``{"frozen", "collect_ms"}``, the objects now in
    the permanent generation and the time of that last full collection (what one would have cost during serving)."""
    t = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - t) * 1e3
    gc.freeze()
    return {"frozen": gc.get_freeze_count(), "collect_ms": round(collect_ms, 1)}


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (``gc.unfreeze``): before the worker replaces its model, whose
    reference cycles (a model and its CUDA graphs hold each other) would otherwise outlive it, weights and all; the
    next ``freeze_heap`` collects them before it freezes again."""
    gc.unfreeze()


__all__ = ["freeze_heap", "thaw_heap"]
