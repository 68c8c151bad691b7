"""The lightning indexer's range scores of a 4096-token prefill (``kernels.indexer.indexer_scores_ranges``) with one,
four and eight key blocks a program, interleaved in one run, and whether they give the same bits.

V4-Flash's indexer: 64 heads, d = 128, bf16; every query scores the sequence's 1024 compressed keys (4096 / 4).

    PYTHONPATH=libs:bench python3 bench/indexer_ranges.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "libs") not in sys.path:
    sys.path.insert(0, str(ROOT / "libs"))

from cuda_timing import per_call_us  # noqa: E402

import deepinfer.kernels.indexer as ix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, d, width = args.tokens, 64, 128, args.tokens // 4
    q = torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
    keys = torch.randn(width, d, generator=g, device="cuda").bfloat16()
    w = torch.randn(n, h, generator=g, device="cuda")
    start = torch.zeros(n, dtype=torch.int64, device="cuda")

    def run() -> torch.Tensor:
        return ix.indexer_scores_ranges(q, keys, w, start, width)

    ref = None
    for rnd in range(2):
        for steps, min_programs in ((1, 10**9), (4, 1), (8, 1)):
            ix.INDEXER_RANGE_STEPS, ix.INDEXER_RANGE_MIN_PROGRAMS = steps, min_programs
            out = run()
            ref = out if ref is None else ref
            us = per_call_us(run, args.calls)
            print(f"round {rnd} key blocks a program {steps}: {us:.0f} µs, identical {torch.equal(out, ref)}")


if __name__ == "__main__":
    main()
