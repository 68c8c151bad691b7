"""The start-up warm-up (``engine/warmup.py``, ``DEEPINFER_WARMUP``) on one GPU: build the tiny random model with
``LLM(accelerator="nvidia")`` (the warm-up runs inside), list the decode-graph buckets it left captured, then
generate 16 greedy tokens for 12 prompts and report how long that took and how many buckets it had to capture.

The peer is the same run with ``--no-warmup`` (``DEEPINFER_WARMUP=0``) in another process: the first requests then
pay the compiles and captures. ``--fresh-cache`` points Triton at an empty cache directory first, as on a fresh
machine (otherwise its on-disk cache from earlier runs removes most compile time). No roofline applies (one-time
costs).

    PYTHONPATH=libs:. python3 bench/engine/warmup.py [--arch deepseek_v41] [--no-warmup] [--fresh-cache]
    PYTHONPATH=libs:. python3 bench/engine/warmup.py --tiny --device cpu   # smoke mode: the cpu backend's start-up
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.harness import add_common_args, command_line, git_commit, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
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
    accel = "cpu" if args.device == "cpu" else "nvidia"
    pages, model_len = (32, 256) if args.tiny else (512, 2048)
    llm = LLM(d, accelerator=accel, num_pages=pages, page_size=64, max_model_len=model_len)
    build_s = time.perf_counter() - t
    print(args.arch, accel, "build + warm-up s", round(build_s, 2))
    g = getattr(llm.model, "decode_graphs", None)
    held = sorted(k[0] if isinstance(k, tuple) else k for k in g.buckets) if g else []
    print("buckets after warm-up", held, "failures", g.failures if g else None)
    before = len(g.buckets) if g else 0
    n, tokens = (2, 4) if args.tiny else (12, 16)
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 7]} for i in range(n)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens))
    gen_s = time.perf_counter() - t
    g = getattr(llm.model, "decode_graphs", None)
    captured = len(g.buckets) - before if g else 0
    print(f"generate {n} x {tokens} s", round(gen_s, 3), "buckets captured", captured)
    if args.out:
        res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(), "arch": args.arch,
               "accelerator": accel, "warmup": not args.no_warmup, "build_s": build_s, "buckets_held": held,
               "generate": {"prompts": n, "tokens": tokens, "s": gen_s, "buckets_captured": captured}}  # fmt: skip
        write_json(args.out / f"{res['date']}-warmup-{accel}.json", res)


if __name__ == "__main__":
    main()
