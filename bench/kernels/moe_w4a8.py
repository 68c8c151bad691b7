"""The prefill MoE of one V4-Flash layer with FP8 activations on the W4A8 Gluon kernels (``kernels.moe_w4a8_wgmma``)
against the W4A16 kernels of the same call: the Gluon W4A16 tiles (rotate order) with and without the rounded
activations and the Triton tiles on the rounded activations, interleaved in one run, beside the FP8 and bf16 FLOP
rooflines.

Random MXFP4 experts (E = 256, D = 4096, I = 2048, top 6; exponents spread over 5), random routing; µs per call from
CUDA events over ``--calls`` back-to-back calls after a warm-up, two rounds; then the relative differences and the
kernels' CUDA time by name.

    PYTHONPATH=libs:. python3 bench/kernels/moe_w4a8.py --tokens 1024,4096
    PYTHONPATH=libs:. python3 bench/kernels/moe_w4a8.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The Gluon kernels compile for sm_90 only: the smoke mode runs the peers, the Triton tiles of the same calls (FP8
activations on the codes as stored with the row references, which is the W4A8 call's entry; FP8 activations in the
rotate order; unrounded activations), at tiny experts (E = 8, D = I = 128, top 2, T = 2, fp32) in Triton's interpreter
on the host's clock, checks them against ``ReferenceOps.moe_mxfp4(act_quant=True)`` and prints the rooflines; the
Gluon kernels, ``--stages`` and the CUDA profile are skipped there. ``--out DIR`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.harness import (
    add_common_args,
    interpret_if_cpu,
    note_skipped,
    per_call_us,
    pick_device,
    result_header,
    write_json,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.ops.reference import ReferenceOps  # noqa: E402
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
    ap.add_argument("--fp8-tflops", type=float, default=1460.0, help="measured dense FP8 peak (bench/engine/sweep.py)")
    ap.add_argument("--bf16-tflops", type=float, default=798.0, help="measured dense bf16 peak (bench/engine/sweep.py)")
    add_common_args(ap, out_help="write the rows (JSON) here")
    args = ap.parse_args()
    dev = pick_device(args)
    if dev.type != "cuda":
        return smoke(args, dev)
    rows = []
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
                rows.append({"T": t, "round": rnd, "variant": name, "us": us, "fp8_roofline_us": roof8})
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
    if args.out:
        res = {**result_header(dev, args), "rows": rows, "gluon_failed": mod.WGMMA_FAILED}
        write_json(args.out / f"{res['date']}-moe-w4a8.json", res)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def smoke(args: argparse.Namespace, dev: torch.device) -> None:
    """``--device cpu``: the Triton tiles of the same calls (the peers) in the interpreter against
    ``ReferenceOps.moe_mxfp4(act_quant=True)``, the rooflines, the measurement loop and the JSON."""
    global E, I, D, K
    if args.tiny:  # 128 wide: act_quant rounds whole 128-column blocks
        E, I, D, K, args.tokens, args.calls = 8, 128, 128, 2, "2", 1
    note_skipped({"the W4A8 / W4A16 Gluon kernels, --stages": "Gluon compiles for sm_90 only",
                  "the CUDA profile": "CUDA kernel times"})  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)

    def packed(n: int, k: int, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randint(0, 256, (E, n, k // 2), generator=g, device=dev, dtype=torch.uint8).view(torch.int8)
        return w, torch.randint(lo, lo + 5, (E, n, k // 32), generator=g, device=dev, dtype=torch.uint8)

    (w1, s1), (w3, s3), (w2, s2) = packed(I, D, 118), packed(I, D, 118), packed(D, I, 116)
    plain = (w1, s1, w2, s2, w3, s3)
    refs = (row_refs(w1, s1), row_refs(w2, s2), row_refs(w3, s3))
    assert all(r is not None for r in refs)
    rot = [w.clone() for w in (w1, w2, w3)]
    for w in rot:
        to_order(w, "rotate")
    rotate = (rot[0], s1, rot[1], s2, rot[2], s3)
    rows, ref_ops = [], ReferenceOps("cpu")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, D, generator=g, device=dev)  # fp32: the interpreter's bf16 math is wrong
        idx = torch.rand(t, E, generator=g, device=dev).argsort(dim=1)[:, :K]
        w = torch.rand(t, K, generator=g, device=dev)
        runs = {
            "triton tiles, FP8 activations, codes as stored + row refs (the W4A8 call)": partial(
                mod.moe_mxfp4, x, idx, w, *plain, LIMIT, act_quant=True, refs=refs
            ),
            "triton tiles, FP8 activations": partial(
                mod.moe_mxfp4, x, idx, w, *rotate, LIMIT, order="rotate", act_quant=True
            ),
            "triton tiles, unrounded activations": partial(mod.moe_mxfp4, x, idx, w, *rotate, LIMIT, order="rotate"),
        }
        flop = 2 * 3 * t * K * D * I
        roof8, roof16 = flop / (args.fp8_tflops * 1e12) * 1e6, flop / (args.bf16_tflops * 1e12) * 1e6
        outs = {}
        for name, run in runs.items():
            outs[name] = run()
            us = per_call_us(run, args.calls)
            rows.append({"T": t, "round": 0, "variant": name, "us": us, "fp8_roofline_us": roof8})
            print(f"T={t} round 0: {name} {us:.0f} µs (FP8 FLOP roofline {roof8:.3g} µs, bf16 {roof16:.3g} µs)",
                  flush=True)  # fmt: skip
        want = ref_ops.moe_mxfp4(x, idx, w, *plain, LIMIT, act_quant=True)
        got, rnd, bf = outs.values()
        rel = {"as_stored_vs_reference": _rel(got, want), "rotate_vs_as_stored": _rel(rnd, got),
               "fp8_vs_unrounded": _rel(rnd, bf)}  # fmt: skip
        rows[-1]["relative_differences"] = rel
        print(f"T={t}: relative difference, FP8 activations vs ReferenceOps.moe_mxfp4(act_quant=True) "
              f"{rel['as_stored_vs_reference']:.2e}, rotate vs as stored {rel['rotate_vs_as_stored']:.2e}, "
              f"FP8 vs unrounded activations {rel['fp8_vs_unrounded']:.2e}", flush=True)  # fmt: skip
    if args.out:
        res = {**result_header(dev, args), "shape_E_I_D_k": [E, I, D, K], "rows": rows}
        write_json(args.out / f"{res['date']}-moe-w4a8.json", res)


if __name__ == "__main__":
    main()
