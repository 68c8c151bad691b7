"""FP8 block-scaled dense GEMM micro-benchmark (deepinfer.kernels.fp8_gemm) on one GPU.

For DeepSeek-V4-Flash's dense FP8 linears and M ∈ {1, 16, 64, 256, 1024, 4096} it times

* ``fp8_linear(x, w, scale)`` (W8A16: gemv / Triton tensor cores / dequantise + cuBLAS from ``DEQUANT_MIN_M``
  rows) and ``fp8_linear(..., act_quant=True)`` (W8A8 from ``W8A8_MIN_M`` rows), with the config each one picked,
* the peer: bf16 ``F.linear`` with the dequantised weight (cuBLAS),
* ``torch._scaled_mm`` with per-tensor scales (cuBLAS FP8, no block scales: a ceiling reference), where it runs,
* ``torch._scaled_mm`` with DeepSeek's block scales (1×128 activations, 128×128 weight; torch ≥ 2.9 on SM90) as the
  library calls it (``deepinfer.kernels.fp8_scaled_mm.block_scaled_mm``), with the activation quantisation
  (``scaled_mm_block``) and without it (``scaled_mm_block_gemm``), where it runs,

each as a CUDA graph of ``--calls`` back-to-back calls (no launch gaps) cycling through enough copies of the weight
(> ``--cycle-mb`` MB) that none is L2-resident, so small M measures HBM traffic. Columns: µs per call, effective
weight GB/s (weight bytes / time), TFLOP/s, and the roofline µs = max(weight bytes / HBM, 2·M·N·K / peak), with the
peak 1979 TFLOP/s (FP8 dense) for ``act_quant`` and ``_scaled_mm``, 989 (bf16) otherwise, and HBM 4.8 TB/s.

    PYTHONPATH=libs:. python bench/kernels/gemm_fp8.py --out /tmp/gemm_fp8          # ~1 min on an H200
    PYTHONPATH=libs:. python bench/kernels/gemm_fp8.py --tune --shapes wkv,wq_a --ms 1,16

``--tune`` sweeps tile configs of both paths instead and prints the best per (shape, M): the data behind
``pick_config``'s heuristic.

    PYTHONPATH=libs:. python bench/kernels/gemm_fp8.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode times ``fp8_linear`` (both paths) and the bf16 peer at one tiny shape (N 64, K 256; M 1 and 16,
fp32 activations) with the kernels in Triton's interpreter, eager calls on the host's clock, beside the same
rooflines; CUDA graphs, the ``torch._scaled_mm`` ceilings (cuBLAS FP8), ``--tune`` and ``--grouped`` need a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.harness import (
    V4_FLASH_FP8_SHAPES,
    add_common_args,
    cycled_graph_us,
    interpret_if_cpu,
    note_skipped,
    pick_device,
    rel_diff,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

import deepinfer.kernels.fp8_gemm_config as fc  # noqa: E402
from deepinfer.kernels import fp8_scaled_mm  # noqa: E402
from deepinfer.kernels.fp8_gemm import GemmConfig, fp8_grouped_linear, fp8_linear, pick_config  # noqa: E402
from deepinfer.kernels.fp8_quant import act_quant_fp8  # noqa: E402
from deepinfer.quant.formats import dequantize_fp8_blocks  # noqa: E402

SHAPES = dict(V4_FLASH_FP8_SHAPES)  # (the smoke mode adds its tiny shape)
TINY_SHAPES = {"tiny": (64, 256)}  # the smoke mode's (N, K): a 128-wide block of K twice
DEV = "cuda"  # main sets it: cpu in the smoke mode (the kernels in Triton's interpreter)
HBM_BPS = 4.8e12
PEAK_FP8 = 1979e12
PEAK_BF16 = 989e12


def make_weights(n, k, copies, block=(128, 128)):
    ws, ss = [], []
    for _ in range(copies):
        w = torch.randn(n, k, device=DEV) * k**-0.5
        nb0, nb1 = -(-n // block[0]), -(-k // block[1])
        s = torch.exp2(torch.randint(-10, -6, (nb0, nb1), device=DEV).float())
        se = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
        ws.append((w / se).clamp(-448, 448).to(torch.float8_e4m3fn))
        ss.append(s)
    return ws, ss


def time_graph(fn, copies, calls, reps):
    """µs per call (``harness.cycled_graph_us`` on ``DEV``: a CUDA graph of calls cycling weight copies)."""
    return cycled_graph_us(fn, copies, calls, reps, DEV)


def bench_shape(name, n, k, ms, args, rows):
    wbytes = n * k
    copies = max(2, math.ceil(args.cycle_mb * 1e6 / wbytes))
    ws, ss = make_weights(n, k, copies)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32  # the interpreter's bf16 math is wrong
    wd = [dequantize_fp8_blocks(w, s, dt) for w, s in zip(ws, ss)]
    ones = torch.ones((), device=DEV)
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=dt)
        flops = 2 * m * n * k
        impls = {
            "fp8_linear": (lambda i, x=x: fp8_linear(x, ws[i], ss[i]), PEAK_BF16),
            "fp8_linear_aq": (lambda i, x=x: fp8_linear(x, ws[i], ss[i], act_quant=True), PEAK_FP8),
            "bf16_F.linear": (lambda i, x=x: F.linear(x, wd[i]), PEAK_BF16),
        }
        if hasattr(torch, "_scaled_mm") and DEV == "cuda":
            x8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
            impls["_scaled_mm"] = (
                lambda i, x8=x8: torch._scaled_mm(x8, ws[i].t(), scale_a=ones, scale_b=ones, out_dtype=torch.bfloat16),
                PEAK_FP8,
            )
        block = scaled_mm_block(x, n) if DEV == "cuda" else None
        if block is not None:
            xq, sa = block
            impls["scaled_mm_block"] = (
                lambda i, x=x: fp8_scaled_mm.block_scaled_mm(*act_quant_fp8(x), ws[i], ss[i], torch.bfloat16),
                PEAK_FP8,
            )
            impls["scaled_mm_block_gemm"] = (
                lambda i, xq=xq, sa=sa: fp8_scaled_mm.block_scaled_mm(xq, sa, ws[i], ss[i], torch.bfloat16),
                PEAK_FP8,
            )
        ref = F.linear(x, wd[0])
        for impl, (fn, peak) in impls.items():
            bytes_ = wbytes * (2 if impl == "bf16_F.linear" else 1)
            roof = max(bytes_ / HBM_BPS, flops / peak) * 1e6
            try:
                err = rel_diff(fn(0), ref) if impl in ("fp8_linear", "scaled_mm_block") else None
                us = time_graph(fn, copies, args.calls, args.reps)
            except Exception as e:  # e.g. _scaled_mm's shape limits
                print(f"  {name} M={m} {impl}: {type(e).__name__}: {str(e)[:100]}")
                continue
            cfg = pick_config(m, n, k, (128, 128), impl == "fp8_linear_aq") if impl.startswith("fp8") else None
            rows.append(
                dict(shape=name, N=n, K=k, M=m, impl=impl, us=us, weight_GBps=bytes_ / us / 1e3,
                     TFLOPs=flops / us / 1e6, roofline_us=roof, of_roofline=roof / us, rel_err=err,
                     config=None if cfg is None else short(cfg))
            )  # fmt: skip


def scaled_mm_block(x, n):
    """(quantised x, its scales) where ``torch._scaled_mm`` takes DeepSeek's block scales for ``x`` times an
    ``n``-row weight (``deepinfer.kernels.fp8_scaled_mm``: the scales' layout probed once per device), else None."""
    if x.shape[1] % 128 or n % 128 or not fp8_scaled_mm.available(x.device):
        print("  _scaled_mm with block scales: not on this build / GPU / shape")
        return None
    return act_quant_fp8(x)


def candidates(m, gemv_only=False):
    """W8A16 / gemv configs worth timing for ``m`` rows (the tensor-core tiles as in ``pick_config``'s range; the
    gemv's up to ``GEMV_MAX_M`` rows, its rows x tile at most 128 fp32 accumulators a thread)."""
    out = []
    if m <= fc.GEMV_MAX_M:
        bm = 1 << max(m - 1, 0).bit_length()
        for bn, bk, nw, sk in itertools.product([16, 32], [128, 256, 512, 1024], [4, 8], [1, 2, 4, 8, 16]):
            if bm * bn * bk <= 128 * 32 * nw and (bm > 1 or bk >= 256):
                out.append(GemmConfig(bm, bn, bk, split_k=sk, num_warps=nw, num_stages=1, path="gemv"))
    if gemv_only:
        return out
    top = min(128, max(16, 1 << max(m - 1, 0).bit_length()))
    splits = [1, 2, 4, 8, 16] if m <= 64 else [1, 2, 4] if m <= 256 else [1]
    for bm, bn, sk, nw, st, sc in itertools.product(
        sorted({top, max(16, top // 2)}), [32, 64, 128, 256], splits, [4, 8], [3, 4, 5], [False, True]
    ):
        if bm * bn <= 128 * 128 and (nw == 4 or bm * bn >= 64 * 128):
            out.append(GemmConfig(bm, bn, 128, split_k=sk, num_warps=nw, num_stages=st, scale_x=sc))
    return out


W8A8_CANDIDATES = [
    GemmConfig(bm, bn, 128, num_warps=nw, num_stages=st, group_m=8, path="w8a8")
    for bm, bn, nw, st in itertools.product([64, 128, 256], [64, 128, 256], [4, 8], [3, 4, 5])
    if bm * bn <= 256 * 128 and (nw == 8 or bm * bn <= 128 * 128)
]


def swap_candidates(m):
    """W8A8 with the weight on the MMA's wide side (``swap_ab``), for 16 <= m < W8A8_MIN_M."""
    top = min(128, max(16, 1 << max(m - 1, 0).bit_length()))
    return [
        GemmConfig(top, bn, 128, split_k=sk, num_warps=nw, num_stages=st, path="w8a8", swap_ab=True)
        for bn, sk, nw, st in itertools.product([64, 128], [1, 2, 4, 8], [4, 8], [3, 5])
        if nw == 4 or bn * top >= 128 * 64
    ]


def bench_grouped(args):
    """V4-Flash's ``wo_a`` (8 groups of 1024 rows, K = 4096 each): ``fp8_grouped_linear`` against the bf16 einsum on
    the dequantised weight (what the model ran before it kept ``wo_a`` in FP8)."""
    g, r, k = 8, 1024, 4096
    copies = max(2, math.ceil(args.cycle_mb * 1e6 / (g * r * k)))
    ws, ss = make_weights(g * r, k, copies)
    wd = [dequantize_fp8_blocks(w, s, torch.bfloat16).view(g, r, k) for w, s in zip(ws, ss)]
    rows = []
    for m in args.ms:
        x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
        ours = time_graph(lambda i, x=x: fp8_grouped_linear(x, ws[i], ss[i]), copies, args.calls, args.reps)
        peer = time_graph(lambda i, x=x: torch.einsum("tgk,grk->tgr", x, wd[i]), copies, args.calls, args.reps)
        err = rel_diff(fp8_grouped_linear(x, ws[0], ss[0]), torch.einsum("tgk,grk->tgr", x.float(), wd[0].float()))
        roof = g * r * k / HBM_BPS * 1e6
        print(f"wo_a grouped M={m}: fp8 {ours:.2f} us, bf16 einsum {peer:.2f} us, FP8 roofline {roof:.2f} us, "
              f"rel err {err:.1e}", flush=True)  # fmt: skip
        rows.append(dict(M=m, fp8_us=ours, bf16_einsum_us=peer, roofline_us=roof, rel_err=err))
    return rows


def short(c):
    if c is None:
        return "default"
    pre = (" scale_x" if c.scale_x else "") + ("" if c.fuse_quant else " pre") + (" swap" if c.swap_ab else "")
    return f"{c.path} {c.block_m}x{c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}{pre}"


def tune_shape(name, args, results):
    n, k = SHAPES[name]
    copies = max(2, math.ceil(args.cycle_mb * 1e6 / (n * k)))
    ws, ss = make_weights(n, k, copies)
    for m in args.ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for aq in {"both": (False, True), "off": (False,), "on": (True,)}[args.aq]:

            def timed(cands, aq=aq, x=x):
                res = []
                for c in cands:
                    try:
                        fn = lambda i, c=c: fp8_linear(x, ws[i], ss[i], aq, config=c)  # noqa: E731
                        res.append((time_graph(fn, copies, 10, 3), c))
                    except Exception as e:  # out of shared memory / registers
                        print(f"  {short(c)} failed: {type(e).__name__}: {str(e)[:100]}")
                return sorted(res, key=lambda t: t[0])

            default = timed([None])
            if args.gemv_only:  # the tensor-core tiles pick_config gives without the gemv's rows
                old, fc.GEMV_MAX_M = fc.GEMV_MAX_M, 1
                base = pick_config(m, n, k, (128, 128), aq)
                fc.GEMV_MAX_M = old
                default += timed([base])
            if args.swap_only:  # the W8A16 tiles pick_config gives without the swap path
                old, fc.SWAP_W8A8_MIN_M = fc.SWAP_W8A8_MIN_M, 1 << 30
                base = pick_config(m, n, k, (128, 128), aq)
                fc.SWAP_W8A8_MIN_M = old
                default += timed([base])
            swaps = swap_candidates(m) if aq and 16 <= m < 256 else []
            best = timed(
                swaps if args.swap_only else candidates(m, True) if args.gemv_only
                else candidates(m) + swaps + (W8A8_CANDIDATES if aq and m >= 128 else [])
            )  # fmt: skip
            if aq and not (args.swap_only or args.gemv_only):  # the best fused tiles again with an act-quant pre-pass
                pre = timed([replace(c, fuse_quant=False) for _, c in best[:4] if c.path != "w8a8"])
                best = sorted(best + pre, key=lambda t: t[0])
            top = [(round(us, 2), short(c)) for us, c in best[:4]]
            d = default[0][0] if default else math.nan
            dflt = short(pick_config(m, n, k, (128, 128), aq))
            other = "without gemv" if args.gemv_only else "without swap"
            was = f", {other} {default[1][0]:.2f} us ({short(default[1][1])})" if len(default) > 1 else ""
            print(f"{name} N={n} K={k} M={m} aq={aq}: default {d:.2f} us ({dflt}){was}, best {top}", flush=True)
            results.append(dict(shape=name, M=m, act_quant=aq, default_us=d, top=top, baseline=was))


def tune(args):
    results = []
    for name in args.shapes:
        tune_shape(name, args, results)
        torch.cuda.empty_cache()
    return results


def markdown(rows):
    out = [
        "| shape (N×K) | M | impl | µs | weight GB/s | TFLOP/s | roofline µs | of roofline | config |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['shape']} ({r['N']}×{r['K']}) | {r['M']} | {r['impl']} | {r['us']:.1f} | {r['weight_GBps']:.0f} | "
            f"{r['TFLOPs']:.1f} | {r['roofline_us']:.1f} | {100 * r['of_roofline']:.0f}% | {r['config'] or ''} |"
        )
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    p.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--reps", type=int, default=5, help="graph replays; the best is kept")
    p.add_argument("--cycle-mb", type=float, default=150.0, help="weight copies cycled per shape (MB of FP8)")
    p.add_argument("--tune", action="store_true", help="sweep tile configs instead")
    p.add_argument("--aq", choices=["both", "off", "on"], default="both", help="--tune: act_quant values")
    p.add_argument("--swap-only", action="store_true", help="--tune: only the W8A8 swap_ab tiles (16 <= M < 256)")
    p.add_argument("--gemv-only", action="store_true", help="--tune: only the gemv tiles (M <= GEMV_MAX_M)")
    p.add_argument("--grouped", action="store_true", help="time the grouped wo_a (fp8_grouped_linear) instead")
    add_common_args(p, out_help="directory for gemm_fp8.json and gemm_fp8.md")
    args = p.parse_args()
    global DEV
    dev = pick_device(args)
    DEV = dev.type
    if dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gemm_fp8.py on a GPU needs TRITON_INTERPRET unset")
    if dev.type != "cuda" and (args.tune or args.grouped):
        raise SystemExit("--tune and --grouped need a CUDA GPU")
    if args.tiny:  # one tiny shape, two row counts (the gemv and the tensor-core tiles), one round
        args.shapes, args.ms, args.calls, args.reps, args.cycle_mb = list(TINY_SHAPES), [1, 16], 2, 1, 0
        SHAPES.update(TINY_SHAPES)
    if dev.type != "cuda":
        note_skipped({"CUDA graphs": "eager calls on the host's clock", "_scaled_mm": "cuBLAS FP8 ceilings"})
    torch.manual_seed(0)
    t0 = time.time()
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, Triton's interpreter ({os.cpu_count()} cores)"
    meta = dict(gpu=gpu, torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    if args.grouped or args.tune:  # one JSON file of the variant's rows
        name, key, fn = ("grouped", "rows", bench_grouped) if args.grouped else ("tune", "results", tune)
        res = fn(args)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"gemm_fp8_{name}.json").write_text(json.dumps({"meta": meta, key: res}, indent=1))
        return
    rows = []
    for name in args.shapes:
        bench_shape(name, *SHAPES[name], args.ms, args, rows)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {name} done ({time.time() - t0:.0f} s)", flush=True)
    table = markdown(rows)
    timing = "CUDA graphs" if dev.type == "cuda" else "eager rounds (fp32 activations; bf16_F.linear is fp32 here)"
    print(f"\n{meta['gpu']}, torch {meta['torch']}, {meta['date']}; {timing} of {args.calls} calls\n\n{table}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm_fp8.json").write_text(json.dumps(dict(meta=meta, args=vars(args) | {"out": str(args.out)},
                                                                 rows=rows), indent=1))  # fmt: skip
        (args.out / "gemm_fp8.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
