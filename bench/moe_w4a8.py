"""MXFP4 routed experts on the FP8 tensor cores (W4A8, ``kernels.moe_w4a8``) against the W4A16 kernels, one GPU.

V4-Flash's expert shapes (E=256, D=4096, I=2048, top-6), random MXFP4 experts in the shift order (every byte value,
exponents 118..122: within ``fp8_cast_fits``), routings drawn uniformly at random. For each token count T, ``--calls``
routings are captured in one CUDA graph per implementation and replayed (``bench/moe_mxfp4.py``'s ``time_graph``).

Columns: µs per call of ``moe_mxfp4`` without ``act_quant`` (W4A16 on bf16 activations, the default numerics), with
``act_quant`` on the W4A16 kernels (the official FP8 activations, rounded; ``W4A8`` off), and the W4A8 kernels under
each tile config of ``CONFIGS`` (block_m, block_n, block_k, warps, stages; ``swap``: the weights as the dot's first
operand); the FLOP rate of the best W4A8 config beside the FP8 dense peak (``--fp8-peak``, 1.43 PFLOP/s as the sweep
measured on an H200) and the bf16 peak; the largest relative difference of a W4A8 output from the W4A16 kernels with
``act_quant`` on the same inputs.

Run on one GPU from the repository root::

    PYTHONPATH=libs:tests:bench python bench/moe_w4a8.py --tokens 64,256,1024,4096 --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from moe_mxfp4 import LIMIT, D, E, I, K, experts, routings, shifted, time_graph

import deepinfer.kernels.moe_mxfp4 as mxmod
import deepinfer.kernels.moe_w4a8 as mod
from deepinfer.kernels.moe import MoEConfig
from deepinfer.kernels.moe_mxfp4 import moe_mxfp4
from deepinfer.kernels.moe_w4a8 import moe_w4a8
from deepinfer.quant.nibble_order import fp8_cast_fits

CONFIGS = [  # (block_m, block_n, block_k, warps, stages) of gate/up, swap, down's block_n
    ((16, 64, 128, 4, 3), True, 64),
    ((16, 128, 128, 4, 3), True, 128),
    ((32, 64, 128, 4, 3), True, 64),
    ((64, 64, 128, 4, 3), True, 128),
    ((64, 64, 128, 4, 3), False, 128),
    ((64, 64, 128, 4, 4), False, 64),
    ((128, 64, 128, 8, 3), True, 128),
    ((128, 64, 128, 8, 3), False, 128),
    ((128, 32, 128, 4, 3), False, 64),
    ((128, 64, 128, 4, 3), False, 64),
]


def w4a8(cfg, swap, dn):
    def fn(x, i, w, sx):
        mod.SWAP_AB = swap
        try:
            return moe_w4a8(x, i, w, *sx, LIMIT, config=cfg, down_block_n=dn)
        finally:
            mod.SWAP_AB = None

    return fn


def w4a16(act_quant: bool):
    def fn(x, i, w, sx):
        prev, mxmod.W4A8 = mxmod.W4A8, False
        try:
            return moe_mxfp4(x, i, w, *sx, LIMIT, order="shift", act_quant=act_quant, fp8_exact=True)
        finally:
            mxmod.W4A8 = prev

    return fn


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,256,1024,4096")
    p.add_argument("--calls", type=int, default=4, help="routings (calls) per CUDA graph")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fp8-peak", type=float, default=1.43e15, help="dense FP8 FLOP/s (the sweep's measured ceiling)")
    p.add_argument("--bf16-peak", type=float, default=803e12, help="dense bf16 FLOP/s (the sweep's measured ceiling)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--name", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    sx = shifted(experts(dev))
    assert all(fp8_cast_fits(s) for s in sx[1::2])
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = [(*r, sx) for r in routings(t, args.calls, dev, seed=t)]
        row = {"T": t, "w4a16_us": time_graph(w4a16(False), inputs, args.reps)}
        row["w4a16_act_us"] = time_graph(w4a16(True), inputs, args.reps)
        base = w4a16(True)(*inputs[0])
        for c, swap, dn in CONFIGS:
            cfg, name = MoEConfig(*c), f"w4a8 {c} swap={int(swap)} down_n={dn}"
            if (t <= 256) != (c[0] <= 32):
                continue  # small tiles for small T only
            try:
                row[name] = time_graph(w4a8(cfg, swap, dn), inputs, args.reps)
                row[name + " rel"] = rel(w4a8(cfg, swap, dn)(*inputs[0]), base)
                row[name + " regs/spills"] = dict(mod.STATS)
            except Exception as e:  # noqa: BLE001 - a config that does not compile must not lose the run
                row[name] = None
                row[name + " error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["auto_us"] = time_graph(lambda x, i, w, s: moe_mxfp4(x, i, w, *s, LIMIT, order="shift", act_quant=True,
                                                                 fp8_exact=True), inputs, args.reps)  # fmt: skip
        best = min((v, k) for k, v in row.items() if k.startswith("w4a8") and isinstance(v, float) and "rel" not in k)
        flop = 2 * 3 * t * K * D * I
        row.update(best=best[1], best_us=best[0], tflops=flop / best[0] / 1e6)
        row.update(of_fp8_peak=flop / (best[0] * 1e-6) / args.fp8_peak, w4a16_of_bf16=flop / (row["w4a16_us"] * 1e-6)
                   / args.bf16_peak)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| T | W4A16 µs | W4A16 act_quant µs | W4A8 best µs (config) | auto µs | W4A8 TFLOP/s | of FP8 peak |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['w4a16_us']:.0f} | {r['w4a16_act_us']:.0f} | {r['best_us']:.0f} ({r['best']}) | "
              f"{r['auto_us']:.0f} | {r['tflops']:.0f} | {r['of_fp8_peak']:.3f} |")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.name or f"{datetime.date.today()}-moe-w4a8"
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
        (args.out / f"{stem}.json").write_text(
            json.dumps({"meta": meta, "shape": [E, D, I, K], "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
