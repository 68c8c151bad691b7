"""Where a decode step makes the host wait for the GPU, on one GPU (diagnostic).

1. Whether a ``non_blocking`` host-to-device copy from pageable memory returns before queued GPU work is done
   (``torch.cuda._sleep`` keeps the stream busy): host µs of the copy from pageable and from pinned memory.
2. A prefix-cache snapshot of the prefilled ``--context``-token sequence and its restore (``snapshot_probe``): host
   ms with the GPU kept busy before each, the copies queued (ours) against synchronous copies (the peer).
3. One decode step of ``bench/engine/sweep.py``'s model (V4-Flash width, ``--layers``) at each ``--batches`` size,
   warmed up, then run under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising call is printed with the
   frames of this repository that led to it, and the step's host time with the GPU kept busy before it (a step
   that never waits returns long before the GPU work queued ahead of it is done: the median of ``--repeats``).

    PYTHONPATH=libs:. python bench/host/host_syncs.py --batches 1,16
    PYTHONPATH=libs:. python bench/host/host_syncs.py --tiny --device cpu --out /tmp/x   # smoke

The smoke mode builds ``sweep.py``'s tiny model on the CPU (its own layers, a 64-token context, batch 1) and times
the decode step on the host's clock; the copy probe (``torch.cuda._sleep``, pinned memory), the sync debug mode and
the GPU kept busy before each step need a GPU and are skipped there.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings

import torch

from bench.engine import sweep
from bench.harness import add_common_args, note_skipped, pick_device, result_header, sync, write_json
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


def snapshot_probe(dev: torch.device, state: SequenceState, cache, table: torch.Tensor, repeats: int) -> dict:
    """Host ms of a prefix-cache snapshot (``StateSnapshot.take``, what the worker does for every resume point the
    scheduler orders) and of its restore, with about 50 ms of GPU work queued ahead of each: the copies queued
    (``host_copy.HostCopies``, ours) against synchronous copies (``host_copy.BLOCKING``: the code before, the peer).
    A take that never waits costs its launches only; a synchronous one waits for the queue to drain."""
    from deepinfer.models.deepseek_v4.state import StateSnapshot
    from deepinfer.runtime import host_copy

    out: dict = {"snapshot_MB": 0.0}
    before = host_copy.BLOCKING
    try:
        for name, blocking in (("synchronous", True), ("queued", False)):
            host_copy.BLOCKING = blocking
            takes, restores = [], []
            for _ in range(repeats + 1):  # (the first: allocators' blocks)
                sync(dev)
                if dev.type == "cuda":
                    torch.cuda._sleep(100_000_000)
                t = time.perf_counter()
                snap = StateSnapshot.take(state, cache, table)
                takes.append(time.perf_counter() - t)
                t = time.perf_counter()
                snap.restore(cache, table, dev)  # (the same rows back where they were)
                restores.append(time.perf_counter() - t)
            sync(dev)
            tensors = [*snap.tail.values(), *snap.state.windows.values()]
            tensors += [x for b in snap.state.buffers.values() for x in (b.kv, b.score)]
            out["snapshot_MB"] = sum(x.numel() * x.element_size() for x in tensors) / 1e6
            out[name] = {"take_host_ms": 1e3 * statistics.median(takes[1:]),
                         "restore_host_ms": 1e3 * statistics.median(restores[1:])}  # fmt: skip
    finally:
        host_copy.BLOCKING = before
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7, help="host-timed steps a batch size (the median is printed)")
    add_common_args(ap)
    a = ap.parse_args()
    dev = pick_device(a)
    cuda = dev.type == "cuda"
    res = {"copy_probe": None, "batches": []}
    if a.tiny:  # sweep's tiny model (its own layers), a short context
        a.batches, a.context, a.repeats = "1", 64, 2
    if cuda:
        res["copy_probe"] = copy_probe(dev)
        print("H2D copy with 25 ms of GPU work queued:", res["copy_probe"], flush=True)
    else:
        res["skipped"] = {
            "copy probe": "torch.cuda._sleep and pinned memory need a GPU",
            "sync debug mode": "torch.cuda.set_sync_debug_mode reports CUDA synchronisations only",
            "GPU kept busy before each step": "the step's host time is its whole time on the CPU",
        }
        note_skipped(res["skipped"])
    batches = [int(b) for b in a.batches.split(",")]
    argv = ["--context", str(a.context), "--batches", a.batches, "--prefill-tokens", "256", "--no-peer"]
    argv += ["--tiny", "--device", dev.type] if a.tiny else ["--layers", str(a.layers)]
    args = sweep.parse_args(argv)
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
        res["snapshot_probe"] = probe = snapshot_probe(dev, st, ours.cache, ours.tables[0], a.repeats)
        print(f"a {a.context}-token sequence's snapshot ({probe['snapshot_MB']:.2f} MB), host ms with GPU work queued "
              f"ahead: take {probe['queued']['take_host_ms']:.3f} (queued copies) against "
              f"{probe['synchronous']['take_host_ms']:.3f} (synchronous, the peer); restore "
              f"{probe['queued']['restore_host_ms']:.3f} against {probe['synchronous']['restore_host_ms']:.3f}",
              flush=True)  # fmt: skip
        for b in batches:
            step = ours.make_step(b, 12)
            for _ in range(1 if a.tiny else 4):  # warm-up
                step()
            sync(dev)
            seen: list[str] = []

            def show(message, category, filename, lineno, file=None, line=None, seen=seen):
                if str(message).startswith("Synchronization debug mode is a prototype"):  # (its own notice)
                    return
                frames = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename or "bench/" in f.filename]
                where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in reversed(frames[-6:]))
                seen.append(f"{str(message)[:80]} at {where}")

            if cuda:
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
                sync(dev)
                if cuda:
                    torch.cuda._sleep(100_000_000)  # ~50 ms queued: a step that never waits returns well before it ends
                t = time.perf_counter()
                step()
                hosts.append(time.perf_counter() - t)
                sync(dev)
                totals.append(time.perf_counter() - t)
            host, total = statistics.median(hosts), statistics.median(totals)
            print(f"batch {b}: {len(seen)} synchronising calls; step host {1e3 * host:.2f} ms of {1e3 * total:.2f} "
                  f"(median of {a.repeats})")  # fmt: skip
            for s in seen:
                print("   ", s)
            res["batches"].append({"batch": b, "syncs": seen, "host_ms": 1e3 * host, "total_ms": 1e3 * total})
    if a.out:
        res = {**result_header(dev, a), **res}
        write_json(a.out / f"{res['date']}-host-syncs.json", res)


if __name__ == "__main__":
    main()
