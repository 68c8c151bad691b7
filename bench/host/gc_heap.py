"""The pause of one full garbage collection in a worker process, before and after ``engine.heap.freeze_heap``.

    PYTHONPATH=libs:. python bench/host/gc_heap.py [--accelerator cpu|nvidia] [--model DIR] [--repeats 5] [--out DIR]
    PYTHONPATH=libs:. python bench/host/gc_heap.py --tiny --device cpu   # the smoke mode CI runs

Loads the model as the worker service does (``build_worker``: the tiny random checkpoint by default, with the
accelerator's warm-up), then times ``gc.collect()`` (a full collection, what CPython runs whenever enough objects
have survived into its oldest generation) over the start-up's heap: the peer is that heap unfrozen, the same
process; after ``freeze_heap`` the same collection again. The roofline is no pause at all. Prints the objects a
collection walks and the median ms of ``--repeats`` collections each way.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

from bench.harness import add_common_args, command_line, git_commit, write_json


def collect_ms(repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--accelerator", default=None, help="default: nvidia with --device cuda, else cpu")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: a tiny random V4)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.accelerator = args.accelerator or ("nvidia" if args.device == "cuda" else "cpu")
    if args.tiny:
        args.repeats = min(args.repeats, 2)
    from deepinfer.checkpoint.tiny import make_tiny_model
    from deepinfer.engine.factory import build_worker
    from deepinfer.engine.heap import freeze_heap

    model = args.model or make_tiny_model(tempfile.mkdtemp(prefix="gc_heap_"))
    t = time.perf_counter()
    parts = build_worker(model, accelerator=args.accelerator)
    print(f"worker built in {time.perf_counter() - t:.1f} s ({parts.accelerator}, {parts.config.model_type})")
    walked = len(gc.get_objects())
    unfrozen = collect_ms(args.repeats)
    info = freeze_heap()
    after = len(gc.get_objects())
    frozen = collect_ms(args.repeats)
    print(f"  peer: the start-up heap unfrozen   {walked:>8} objects walked   full collection {unfrozen:8.2f} ms")
    print(f"  ours: after freeze_heap            {after:>8} objects walked   full collection {frozen:8.2f} ms")
    print(f"  roofline: no pause                 (frozen {info['frozen']} objects)")
    if args.out:
        res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(),
               "accelerator": args.accelerator, "repeats": args.repeats, "walked_unfrozen": walked,
               "unfrozen_ms": unfrozen, "walked_frozen": after, "frozen_ms": frozen,
               "frozen": info["frozen"]}  # fmt: skip
        write_json(args.out / f"{res['date']}-gc-heap-{args.accelerator}.json", res)


if __name__ == "__main__":
    main()
