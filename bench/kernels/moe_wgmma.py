"""The prefill MoE of one V4-Flash layer on its Gluon kernels (``kernels.moe_mxfp4_wgmma``, ``moe_mxfp4_frag``)
against the Triton prefill tiles of the same call (``moe_mxfp4.WGMMA_PREFILL = False``), interleaved in one run,
beside the bf16 FLOP roofline.

Random MXFP4 experts in the rotate order (E = 256, D = 4096, I = 2048, top 6), random routing; µs per call from CUDA
events over ``--calls`` back-to-back calls after a warm-up, two rounds (``--ws``: the warp-specialised variant too),
with the exponents loaded as words every few steps (``SCALE_WORDS``, the default) and a byte a step (``--no-bytes``
skips it); ``--frag``: the register-fragment kernels (``kernels.moe_mxfp4_frag``, the default path) with their
variants (``--frag-stages``, down over one tile of rows a program, the copies between the halves); then the kernels'
CUDA time by name.

    PYTHONPATH=libs:. python3 bench/kernels/moe_wgmma.py --tokens 4096 --frag --no-bytes
    PYTHONPATH=libs:. python3 bench/kernels/moe_wgmma.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The Gluon kernels compile for sm_90 only: the smoke mode runs the peer, the Triton tiles of the same call, at tiny
experts (E = 8, D = I = 64, top 2, T = 4, fp32 activations) in Triton's interpreter on the host's clock, checks them
against ``ReferenceOps.moe_mxfp4`` and prints the roofline (``bench.harness.moe_smoke``); every Gluon variant, their
bit-identity checks and the CUDA profile are skipped there. ``--out DIR`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse

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

E, I, D, K = 256, 2048, 4096, 6
LIMIT = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--ws", action="store_true", help="also the warp-specialised variant (kernels.moe_mxfp4_ws)")
    ap.add_argument("--frag", action="store_true", help="also the register-fragment kernels (kernels.moe_mxfp4_frag)")
    ap.add_argument("--frag-stages", default="", help="ring depths of the fragment kernels to time besides the default")
    ap.add_argument("--no-bytes", action="store_true", help="skip the exponents-a-byte-a-step variant")
    ap.add_argument("--bf16-tflops", type=float, default=798.0, help="measured dense bf16 peak (bench/engine/sweep.py)")
    add_common_args(ap, out_help="write the rows (JSON) here")
    args = ap.parse_args()
    dev = pick_device(args)
    if dev.type != "cuda":
        return smoke(args, dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    mx = in_order(mxfp4_experts(E, I, D, g, "cuda"), "rotate", copy=False)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        idx = torch.rand(t, E, generator=g, device="cuda").argsort(dim=1)[:, :K]
        w = torch.rand(t, K, generator=g, device="cuda")

        def run(x=x, idx=idx, w=w) -> torch.Tensor:
            return mod.moe_mxfp4(x, idx, w, *mx, LIMIT, order="rotate")

        roof = 2 * 3 * t * K * D * I / (args.bf16_tflops * 1e12) * 1e6
        wg = mod.moe_mxfp4_wgmma
        fr = mod.moe_mxfp4_frag
        # (name, module settings); each variant starts from the defaults below
        base = {(mod, "WGMMA_PREFILL"): True, (wg, "WS"): False, (wg, "SCALE_WORDS"): True, (wg, "FRAG"): False,
                (fr, "STAGES"): fr.STAGES, (fr, "DOWN_PAIRS"): True, (fr, "LATE_COPIES"): False}  # fmt: skip
        variants = [("gluon wgmma", {})]
        if not args.no_bytes:
            variants.append(("gluon wgmma, exponents a byte a step", {(wg, "SCALE_WORDS"): False}))
        if args.ws:
            variants.append(("gluon warp-specialised", {(wg, "WS"): True}))
        if args.frag:
            variants.append(("gluon fragments", {(wg, "FRAG"): True}))
            variants += [(f"gluon fragments, {st} stages", {(wg, "FRAG"): True, (fr, "STAGES"): int(st)})
                         for st in args.frag_stages.split(",") if st]  # fmt: skip
            variants.append(("gluon fragments, down a tile of rows a program",
                             {(wg, "FRAG"): True, (fr, "DOWN_PAIRS"): False}))  # fmt: skip
            variants.append(("gluon fragments, copies between the halves",
                             {(wg, "FRAG"): True, (fr, "LATE_COPIES"): True}))  # fmt: skip
        variants.append(("triton tiles", {(mod, "WGMMA_PREFILL"): False}))
        for rnd in range(2):
            for name, settings in variants:
                for (m, attr), value in {**base, **settings}.items():
                    setattr(m, attr, value)
                us = per_call_us(run, args.calls)
                rows.append({"T": t, "round": rnd, "variant": name, "us": us, "roofline_us": roof})
                print(f"T={t} round {rnd}: {name} {us:.0f} µs (bf16 FLOP roofline {roof:.0f} µs)", flush=True)
        for (m, attr), value in base.items():
            setattr(m, attr, value)
        mod.WGMMA_PREFILL, wg.WS, wg.SCALE_WORDS, wg.FRAG = True, False, False, False
        out = run()
        wg.SCALE_WORDS = True
        print(f"T={t}: the exponents by words bit-identical to a byte a step: {torch.equal(run(), out)}")
        if args.ws:
            mod.moe_mxfp4_wgmma.WS = True
            print(f"T={t}: warp-specialised bit-identical to gluon wgmma: {torch.equal(run(), out)}")
            mod.moe_mxfp4_wgmma.WS = False
        if args.frag:
            wg.FRAG = True
            got = run()
            rel = rel_diff(got, out)
            print(f"T={t}: gluon fragments against gluon wgmma, relative difference {rel:.2e}")
            print(f"T={t}: a Gluon build failed: {mod.WGMMA_FAILED}")  # the profile below: the fragment kernels
        mod.WGMMA_PREFILL, mod.moe_mxfp4_wgmma.WS = False, None
        ref = run()
        mod.WGMMA_PREFILL = None
        rel = rel_diff(out, ref)
        print(f"T={t}: gluon against the triton tiles, relative difference {rel:.2e}")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=40))
    if args.out:
        res = {**result_header(dev, args), "rows": rows, "gluon_failed": mod.WGMMA_FAILED}
        write_json(args.out / f"{res['date']}-moe-wgmma.json", res)


def smoke(args: argparse.Namespace, dev: torch.device) -> None:
    """``--device cpu``: the Triton tiles (the peer) in the interpreter against ``ReferenceOps.moe_mxfp4``, the
    roofline, the measurement loop and the JSON (``bench.harness.moe_smoke``); the Gluon kernels need an sm_90 GPU."""
    shape = (E, I, D, K)
    if args.tiny:
        shape, args.tokens, args.calls = (8, 64, 64, 2), "4", 1
    skipped = {"the Gluon variants, their bit-identity checks": "Gluon compiles for sm_90 only",
               "the CUDA profile": "CUDA kernel times"}  # fmt: skip
    variants = lambda plain, rotate: {"triton tiles": (rotate, {"order": "rotate"})}  # noqa: E731
    moe_smoke(args, dev, "moe-wgmma", shape, LIMIT, variants, skipped, {"bf16": args.bf16_tflops})


if __name__ == "__main__":
    main()
