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
on the host's clock, checks each against ``ReferenceOps.moe_mxfp4`` of the same arguments and prints the rooflines
(``bench.harness.moe_smoke``); the Gluon kernels, ``--stages`` and the CUDA profile are skipped there. ``--out DIR``
writes the rows as JSON.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.harness import (
    add_common_args,
    in_order,
    interpret_if_cpu,
    moe_smoke,
    mxfp4_experts,
    per_call_us,
    pick_device,
    rel_diff,
    result_header,
    write_json,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
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

    plain = mxfp4_experts(E, I, D, g, "cuda")
    w1, s1, w2, s2, w3, s3 = plain
    refs = (row_refs(w1, s1), row_refs(w2, s2), row_refs(w3, s3))
    assert all(r is not None for r in refs)
    rotate = in_order(plain, "rotate")
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
        print(f"T={t}: relative difference W4A8 vs W4A16 gluon on FP8 activations {rel_diff(got, want):.2e}, vs the "
              f"triton tiles {rel_diff(got, tri):.2e}; gluon vs triton W4A16 {rel_diff(want, tri):.2e}; FP8 "
              f"activations vs bf16 {rel_diff(want, bf):.2e}", flush=True)  # fmt: skip
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runs["w4a8 gluon (FP8 activations)"]()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
    if args.out:
        res = {**result_header(dev, args), "rows": rows, "gluon_failed": mod.WGMMA_FAILED}
        write_json(args.out / f"{res['date']}-moe-w4a8.json", res)


def smoke(args: argparse.Namespace, dev: torch.device) -> None:
    """``--device cpu``: the Triton tiles of the same calls (the peers) in the interpreter, each against
    ``ReferenceOps.moe_mxfp4`` of the same arguments (``act_quant=True``: the official FP8 activations), the
    rooflines, the measurement loop and the JSON (``bench.harness.moe_smoke``)."""
    shape = (E, I, D, K)
    if args.tiny:  # 128 wide: act_quant rounds whole 128-column blocks
        shape, args.tokens, args.calls = (8, 128, 128, 2), "2", 1

    def variants(plain: tuple, rotate: tuple) -> dict[str, tuple[tuple, dict]]:
        refs = (row_refs(*plain[0:2]), row_refs(*plain[2:4]), row_refs(*plain[4:6]))
        assert all(r is not None for r in refs)
        return {
            "triton tiles, FP8 activations, codes as stored + row refs (the W4A8 call)": (
                plain, {"act_quant": True, "refs": refs}),
            "triton tiles, FP8 activations": (rotate, {"order": "rotate", "act_quant": True}),
            "triton tiles, unrounded activations": (rotate, {"order": "rotate"}),
        }  # fmt: skip

    skipped = {"the W4A8 / W4A16 Gluon kernels, --stages": "Gluon compiles for sm_90 only",
               "the CUDA profile": "CUDA kernel times"}  # fmt: skip
    peaks = {"FP8": args.fp8_tflops, "bf16": args.bf16_tflops}
    moe_smoke(args, dev, "moe-w4a8", shape, LIMIT, variants, skipped, peaks)


if __name__ == "__main__":
    main()
