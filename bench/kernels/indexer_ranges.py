"""The lightning indexer's range scores of a 4096-token prefill (``kernels.indexer.indexer_scores_ranges``) with one,
four and eight key blocks a program, interleaved in one run, and whether they give the same bits.

V4-Flash's indexer: 64 heads, d = 128, bf16; every query scores the sequence's 1024 compressed keys (4096 / 4).

    PYTHONPATH=libs:. python3 bench/kernels/indexer_ranges.py [--out DIR]
    PYTHONPATH=libs:. python3 bench/kernels/indexer_ranges.py --tiny --device cpu   # smoke: 64 tokens, interpreter
"""

from __future__ import annotations

import argparse

import torch

from bench.harness import add_common_args, interpret_if_cpu, per_call_us, pick_device, result_header, write_json

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

import deepinfer.kernels.indexer as ix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=10)
    add_common_args(ap)
    args = ap.parse_args()
    dev = pick_device(args)
    h = 64
    if args.tiny:  # the interpreter's bf16 math is wrong: fp32 inputs on the CPU
        args.tokens, args.calls, h = 64, 1, 4
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n, d, width = args.tokens, 128, args.tokens // 4
    q = torch.randn(n, h, d, generator=g, device=dev).to(dtype)
    keys = torch.randn(width, d, generator=g, device=dev).to(dtype)
    w = torch.randn(n, h, generator=g, device=dev)
    start = torch.zeros(n, dtype=torch.int64, device=dev)
    rows = []

    def run() -> torch.Tensor:
        return ix.indexer_scores_ranges(q, keys, w, start, width)

    ref = None
    for rnd in range(1 if args.tiny else 2):  # (the smoke: one round in the interpreter)
        for steps, min_programs in ((1, 10**9), (4, 1), (8, 1)):
            ix.INDEXER_RANGE_STEPS, ix.INDEXER_RANGE_MIN_PROGRAMS = steps, min_programs
            out = run()
            ref = out if ref is None else ref
            us = per_call_us(run, args.calls)
            same = torch.equal(out, ref)
            rows.append({"round": rnd, "key_blocks": steps, "us": us, "identical": same})
            print(f"round {rnd} key blocks a program {steps}: {us:.0f} µs, identical {same}")
    if args.out:
        res = {**result_header(dev, args), "rows": rows}
        write_json(args.out / f"{res['date']}-indexer-ranges.json", res)


if __name__ == "__main__":
    main()
