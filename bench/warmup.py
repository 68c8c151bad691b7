"""The start-up warm-up (``engine/warmup.py``, ``DEEPINFER_WARMUP``) on one GPU: build the tiny random model with
``LLM(accelerator="nvidia")`` (the warm-up runs inside), list the decode-graph buckets it left captured, then
generate 16 greedy tokens for 12 prompts and report how long that took and how many buckets it had to capture.

The peer is the same run with ``--no-warmup`` (``DEEPINFER_WARMUP=0``) in another process: the first requests then
pay the compiles and captures. ``--fresh-cache`` points Triton at an empty cache directory first, as on a fresh
machine (otherwise its on-disk cache from earlier runs removes most compile time). No roofline applies (one-time
costs).

    PYTHONPATH=libs:tests:bench python3 bench/warmup.py [--arch deepseek_v41] [--no-warmup] [--fresh-cache]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="deepseek_v4")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--fresh-cache", action="store_true")
    args = ap.parse_args()
    if args.no_warmup:
        os.environ["DEEPINFER_WARMUP"] = "0"
    if args.fresh_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
    from deepinfer.checkpoint.tiny import make_tiny_model
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    d = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch=args.arch, seed=0)
    t = time.perf_counter()
    llm = LLM(d, accelerator="nvidia", num_pages=512, page_size=64, max_model_len=2048)
    print(args.arch, "build + warm-up s", round(time.perf_counter() - t, 2))
    g = llm.model.decode_graphs
    held = sorted(k[0] if isinstance(k, tuple) else k for k in g.buckets) if g else []
    print("buckets after warm-up", held, "failures", g.failures if g else None)
    before = len(g.buckets) if g else 0
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 7]} for i in range(12)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    g = llm.model.decode_graphs
    print(
        "generate 12 x 16 s", round(time.perf_counter() - t, 3), "buckets captured", len(g.buckets) - before if g else 0
    )


if __name__ == "__main__":
    main()
