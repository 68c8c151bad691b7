"""Host time of a burst of device-to-host copies into pinned memory: where the host tensors come from.

The worker copies what it keeps of a sequence in host memory (prefix-cache snapshots, pages bound for the kvstore)
without waiting for the device (``runtime.host_copy.HostCopies``), into pinned memory. A burst of prompts finishing
together asks for hundreds of such tensors of many sizes at once. Three ways to get them, each timed over the same
``--count`` copies (sizes drawn from ``--sizes-kib``), one after the other in one process:

- ``cold``: PyTorch's caching host allocator on its first burst (the peer: every size it has not cached yet is a
  fresh pinned allocation);
- ``cached``: the same allocator on the same burst again (its blocks cached now);
- ``pool``: ``runtime.pinned_pool.PinnedPool`` (ours: a slab reserved once, carved per tensor); its slab's own
  allocation is printed apart (the worker makes it at warm-up).

Per way: the burst's total host ms (allocations and queued copies, then the wait for the copies), the p50 / p99 /
max of one allocation-and-queue, and the roofline: the burst's bytes over the device-to-host bandwidth measured in
the same run (one large copy into pinned memory). Also one fresh pinned block of 1, 16 and 64 MiB.

    PYTHONPATH=libs:. python bench/host/pinned_alloc.py --out bench/results/host
    PYTHONPATH=libs:. python bench/host/pinned_alloc.py --tiny --device cpu --out /tmp/x   # smoke

On the CPU (the smoke mode) nothing is pinned and nothing is copied across: the same loops on plain host memory,
so the script and its result's shape keep working.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.harness import add_common_args, note_skipped, pick_device, result_header, sync, write_result
from deepinfer.runtime.pinned_pool import PinnedPool


def burst(dev: torch.device, src: torch.Tensor, sizes: list[int], empty) -> dict[str, float]:
    """Host ms of the burst: each size's tensor from ``empty`` and a queued copy of ``src[:n]`` into it."""
    pinned = dev.type == "cuda"
    held, per = [], []
    sync(dev)
    t0 = time.perf_counter()
    for n in sizes:
        t = time.perf_counter()
        host = empty(n)
        host.copy_(src[:n], non_blocking=pinned)
        per.append(time.perf_counter() - t)
        held.append(host)
    sync(dev)
    total = time.perf_counter() - t0
    per.sort()
    return {"total_ms": 1e3 * total, "p50_ms": 1e3 * per[len(per) // 2], "p99_ms": 1e3 * per[int(0.99 * len(per))],
            "max_ms": 1e3 * per[-1]}  # fmt: skip


def d2h_GBps(dev: torch.device, nbytes: int) -> float:
    """Device-to-host bandwidth into pinned memory (the best of 3 copies of ``nbytes``)."""
    pinned = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    best = float("inf")
    for _ in range(3):
        sync(dev)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000, help="copies in the burst")
    ap.add_argument("--sizes-kib", default="16,64,256,1024,4096", help="sizes drawn from (KiB)")
    ap.add_argument("--seed", type=int, default=0)
    add_common_args(ap)
    a = ap.parse_args()
    dev = pick_device(a)
    pinned = dev.type == "cuda"
    if a.tiny:
        a.count, a.sizes_kib = 40, "1,4,16"
    if not pinned:
        note_skipped({"pinned memory and copies across": "need a GPU (plain host memory here)"})
    rng = random.Random(a.seed)
    sizes = [1024 * rng.choice([int(s) for s in a.sizes_kib.split(",")]) for _ in range(a.count)]
    total = sum(sizes)
    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device=dev)
    bw = d2h_GBps(dev, max(sizes) * 16)
    roofline_ms = 1e3 * total / (bw * 1e9)
    t = time.perf_counter()
    pool = PinnedPool(-(-total // (1 << 20)) * (1 << 20) + (1 << 20), pinned=pinned)
    slab_ms = 1e3 * (time.perf_counter() - t)
    rows = {}
    for way in ("cold", "cached"):
        rows[way] = burst(dev, src, sizes, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
    rows["pool"] = burst(dev, src, sizes, lambda n: pool.empty((n,), torch.uint8))
    fresh = {}
    for mib in (1, 16, 64) if not a.tiny else (1,):
        t = time.perf_counter()
        torch.empty((mib << 20) + 4096 + mib, dtype=torch.uint8, pin_memory=pinned)  # (a size no block has yet)
        fresh[f"{mib}_MiB_ms"] = 1e3 * (time.perf_counter() - t)
    res = {**result_header(dev, a), "count": a.count, "bytes": total, "d2h_GBps": bw, "roofline_ms": roofline_ms,
           "pool_slab_ms": slab_ms, "pool_fallbacks": pool.fallbacks, "ways": rows, "fresh_block": fresh}  # fmt: skip
    table = [f"# {a.count} device-to-host copies into pinned memory, {total / 2**20:.0f} MiB ({res['gpu']})", "",
             "| way | burst host ms | × pool | one copy p50 ms | p99 ms | max ms | roofline ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for way, r in rows.items():
        table.append(f"| {way}{' (peer)' if way == 'cold' else ''} | {r['total_ms']:.1f} | "
                     f"{r['total_ms'] / rows['pool']['total_ms']:.1f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                     f"{r['max_ms']:.2f} | {roofline_ms:.1f} |")  # fmt: skip
    table += ["", f"The pool's slab: {slab_ms:.0f} ms once (the worker's warm-up); fallbacks {pool.fallbacks}. "
              f"Device-to-host {bw:.1f} GB/s. One fresh pinned block: "
              + ", ".join(f"{k.replace('_MiB_ms', ' MiB')} {v:.2f} ms" for k, v in fresh.items()) + "."]  # fmt: skip
    write_result(a.out, f"{res['date']}-pinned-alloc-{'gpu' if pinned else 'cpu'}", res, table)


if __name__ == "__main__":
    main()
