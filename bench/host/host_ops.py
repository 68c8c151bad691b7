"""The host's time per op of one run, without a profiler's distortion: every public method of the model's op set
(``deepinfer.ops``: where the model hands work to a backend) timed with ``perf_counter`` around the call, nothing
synchronised, and the rest of the run (the model's own Python and torch calls between ops) as ``outside ops``.

A method called from inside another (``moe_mxfp4`` from ``moe``, ``parallel``'s branches) counts in both: the
table's ``self ms`` subtracts the time of nested op calls. One wrapper costs about a microsecond a call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

SKIP = {"prepare_weights", "parallel"}  # load-time work; parallel only calls two ops (their times are their own)


def _timed(fn: Callable, depth: list[float], slot: Callable[[], list]) -> Callable:
    """``fn`` timed with ``perf_counter``: each call adds 1, its time and its time less that of the timed calls nested
    in it (``depth``: one entry per open call, shared by the wrappers) to ``slot()`` (``[calls, s, self s]``)."""

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
            s = slot()
            s[0] += 1
            s[1] += dt
            s[2] += dt - nested

    return timed


def _patch(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> Callable[[], None] | None:
    """Replace ``owner.attr`` (a class's function, classmethod or staticmethod, a module's function, an instance's
    attribute; its own or inherited) by ``make(fn)`` of the function it calls, kept of the same kind; → the call that
    puts it back (None: ``owner`` has no ``attr``, nothing replaced)."""
    mine = getattr(owner, "__dict__", {})
    if attr not in mine and not hasattr(owner, attr):
        return None
    own, raw = attr in mine, mine.get(attr)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    w = make(raw.__func__ if kind else getattr(owner, attr))
    setattr(owner, attr, kind(w) if kind else w)
    return (lambda: setattr(owner, attr, raw)) if own else (lambda: delattr(owner, attr))


def host_op_times(ops: Any, run: Callable[[], object], sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``run`` once with every op of ``ops`` timed on the host; ``sync`` before and after (outside the timing of
    the run's issue). → ``{"issue_ms", "outside_ops_ms", "ops": {name: {"calls", "ms", "self_ms"}}}``, the ops by
    self time."""
    stats: dict[str, list[float]] = {}
    depth: list[float] = []  # the nested ops' time, per open call
    names = [n for n in dir(type(ops)) if not n.startswith("_") and n not in SKIP and callable(getattr(ops, n))]

    def wrap(name: str) -> Callable[[Callable], Callable]:
        return lambda fn: _timed(fn, depth, lambda: stats.setdefault(name, [0, 0.0, 0.0]))

    undo = [_patch(ops, n, wrap(n)) for n in names]
    try:
        sync()
        t = time.perf_counter()
        run()
        issue = time.perf_counter() - t
        sync()
    finally:
        for back in reversed(undo):
            back()
    top = sum(s[2] for s in stats.values())
    table = {
        n: {"calls": int(c), "ms": round(1e3 * ms, 3), "self_ms": round(1e3 * own, 3)}
        for n, (c, ms, own) in sorted(stats.items(), key=lambda kv: -kv[1][2])
    }
    return {"issue_ms": round(1e3 * issue, 3), "outside_ops_ms": round(1e3 * (issue - top), 3), "ops": table}


def host_spans(
    targets: list[tuple[Any, str, str]], run: Callable[[], object], sync: Callable[[], None], repeats: int = 20
) -> dict[str, Any]:
    """The host's time in each of ``targets`` (``(owner, attribute, label)``: anything ``_patch`` replaces, wrapped
    with ``perf_counter`` for the runs and put back after) over ``repeats``
    runs of ``run`` from an idle device (``sync`` before each, outside the timing). → ``{"issue_ms", "ms", "spans":
    {label: {"calls", "ms", "self_ms"}}}``: medians per run; ``issue_ms`` until ``run`` returned, ``ms`` until the
    device finished; ``self_ms`` without the nested targets' time."""
    per_run: list[dict[str, list[float]]] = []
    depth: list[float] = []
    undo: list[Callable[[], None]] = []

    def wrap(label: str) -> Callable[[Callable], Callable]:
        return lambda fn: _timed(fn, depth, lambda: per_run[-1].setdefault(label, [0, 0.0, 0.0]))

    for owner, attr, label in targets:
        back = _patch(owner, attr, wrap(label))
        if back is not None:
            undo.append(back)
    issues, totals = [], []
    try:
        for _ in range(repeats):
            per_run.append({})
            sync()
            t = time.perf_counter()
            run()
            issues.append(time.perf_counter() - t)
            sync()
            totals.append(time.perf_counter() - t)
    finally:
        for back in reversed(undo):
            back()
    labels = {label for r in per_run for label in r}

    def med(label: str, i: int) -> float:
        return round(1e3 * statistics.median(r.get(label, [0, 0.0, 0.0])[i] for r in per_run), 3)

    spans = {label: {"calls": med(label, 0) / 1e3, "ms": med(label, 1), "self_ms": med(label, 2)} for label in labels}
    return {"issue_ms": round(1e3 * statistics.median(issues), 3), "ms": round(1e3 * statistics.median(totals), 3),
            "spans": dict(sorted(spans.items(), key=lambda kv: -kv[1]["ms"]))}  # fmt: skip


