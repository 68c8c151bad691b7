"""Before/after of the decode step's host-launch work, in one run of ``bench/engine/sweep.py`` (``--ab``).

For each decode batch size, three variants of ``NvidiaOps`` decode the same kind of step from fresh copies of the
same prefilled context (own states, own cache pages):

* ``eager_unfused``: the op set as it was before the fused kernels and the graphs (the reference's torch ops for mHC,
  RMSNorm and RoPE; every step eager);
* ``eager_fused``: the fused Triton kernels (``kernels.hc``, ``kernels.norm``), every step eager;
* ``graphs``: the fused kernels and the decode CUDA graphs (``models.deepseek_v4.graphs``), the default.

With a model that carries ``weight_sets`` (``--ab-weights``; ``bench/engine/weight_sets.py``) the variants are instead
``WEIGHT_VARIANTS``: ``bf16_graphs`` (every weight dequantised to bf16, graphs: the default before the FP8 / MXFP4
kernels), ``native_eager`` and ``native_graphs`` (FP8 linears and MXFP4 experts as stored: the default now), and
``weights_vs_bf16`` compares the logits of the two weight sets (same values, other kernels). ``--ab-pool`` compares
``POOL_VARIANTS``: the decode state kept per sequence against the pooled state (``state_pool.py``), both graphed;
``--ab-h2d`` compares ``H2D_VARIANTS``: the step's host-to-device copies synchronous against asynchronous from pinned
memory (``runtime/host_copy.py``); ``--ab-order`` compares ``ORDER_VARIANTS``: the MXFP4 experts' codes as stored
against the shift and rotate orders (``quant/nibble_order.py``).

Each variant decodes from its own copy of the states and cache pages. After ``--warmup`` steps of each, ``--repeats``
rounds time one step of every variant in turn (interleaved, so that the machine's drift falls on all three alike; the
median is reported), and one more step of each runs under ``torch.profiler``: kernel launches issued by the host
(``cudaLaunchKernel`` and the driver's launch calls), graph launches, host-to-device copies, host syncs, and the
device's busy time. ``exactness`` decodes the same tokens from the same state eagerly (fused) and from the graphs, three
steps, and compares the logits bit for bit (bucket-sized batches
only: a padded bucket runs other GEMM shapes).
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch

from deepinfer.runtime import host_copy

VARIANTS = {  # name -> (ops.fused, ops.cuda_graphs, weight set): the A/B of the fused kernels and the graphs
    "eager_unfused": (False, False, None),
    "eager_fused": (True, False, None),
    "graphs": (True, True, None),
}
# the A/B of the weights kept as stored (``--ab-weights``; bench/engine/weight_sets.py): bf16 weights with the graphs
# (the
# default before), the stored formats eager, the stored formats with the graphs (the default now)
WEIGHT_VARIANTS = {
    "bf16_graphs": (True, True, "bf16"),
    "native_eager": (True, False, "native"),
    "native_graphs": (True, True, "native"),
}
# the A/B of the pooled decode state (``--ab-pool``; models/deepseek_v4/state_pool.py), both with the graphs
POOL_VARIANTS = {
    "graphs_per_sequence": (True, True, None),
    "graphs_pooled": (True, True, None),
}
# the A/B of the host-to-device copies (``--ab-h2d``; deepinfer/runtime/host_copy.py): the step's metadata copied
# synchronously (the host waits for the queued GPU work, as ForwardBatch.build did) against asynchronously from pinned
# memory, both with pooled state and graphs
H2D_VARIANTS = {
    "blocking_copies": (True, True, None),
    "async_copies": (True, True, None),
}
# the A/B of the MXFP4 experts' nibble order (``--ab-order``; quant/nibble_order.py, bench/engine/weight_sets.py
# OrderSets):
# the byte-lookup decode of the codes as stored against the shift and the rotate decodes, with pooled state and graphs
ORDER_VARIANTS = {
    "plain_order": (True, True, None),
    "shift_order": (True, True, None),
    "rotate_order": (True, True, None),
}
_TAGS = ("LaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize", "_local_scalar_dense")


def variants_of(ours: Any) -> dict[str, tuple[bool, bool, str | None]]:
    """The variants ``ours`` compares: ``POOL_VARIANTS`` with ``--ab-pool``, ``WEIGHT_VARIANTS`` when it carries
    ``weight_sets``, else ``VARIANTS``."""
    if getattr(ours.args, "ab_h2d", False):
        return H2D_VARIANTS
    if getattr(ours, "order_sets", None) is not None:
        return ORDER_VARIANTS
    if getattr(ours.args, "ab_pool", False):
        return POOL_VARIANTS
    return WEIGHT_VARIANTS if getattr(ours, "weight_sets", None) is not None else VARIANTS


def set_variant(ours: Any, name: str) -> None:
    """Switch ``ours``' op flags (and weight set) to variant ``name``."""
    ops = ours.model.ops
    ops.fused, ops.cuda_graphs, weights = variants_of(ours)[name]
    if weights is not None:
        ours.weight_sets.use(weights)
    if hasattr(ours.model, "pooled_decode"):
        ours.model.pooled_decode = name != "graphs_per_sequence"
    host_copy.BLOCKING = name == "blocking_copies"
    if name in ORDER_VARIANTS:
        ours.order_sets.use(name.removesuffix("_order"))


