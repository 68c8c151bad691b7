"""Where a decode step makes the host wait for the GPU, on one GPU (diagnostic).

1. Whether a ``non_blocking`` host-to-device copy from pageable memory returns before queued GPU work is done
   (``torch.cuda._sleep`` keeps the stream busy): host µs of the copy from pageable and from pinned memory.
2. One decode step of ``bench/sweep.py``'s model (V4-Flash width, ``--layers``) at each ``--batches`` size, warmed
   up, then run under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising call is printed with the
   frames of this repository that led to it, and the step's host time with the GPU kept busy before it (a step
   that never waits returns long before the GPU work queued ahead of it is done: the median of ``--repeats``).

    PYTHONPATH=libs:tests:bench python bench/host_syncs.py --batches 1,16
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings

import sweep
import torch

from deepinfer.models.deepseek_v4.state import SequenceState


def copy_probe(dev: torch.device) -> dict[str, float]:
    out = {}
    for name, pin in (("pageable", False), ("pinned", True)):
        src = torch.arange(64, dtype=torch.long).pin_memory() if pin else torch.arange(64, dtype=torch.long)
        torch.cuda.synchronize(dev)
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued ahead
        t = time.perf_counter()
        src.to(dev, non_blocking=True)
        out[f"{name}_host_us"] = 1e6 * (time.perf_counter() - t)
        torch.cuda.synchronize(dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7, help="host-timed steps a batch size (the median is printed)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    print("H2D copy with 25 ms of GPU work queued:", copy_probe(dev), flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    args = sweep.parse_args(["--layers", str(a.layers), "--context", str(a.context), "--batches", a.batches,
                             "--prefill-tokens", "256", "--no-peer"])  # fmt: skip
    torch.manual_seed(0)
    config = sweep.build_config(args)
    with torch.no_grad():
        model = sweep.build_ours(config, dev, 0)
        if getattr(model.ops, "native_weights", False):
            sweep.prepare_native(model, tuple(config.weight_block_size), quantize=True)
            model.ops.prepare_weights(model)
        ours = sweep.Ours(model, args, dev, batches)
        st = SequenceState()
        ours._prefill(st, ours.tables[0], ours._ids(a.context))
        ours.templates = [st]
        for b in batches:
            step = ours.make_step(b, 12)
            for _ in range(4):
                step()
            torch.cuda.synchronize(dev)
            seen: list[str] = []

            def show(message, category, filename, lineno, file=None, line=None, seen=seen):
                frames = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename or "bench/" in f.filename]
                where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in reversed(frames[-6:]))
                seen.append(f"{str(message)[:80]} at {where}")

            old = warnings.showwarning
            warnings.showwarning = show
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = old
            hosts, totals = [], []
            for _ in range(a.repeats):
                torch.cuda.synchronize(dev)
                torch.cuda._sleep(100_000_000)  # ~50 ms queued: a step that never waits returns well before it ends
                t = time.perf_counter()
                step()
                hosts.append(time.perf_counter() - t)
                torch.cuda.synchronize(dev)
                totals.append(time.perf_counter() - t)
            host, total = statistics.median(hosts), statistics.median(totals)
            print(f"batch {b}: {len(seen)} synchronising calls; step host {1e3 * host:.2f} ms of {1e3 * total:.2f} "
                  f"(median of {a.repeats})")  # fmt: skip
            for s in seen:
                print("   ", s)


if __name__ == "__main__":
    main()