def decode_spans(model: Any, run: Callable[[], object], sync: Callable[[], None], repeats: int = 20) -> dict[str, Any]:
    """``host_spans`` of a DeepSeek-V4 decode step's host path: the batch's build, the graphed step (slots, plan,
    its parts, the bucket, the replay) and the logits."""
    import torch

    from deepinfer.models.deepseek_v4 import decode_step, graphs
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
    from deepinfer.models.deepseek_v4.state_pool import StatePool
    from deepinfer.runtime import decode_graphs, host_copy

    targets = [
        (ForwardBatch, "build", "ForwardBatch.build"),
        (type(model), "forward", "model.forward"),
        (graphs.DecodeGraphs, "run", "DecodeGraphs.run"),
        (StatePool, "adopt", "StatePool.adopt"),
        (decode_graphs.SegmentGraphs, "bucket", "SegmentGraphs.bucket"),
        (decode_step.V4DecodePlan, "fill", "V4DecodePlan.fill"),
        (decode_step, "load_meta", "load_meta"),
        (decode_step, "block_tables", "block_tables"),
        (host_copy.StagedCopy, "copy", "StagedCopy.copy"),
        (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay"),
        (type(model), "logits", "model.logits"),
    ]
    return host_spans(targets, run, sync, repeats)


def issue_timeline(model: Any, run: Callable[[], object]) -> list[dict[str, Any]]:
    """Who waits for whom in one run on a GPU: when the batch is built, a graphed decode step's pool slots adopted and
    plan loaded, at each layer's start, after its attention
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

    def after(owner: Any, attr: str, label: str | Callable[[], str]) -> None:
        """Mark after each call of ``owner.attr`` (put back afterwards)."""

        def make(fn: Callable) -> Callable:
            def marked(*a: Any, **k: Any) -> Any:
                out = fn(*a, **k)
                mark(label if isinstance(label, str) else label())
                return out

            return marked

        back = _patch(owner, attr, make)
        if back is not None:
            undo.append(back)

    replays = [0]

    def replayed() -> str:
        replays[0] += 1
        return f"graph {replays[0] - 1} replayed"

    from deepinfer.models.deepseek_v4.decode_step import V4DecodePlan
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
    from deepinfer.models.deepseek_v4.state_pool import StatePool

    after(ForwardBatch, "build", "batch built")
    after(StatePool, "adopt", "decode: pool slots adopted")
    after(V4DecodePlan, "fill", "decode: plan loaded")
    after(torch.cuda.CUDAGraph, "replay", replayed)
    kernels = [0]

    def issued(fn: Callable) -> Callable:
        def lists(*a: Any, **k: Any) -> Any:
            mark(f"attention kernel {kernels[0]} issued")
            kernels[0] += 1
            return fn(*a, **k)

        return lists

    ops = getattr(model, "ops", None)
    back = _patch(ops, "sparse_attention_lists", issued) if ops is not None else None
    if back is not None:
        undo.append(back)
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
        for back in reversed(undo):
            back()
    first = marks[0][2]
    return [
        {"at": n, "host_ms": round(1e3 * h, 3), "device_ms": round(first.elapsed_time(ev), 3),
         "lag_ms": round(first.elapsed_time(ev) - 1e3 * h, 3)}
        for n, h, ev in marks
    ]  # fmt: skip


def chunk_issue(timeline: list[dict[str, Any]]) -> list[dict[str, float]]:
    """``issue_timeline``'s marks per prefill chunk (a chunk begins at each "batch built"): the host's time from the
    chunk's first mark to its next chunk's (``host_ms``) and the least and most ``lag_ms`` in it. A host time that
    jumps while the lag stays at its most is the host waiting for room in the device's launch queue (the device sets
    the pace), not host work that grew: compare chunks at the same lag."""
    starts = [i for i, m in enumerate(timeline) if m["at"] == "batch built"]
    out = []
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(timeline) - 1
        lags = [m["lag_ms"] for m in timeline[i : end + 1]]
        out.append({"chunk": k, "host_ms": round(timeline[end]["host_ms"] - timeline[i]["host_ms"], 3),
                    "lag_min_ms": min(lags), "lag_max_ms": max(lags)})  # fmt: skip
    return out


__all__ = ["chunk_issue", "decode_spans", "host_op_times", "host_spans", "issue_timeline"]
