"""The host's time per op of one run, without a profiler's distortion: every public method of the model's op set
(``deepinfer.ops``: where the model hands work to a backend) timed with ``perf_counter`` around the call, nothing
synchronised, and the rest of the run (the model's own Python and torch calls between ops) as ``outside ops``.

A method called from inside another (``moe_mxfp4`` from ``moe``, ``parallel``'s branches) counts in both: the
table's ``self ms`` subtracts the time of nested op calls. One wrapper costs about a microsecond a call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SKIP = {"prepare_weights", "parallel"}  # load-time work; parallel only calls two ops (their times are their own)


def host_op_times(ops: Any, run: Callable[[], object], sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``run`` once with every op of ``ops`` timed on the host; ``sync`` before and after (outside the timing of
    the run's issue). → ``{"issue_ms", "outside_ops_ms", "ops": {name: {"calls", "ms", "self_ms"}}}``, the ops by
    self time."""
    stats: dict[str, list[float]] = {}
    depth: list[float] = []  # the nested ops' time, per open call
    names = [n for n in dir(type(ops)) if not n.startswith("_") and n not in SKIP and callable(getattr(ops, n))]
    saved = {n: ops.__dict__[n] for n in names if n in ops.__dict__}

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            depth.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                nested = depth.pop()
                if depth:
                    depth[-1] += dt
                s = stats.setdefault(name, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += dt
                s[2] += dt - nested

        return timed

    for n in names:
        setattr(ops, n, wrap(n, getattr(ops, n)))
    try:
        sync()
        t = time.perf_counter()
        run()
        issue = time.perf_counter() - t
        sync()
    finally:
        for n in names:
            if n in saved:
                setattr(ops, n, saved[n])
            else:
                delattr(ops, n)
    top = sum(s[2] for s in stats.values())
    table = {
        n: {"calls": int(c), "ms": round(1e3 * ms, 3), "self_ms": round(1e3 * own, 3)}
        for n, (c, ms, own) in sorted(stats.items(), key=lambda kv: -kv[1][2])
    }
    return {"issue_ms": round(1e3 * issue, 3), "outside_ops_ms": round(1e3 * (issue - top), 3), "ops": table}


def issue_timeline(model: Any, run: Callable[[], object]) -> list[dict[str, Any]]:
    """Who waits for whom in one run on a GPU: when the batch is built, at each layer's start, after its attention
    (and each attention kernel's issue) and after its MoE, after each CUDA graph replay, the
    host's time since the run began and the device's (a CUDA event recorded there, read after the run). ``lag_ms`` =
    device − host: near 0 the device had caught up and waited for the host (host-bound there); growing, the host ran
    ahead of it."""
    import torch

    marks: list[tuple[str, float, Any]] = []
    t0 = [0.0]

    def mark(name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, time.perf_counter() - t0[0], ev))

    hooks, undo = [], []

    def after(obj: Any, attr: str, label: str) -> None:
        """Mark after each call of ``obj.attr`` (an instance attribute, deleted afterwards)."""
        if not hasattr(obj, attr):
            return
        fn = getattr(obj, attr)

        def marked(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            mark(label)
            return out

        setattr(obj, attr, marked)
        undo.append((obj, attr))

    def around_class(cls: Any, attr: str, label: Callable[[], str]) -> None:
        """Mark after each call of the class attribute ``cls.attr`` (restored afterwards)."""
        raw = cls.__dict__.get(attr)
        if raw is None:
            return
        fn = getattr(cls, attr)
        if isinstance(raw, classmethod):
            fn = raw.__func__

        def marked(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            mark(label())
            return out

        setattr(cls, attr, classmethod(marked) if isinstance(raw, classmethod) else marked)
        restore.append((cls, attr, raw))

    restore: list[tuple[Any, str, Any]] = []
    replays = [0]

    def replayed() -> str:
        replays[0] += 1
        return f"graph {replays[0] - 1} replayed"

    from deepinfer.models.deepseek_v4.state import ForwardBatch

    around_class(ForwardBatch, "build", lambda: "batch built")
    around_class(torch.cuda.CUDAGraph, "replay", replayed)
    ops = getattr(model, "ops", None)
    kernels = [0]
    if ops is not None and hasattr(ops, "sparse_attention_lists"):
        fn_lists = ops.sparse_attention_lists

        def lists(*a: Any, **k: Any) -> Any:
            mark(f"attention kernel {kernels[0]} issued")
            kernels[0] += 1
            return fn_lists(*a, **k)

        ops.sparse_attention_lists = lists
        undo.append((ops, "sparse_attention_lists"))
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: mark(f"layer {i}")))
        hooks.append(layer.ffn.register_forward_hook(lambda m, a, o, i=i: mark(f"layer {i} moe done")))
        after(layer, "attn_in", f"layer {i} projections done")
        after(layer.attn, "_compress_batched", f"layer {i} a compressor done")
        after(layer.attn, "attend", f"layer {i} attention done")
        if getattr(layer.attn, "indexer", None) is not None:
            after(layer.attn.indexer, "select_ranges", f"layer {i} indexer done")
    try:
        torch.cuda.synchronize()
        t0[0] = time.perf_counter()
        mark("start")
        run()
        mark("issued")
        torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
        for obj, attr in reversed(undo):
            delattr(obj, attr)
        for cls, attr, raw in reversed(restore):
            setattr(cls, attr, raw)
    first = marks[0][2]
    return [
        {"at": n, "host_ms": round(1e3 * h, 3), "device_ms": round(first.elapsed_time(ev), 3),
         "lag_ms": round(first.elapsed_time(ev) - 1e3 * h, 3)}
        for n, h, ev in marks
    ]  # fmt: skip


__all__ = ["host_op_times", "issue_timeline"]