def launch_profile(step, dev: torch.device) -> dict[str, Any]:
    """Host-side launch counts and device busy time of one ``step()`` under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    counts = dict.fromkeys(_TAGS, 0)
    busy = 0.0
    for e in prof.key_averages():
        for tag in _TAGS:
            if tag in e.key:
                counts[tag] += e.count
        busy += getattr(e, "self_device_time_total", 0.0)
    return {"counts": counts, "device_busy_ms": round(busy / 1e3, 3)}


def ab_decode(ours: Any, b: int, timed, budget: Any) -> dict[str, Any]:
    """The three variants at batch ``b`` (module docstring) and the exactness check. ``ours`` is sweep's ``Ours``
    (its templates prefilled, one lane of pages per variant), ``timed`` sweep's timer of one call. The timed steps
    are interleaved (variant by variant within each round), so that drifts of the machine fall on all three alike."""
    ops, dev, args = ours.model.ops, ours.dev, ours.args
    out: dict[str, Any] = {"batch": b, "rounds": 0}
    prev = (getattr(ops, "fused", False), getattr(ops, "cuda_graphs", False))
    sets = getattr(ours, "weight_sets", None)
    prev_set = sets.current if sets is not None else None
    variants = variants_of(ours)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        steps = {name: ours.make_step(b, args.warmup + args.repeats + 1, lane=i) for i, name in enumerate(variants)}
        for name, step in steps.items():
            set_variant(ours, name)
            for _ in range(args.warmup):
                step()
        gc.collect()
        for _ in range(args.repeats):
            if budget.left() <= 0:
                break
            for name, step in steps.items():
                set_variant(ours, name)
                times[name].append(timed(step, dev))
            out["rounds"] += 1
        for name, step in steps.items():
            set_variant(ours, name)
            ts = sorted(times[name]) or [float("nan")]
            out[name] = {"ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * ts[0], **launch_profile(step, dev)}
        steps.clear()
        out["exactness"] = exactness(ours, b)
        if sets is not None:
            out["weights_vs_bf16"] = weights_vs_bf16(ours, b)
        if getattr(ours, "order_sets", None) is not None:
            out["orders_bit_identical"] = orders_bit_identical(ours, b)
    finally:
        ops.fused, ops.cuda_graphs = prev
        if sets is not None:
            sets.use(prev_set)
        if hasattr(ours.model, "pooled_decode"):
            ours.model.pooled_decode = True
        host_copy.BLOCKING = False
        if getattr(ours, "order_sets", None) is not None:
            ours.order_sets.use("rotate")  # what NvidiaOps.prepare_weights makes
    return out


def exactness(ours: Any, b: int, steps: int = 3) -> dict[str, Any]:
    """Logits of ``steps`` decode steps eagerly and from the graphs, from the same state with the same tokens."""
    from deepinfer.models.deepseek_v4.graphs import BUCKETS

    ops = ours.model.ops
    if b not in BUCKETS:
        return {"note": f"batch {b} is not a bucket size: a padded bucket runs other shapes"}
    logits = {}
    tokens = [ours._ids(b) for _ in range(steps)]
    for graphs in (False, True):
        ops.fused, ops.cuda_graphs = True, graphs
        step = ours.make_step(b, steps, tokens=tokens)
        logits[graphs] = torch.stack([step() for _ in range(steps)])
    diff = (logits[True] - logits[False]).abs().max().item()
    return {"steps": steps, "bit_identical": bool(torch.equal(logits[True], logits[False])), "max_abs_diff": diff}


def weights_vs_bf16(ours: Any, b: int, steps: int = 3) -> dict[str, Any]:
    """Logits of ``steps`` graphed decode steps on the stored formats against the bf16 weights they decode to (same
    values: only the kernels' summation order differs), from the same state with the same tokens."""
    ops, sets = ours.model.ops, ours.weight_sets
    tokens = [ours._ids(b) for _ in range(steps)]
    logits = {}
    for name in ("bf16", "native"):
        sets.use(name)
        ops.fused, ops.cuda_graphs = True, True
        step = ours.make_step(b, steps, tokens=tokens)
        logits[name] = torch.stack([step() for _ in range(steps)])
    a, n = logits["bf16"], logits["native"]
    return {
        "steps": steps,
        "max_abs_diff": (a - n).abs().max().item(),
        "max_abs_logit": a.abs().max().item(),
        "argmax_agreement": (a.argmax(-1) == n.argmax(-1)).float().mean().item(),
    }


def orders_bit_identical(ours: Any, b: int, steps: int = 3) -> bool:
    """Whether ``steps`` graphed decode steps give the same logits, bit for bit, on every order of the experts' codes
    (the decodes give the same bf16 tiles), from the same state with the same tokens."""
    ops, tokens = ours.model.ops, [ours._ids(b) for _ in range(steps)]
    logits = []
    for order in ours.order_sets.ORDERS:
        ours.order_sets.use(order)
        ops.fused, ops.cuda_graphs = True, True
        step = ours.make_step(b, steps, tokens=tokens)
        logits.append(torch.stack([step() for _ in range(steps)]))
    return all(torch.equal(logits[0], other) for other in logits[1:])


def markdown(rows: list[dict[str, Any]]) -> str:
    """The before/after table."""
    head = ("| batch | variant | ms/step | host kernel launches | graph launches | H2D copies | device busy ms |\n"
            "|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [head]
    for r in rows:
        for name in [*VARIANTS, *WEIGHT_VARIANTS, *POOL_VARIANTS, *H2D_VARIANTS, *ORDER_VARIANTS]:
            v = r.get(name)
            if not isinstance(v, dict):
                continue
            c = v.get("counts", {})
            lines.append(
                f"| {r['batch']} | {name} | {v['ms']:.2f} | {c.get('LaunchKernel', 0)} | {c.get('cudaGraphLaunch', 0)} "
                f"| {c.get('cudaMemcpyAsync', 0)} | {v.get('device_busy_ms', 0):.2f} |"
            )
    ex = [f"batch {r['batch']}: {r['exactness']}" for r in rows if "exactness" in r]
    out = "\n".join(lines) + ("\n\nGraphs against eager (fused):\n" + "\n".join(f"- {e}" for e in ex) if ex else "")
    wv = [f"batch {r['batch']}: {r['weights_vs_bf16']}" for r in rows if "weights_vs_bf16" in r]
    return out + ("\n\nStored formats against bf16 weights:\n" + "\n".join(f"- {e}" for e in wv) if wv else "")


__all__ = [
    "H2D_VARIANTS",
    "VARIANTS",
    "WEIGHT_VARIANTS",
    "ab_decode",
    "exactness",
    "launch_profile",
    "markdown",
    "set_variant",
    "variants_of",
    "weights_vs_bf16",
]
