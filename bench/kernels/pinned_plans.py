"""Pinned plans for batch-invariant mode that are fast at one row and at many: each candidate timed at 1 and 64 rows.

In batch-invariant mode (``kernels.pinning``) every kernel plans its launch as for a fixed number of rows whatever
the call has, so a row's sums run in one order in any batch. The plan made for 64 rows is as fast as the default at
64 rows and slow at one (one token's FP8 GEMMs on 64-row tiles, its MoE unsplit over 6 slot blocks). Three kernel
families take another pinned plan where one is better at both; this script times their candidates:

- ``fp8``: the FP8 dense linears (``kernels.fp8_gemm``, V4-Flash's shapes, bf16 activations): tiles planned as for
  ``fp8_gemm_config.PINNED_ROWS`` rows, each of ``--gemm-rows`` (for every shape: no ``PINNED_ROWS_BY_SHAPE``);
- ``small``: the fp32 small GEMMs (``kernels.small_gemm``: the router, the compressors' projections, the mHC mixes):
  ``small_gemm.PINNED_ROWS`` ∈ ``--small-rows``;
- ``moe``: the MXFP4 routed experts (``kernels.moe_mxfp4``, top-6 of 256, the rotate nibble order the model runs):
  ``moe_mxfp4.PINNED_SPLIT`` ∈ ``--moe-splits`` K pieces;
- ``head``: the output head (``kernels.invariant.matmul_fixed``, 129280 x 4096 bf16 weights, fp32 logits), whose
  one plan serves every row count: ``invariant.MATMUL_PLAN`` ∈ ``--head-plans`` (block M x N x K x warps x stages).

At each row count of ``--rows``, per candidate: µs per call (a CUDA graph of ``--calls`` calls cycling through
weight copies / routings, so the weights come from HBM; best of ``--reps`` replays), whether it is batch-invariant on
this device (row 0 of the widest call bit-identical to the one-row call, and to a middle-sized one), and the same for
the constants as shipped (``shipped``: per shape where the code says so), beside the peer
(the default, unpinned op at that row count: what the default op set runs) and the roofline (the bytes of weights
the call reads over the copy bandwidth measured in the same run). Per family the sum over its shapes, and a pick:
the fastest candidate at one row among those within ``--slack`` of the best at the widest. The shipped constants
weigh each family's cost against the whole step's (a batch of 64 spends most of its step in the experts, so a
dense-GEMM plan may cost more there than the slack allows and still pay at one row); docs/determinism.md.

    PYTHONPATH=libs:. python bench/kernels/pinned_plans.py --out bench/results/kernels
    PYTHONPATH=libs:. python bench/kernels/pinned_plans.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode runs every family at tiny shapes (rows 1 and 8) with the kernels in Triton's interpreter, eager
calls on the host's clock; CUDA graphs need a GPU.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.harness import (
    V4_FLASH_FP8_SHAPES,
    add_common_args,
    copy_gbps,
    cycled_graph_us,
    interpret_if_cpu,
    mxfp4_experts,
    note_skipped,
    pick_device,
    result_header,
    write_result,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

import deepinfer.kernels.fp8_gemm_config as fc  # noqa: E402
from deepinfer.kernels import invariant as inv  # noqa: E402
from deepinfer.kernels import moe_mxfp4 as mx  # noqa: E402
from deepinfer.kernels import pinning, small_gemm  # noqa: E402
from deepinfer.kernels.fp8_gemm import fp8_grouped_linear, fp8_linear  # noqa: E402
from deepinfer.quant.nibble_order import to_order  # noqa: E402

SMALL_SHAPES = {"router": (256, 4096), "compressor": (1024, 4096), "idx_compressor": (256, 4096),
                "hc_mixes": (24, 16384)}  # fmt: skip
MOE_SHAPE = (256, 4096, 2048, 6)  # E, D, I, top-k
HEAD_SHAPES = {"head": (129280, 4096)}
TINY = {"fp8": {"tiny": (64, 256)}, "small": {"tiny": (32, 512)}, "moe": (8, 64, 64, 2), "head": {"tiny": (96, 256)}}
HEAD_PLANS = ["64x64x32x4x3", "64x64x64x4x4", "64x128x64x4x4", "64x64x128x4x4", "64x128x128x8x3", "64x256x64x8x3"]
DEFAULTS = {"rows": "1,64", "gemm_rows": "8,16,32,64", "small_rows": "16,32,64", "moe_splits": "1,2,3,4,6",
            "head_plans": ",".join(HEAD_PLANS), "calls": 20, "reps": 5}  # fmt: skip
DEFAULTS_TINY = {"rows": "1,8", "gemm_rows": "8,16", "small_rows": "8,16", "moe_splits": "1,2",
                 "head_plans": "64x64x32x4x3,64x64x64x4x4", "calls": 1, "reps": 1}  # fmt: skip
KNOBS = {"fp8": (fc, "PINNED_ROWS"), "small": (small_gemm, "PINNED_ROWS"), "moe": (mx, "PINNED_SPLIT"),
         "head": (inv, "MATMUL_PLAN")}  # fmt: skip


def with_knob(family: str, value, fn):
    """``fn`` run pinned with the family's knob at ``value`` (for ``fp8`` with no per-shape entry either), pinned as
    shipped (``"shipped"``: the constants as the code has them), or unpinned (``None``: the peer)."""
    mod, name = KNOBS[family]
    knobs = {name: value, **({"PINNED_ROWS_BY_SHAPE": {}} if family == "fp8" else {})}

    def run(*a):
        if value is None:
            return fn(*a)
        old = {k: getattr(mod, k) for k in knobs} if value != "shipped" else {}
        for k in old:
            setattr(mod, k, knobs[k])
        try:
            with pinning.pinned():
                return fn(*a)
        finally:
            for k, v in old.items():
                setattr(mod, k, v)

    return run


def label(value) -> str:
    """A candidate as the tables and the result name it (a head plan ``64x64x32x4x3``)."""
    return "default" if value is None else "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def invariant(fn, rows: list[int]) -> bool:
    """Row 0 of the widest call bit-identical to the one-row call's and to a middle-sized call's."""
    widest = fn(max(rows))
    return all(torch.equal(fn(r)[0], widest[0]) for r in sorted({1, max(1, max(rows) // 2 + 1)}))


def fp8_cases(dev, shapes, rows, cycle_bytes):
    """Per shape ``(name, copies, call(copy, rows), weight bytes)``: FP8 weights with power-of-two block scales."""
    out = []
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # (the interpreter's bf16 math is wrong)
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(cycle_bytes / (n * k)))
        ws = [(torch.randn(n, k, device=dev) * k**-0.5).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
        s = torch.exp2(torch.randint(-4, 0, (-(-n // 128), -(-k // 128)), device=dev).float())
        x = torch.randn(max(rows), k, device=dev, dtype=dt)
        out.append((name, copies, lambda i, r, ws=ws, s=s, x=x: fp8_linear(x[:r], ws[i], s), n * k))
    if "wo_b" in shapes:  # V4's wo_a: 8 groups of 1024 weight rows, each meeting its own 4096 columns
        copies = max(2, math.ceil(cycle_bytes / (8192 * 4096)))
        wq = [(torch.randn(8192, 4096, device=dev) * 0.02).to(torch.float8_e4m3fn) for _ in range(copies)]
        s = torch.exp2(torch.randint(-4, 0, (64, 32), device=dev).float())
        x = torch.randn(max(rows), 8, 4096, device=dev, dtype=dt)
        out.append(("wo_a_grouped", copies, lambda i, r: fp8_grouped_linear(x[:r], wq[i], s), 8192 * 4096))
    return out


def small_cases(dev, shapes, rows, cycle_bytes):
    out = []
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(cycle_bytes / (2 * n * k)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        x = torch.randn(max(rows), k, device=dev, dtype=torch.bfloat16)
        out.append((name, copies, lambda i, r, ws=ws, x=x: small_gemm.small_mm_fp32(x[:r], ws[i]), 2 * n * k))
    return out


def head_cases(dev, shapes, rows, cycle_bytes):
    """The head's bf16 product with fp32 logits: pinned on ``matmul_fixed``, unpinned (the peer) cuBLAS's."""
    out = []
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(cycle_bytes / (2 * n * k)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
        x = torch.randn(max(rows), k, device=dev, dtype=dt)

        def call(i, r, ws=ws, x=x):
            if pinning.is_pinned():
                return inv.matmul_fixed(x[:r], ws[i], torch.float32)
            return torch.nn.functional.linear(x[:r], ws[i]).float()

        out.append((name, copies, call, 2 * n * k))
    return out


def moe_cases(dev, shape, rows, copies):
    """One case: the experts in the rotate order, ``copies`` routings (top-k of E, uniform) of ``max(rows)`` tokens;
    bytes: of one expert (``moe_bytes`` counts the distinct experts of each row count)."""
    e, d, inter, k = shape
    g = torch.Generator(device=dev).manual_seed(0)
    w1, s1, w2, s2, w3, s3 = mxfp4_experts(e, inter, d, g, dev)
    for w in (w1, w2, w3):
        to_order(w, "rotate")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(max(rows), d, device=dev, dtype=dt)
    idx = [torch.rand(max(rows), e, device=dev).topk(k, dim=1).indices.int() for _ in range(copies)]
    wt = torch.rand(max(rows), k, device=dev).softmax(-1)
    per_expert = 3 * inter * d // 2 + 3 * inter * d // 32  # codes + exponents of gate, up and down

    def call(i, r):
        return mx.moe_mxfp4(x[:r], idx[i][:r], wt[:r], w1, s1, w2, s2, w3, s3, 10.0, order="rotate")

    return [("experts", copies, call, per_expert, idx)]


def moe_bytes(case, r: int) -> int:
    """Bytes of the distinct experts ``r`` tokens of the first routing touch."""
    return case[4][0][:r].unique().numel() * case[3]


def measure(family, cases, values, rows, a, dev, gbps):
    """Rows of the result: per case, row count and candidate (``None``: the peer), µs and invariance."""
    out = []
    for case in cases:
        name, copies, call = case[:3]
        for value in [None, "shipped", *values]:
            run = with_knob(family, value, call)
            inv = invariant(lambda r, run=run: run(0, r), rows)
            for r in rows:
                us = cycled_graph_us(lambda i, r=r, run=run: run(i, r), copies, a.calls, a.reps, dev)
                nbytes = moe_bytes(case, r) if family == "moe" else case[3]
                out.append(dict(family=family, case=name, rows=r, candidate=label(value),
                                us=us, invariant=inv, roofline_us=nbytes / (gbps * 1e3)))  # fmt: skip
            print(f"{family} {name} {label(value)}: "
                  + ", ".join(f"{o['rows']} rows {o['us']:.1f} µs" for o in out[-len(rows):])
                  + f", invariant {inv}", flush=True)  # fmt: skip
    return out


def pick(rows_out, values, rows, slack):
    """Per candidate the family's total µs at each row count; the pick (module docstring)."""
    tot = {v: {r: sum(o["us"] for o in rows_out if o["candidate"] == v and o["rows"] == r) for r in rows}
           for v in ["default", "shipped", *map(label, values)]}  # fmt: skip
    values = [label(v) for v in values]
    ok = [v for v in values if all(o["invariant"] for o in rows_out if o["candidate"] == v)]
    wide = max(rows)
    best_wide = min((tot[v][wide] for v in ok), default=math.inf)
    near = [v for v in ok if tot[v][wide] <= best_wide * (1 + slack)]
    return tot, (min(near, key=lambda v: tot[v][min(rows)]) if near else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="row counts to time (tokens; 1,64, --tiny 1,8)")
    ap.add_argument("--gemm-rows", default=None, help="fp8_gemm_config.PINNED_ROWS candidates (8,16,32,64)")
    ap.add_argument("--small-rows", default=None, help="small_gemm.PINNED_ROWS candidates (16,32,64)")
    ap.add_argument("--moe-splits", default=None, help="moe_mxfp4.PINNED_SPLIT candidates (1,2,3,4,6)")
    ap.add_argument(
        "--head-plans",
        default=None,
        help="invariant.MATMUL_PLAN candidates (block M x N x K x warps x stages; " + ",".join(HEAD_PLANS) + ")",
    )
    ap.add_argument("--families", default="fp8,small,moe,head")
    ap.add_argument("--calls", type=int, default=None, help="calls per CUDA graph (20; --tiny 1)")
    ap.add_argument("--reps", type=int, default=None, help="replays, the best taken (5; --tiny 1)")
    ap.add_argument("--cycle-mb", type=float, default=200.0, help="weight copies cycled per shape (MB)")
    ap.add_argument("--slack", type=float, default=0.05, help="the pick's allowance at the widest row count")
    add_common_args(ap)
    a = ap.parse_args()
    dev = pick_device(a)
    for k, v in (DEFAULTS_TINY if a.tiny else DEFAULTS).items():  # what the command line leaves unset
        if getattr(a, k) is None:
            setattr(a, k, v)
    if dev.type != "cuda":  # the interpreter's products are fp32 (its bf16 math is wrong): the head's fp32 plan
        KNOBS["head"] = (inv, "MATMUL_PLAN_FP32")
        note_skipped({"CUDA graphs, HBM-sized weight cycles": "need a GPU (eager calls in the interpreter here)"})
    rows = [int(r) for r in a.rows.split(",")]
    cands = {"fp8": a.gemm_rows, "small": a.small_rows, "moe": a.moe_splits, "head": a.head_plans}
    gbps = copy_gbps(dev, 1 << 28 if dev.type == "cuda" else 1 << 20)
    results, picks, table = [], {}, []
    for fam in a.families.split(","):
        values = [tuple(int(p) for p in v.split("x")) if fam == "head" else int(v) for v in cands[fam].split(",")]
        if fam == "moe":
            cases = moe_cases(dev, TINY["moe"] if a.tiny else MOE_SHAPE, rows, 2 if a.tiny else a.calls)
        else:
            shapes = (
                TINY[fam] if a.tiny else {"fp8": V4_FLASH_FP8_SHAPES, "small": SMALL_SHAPES, "head": HEAD_SHAPES}[fam]
            )
            make = {"fp8": fp8_cases, "small": small_cases, "head": head_cases}[fam]
            cases = make(dev, shapes, rows, a.cycle_mb * 1e6)
        out = measure(fam, cases, values, rows, a, dev, gbps)
        tot, best = pick(out, values, rows, a.slack)
        results += out
        picks[fam] = {"pick": best, "totals_us": {str(v): {str(r): t for r, t in d.items()} for v, d in tot.items()}}
        roof = {r: sum(o["roofline_us"] for o in out if o["candidate"] == "default" and o["rows"] == r) for r in rows}
        table += [f"**{fam}** ({KNOBS[fam][0].__name__.split('.')[-1]}.{KNOBS[fam][1]}), µs summed over "
                  f"{len(cases)} case(s); pick: {best}", "",
                  "| candidate | " + " | ".join(f"{r} rows µs" for r in rows) + " | invariant |",
                  "|---|" + "---:|" * len(rows) + "---|"]  # fmt: skip
        for v, d in tot.items():
            same = all(o["invariant"] for o in out if o["candidate"] == v)
            table.append(f"| {v}{' (peer)' if v == 'default' else ''} | " + " | ".join(f"{d[r]:.1f}" for r in rows)
                         + f" | {'yes' if same else 'no'} |")  # fmt: skip
        table += ["| roofline | " + " | ".join(f"{roof[r]:.1f}" for r in rows) + " | |", ""]
    res = {**result_header(dev, a), "copy_GBps": gbps, "picks": picks, "rows": results}
    head = [f"# Pinned plans at {', '.join(map(str, rows))} rows ({res['gpu']}; copy {gbps:.0f} GB/s)", ""]
    write_result(a.out, f"{res['date']}-pinned-plans-{'gpu' if dev.type == 'cuda' else 'cpu'}", res, head + table)


if __name__ == "__main__":
    main()
