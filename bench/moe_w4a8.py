"""The prefill MoE of one V4-Flash layer with FP8 activations on the W4A8 Gluon kernels (``kernels.moe_w4a8_wgmma``)
against the W4A16 kernels of the same call: the Gluon W4A16 tiles (rotate order) with and without the rounded
activations and the Triton tiles on the rounded activations, interleaved in one run, beside the FP8 and bf16 FLOP
rooflines.

Random MXFP4 experts (E = 256, D = 4096, I = 2048, top 6; exponents spread over 5), random routing; µs per call from
CUDA events over ``--calls`` back-to-back calls after a warm-up, two rounds; then the relative differences and the
kernels' CUDA time by name.

    PYTHONPATH=libs:tests:bench python3 bench/moe_w4a8.py --tokens 1024,4096
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "libs") not in sys.path:
    sys.path.insert(0, str(ROOT / "libs"))

from cuda_timing import per_call_us  # noqa: E402

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.quant.nibble_order import to_order  # noqa: E402
from deepinfer.quant.w4a8 import row_refs  # noqa: E402

E, I, D, K = 256, 2048, 4096, 6
LIMIT = 10.0


def _staged(w4, stages: int, run):
    default, w4.STAGES = w4.STAGES, stages
    try:
        return run()
    finally:
        w4.STAGES = default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--stages", default="", help="also the W4A8 kernels with these ring depths (comma-separated)")
    ap.add_argument("--fp8-tflops", type=float, default=1460.0, help="measured dense FP8 peak (bench/sweep.py)")
    ap.add_argument("--bf16-tflops", type=float, default=798.0, help="measured dense bf16 peak (bench/sweep.py)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def packed(n: int, k: int, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=g, device="cuda", dtype=torch.uint8).view(torch.int8)
        return w, torch.randint(lo, lo + 5, (E, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)

    (w1, s1), (w3, s3), (w2, s2) = packed(I, D, 118), packed(I, D, 118), packed(D, I, 116)
    plain = (w1, s1, w2, s2, w3, s3)
    refs = (row_refs(w1, s1), row_refs(w2, s2), row_refs(w3, s3))
    assert all(r is not None for r in refs)
    rot = []
    for w in (w1, w2, w3):
        w = w.clone()
        to_order(w, "rotate")
        rot.append(w)
    rotate = (rot[0], s1, rot[1], s2, rot[2], s3)
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        idx = torch.rand(t, E, generator=g, device="cuda").argsort(dim=1)[:, :K]
        w = torch.rand(t, K, generator=g, device="cuda")
        runs = {
            "w4a8 gluon (FP8 activations)": partial(mod.moe_mxfp4, x, idx, w, *plain, LIMIT, act_quant=True, refs=refs),
            "w4a16 gluon, FP8 activations": partial(
                mod.moe_mxfp4, x, idx, w, *rotate, LIMIT, order="rotate", act_quant=True
            ),
            "w4a16 gluon (the default)": partial(mod.moe_mxfp4, x, idx, w, *rotate, LIMIT, order="rotate"),
        }
        w4 = mod.moe_w4a8_wgmma
        for st in (int(v) for v in args.stages.split(",") if v):
            runs[f"w4a8 gluon, {st} stages"] = partial(_staged, w4, st, runs["w4a8 gluon (FP8 activations)"])
        flop = 2 * 3 * t * K * D * I
        roof8, roof16 = flop / (args.fp8_tflops * 1e12) * 1e6, flop / (args.bf16_tflops * 1e12) * 1e6
        for rnd in range(2):
            for name, run in runs.items():
                mod.WGMMA_PREFILL = True
                us = per_call_us(run, args.calls)
                print(f"T={t} round {rnd}: {name} {us:.0f} µs ({roof8 / us:.1%} of the FP8 peak; FP8 FLOP roofline "
                      f"{roof8:.0f} µs, bf16 {roof16:.0f} µs)", flush=True)  # fmt: skip
            mod.WGMMA_PREFILL = False
            us = per_call_us(runs["w4a16 gluon, FP8 activations"], args.calls)
            print(f"T={t} round {rnd}: triton tiles, FP8 activations {us:.0f} µs", flush=True)
        mod.WGMMA_PREFILL = True
        got = runs["w4a8 gluon (FP8 activations)"]()
        print(f"T={t}: W4A8 ran (no fallback): {mod.WGMMA_FAILED is None}", flush=True)
        want = runs["w4a16 gluon, FP8 activations"]()
        mod.WGMMA_PREFILL = False
        tri = runs["w4a16 gluon, FP8 activations"]()
        mod.WGMMA_PREFILL = True
        bf = runs["w4a16 gluon (the default)"]()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        print(f"T={t}: relative difference W4A8 vs W4A16 gluon on FP8 activations {rel(got, want):.2e}, vs the "
              f"triton tiles {rel(got, tri):.2e}; gluon vs triton W4A16 {rel(want, tri):.2e}; FP8 activations vs "
              f"bf16 {rel(want, bf):.2e}", flush=True)  # fmt: skip
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runs["w4a8 gluon (FP8 activations)"]()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))


if __name__ == "__main__":
    main()
