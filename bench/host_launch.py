"""The host's cost of one launch, by kind, on this machine: what a prefill pays per op before the GPU sees it.

Each case is called ``--calls`` times back to back after a warm-up, without a sync between calls (the device
queue never fills: the work is small or the calls are few), and the host's time per call is printed in µs beside
the device's time per call (CUDA events over the same calls, after the host's loop) and how many launches the
call makes. Cases: a CUDA tensor allocation, a one-element torch op, ``torch.tensor`` of a 4096-int Python list, a
bf16 ``F.linear`` (cuBLAS) at a 4096-token prefill's width, the RMSNorm Triton kernel with and without PDL, and
``torch.mm`` at fp32 (the mHC mixes).

    PYTHONPATH=libs python3 bench/host_launch.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "libs") not in sys.path:
    sys.path.insert(0, str(ROOT / "libs"))

from deepinfer.kernels import norm, pdl  # noqa: E402


def per_call(fn, calls: int) -> tuple[float, float]:
    """(host µs, device µs) per call of ``fn``: the median of 3 rounds of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    hosts, devs = [], []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append((time.perf_counter() - t) / calls * 1e6)
        b.record()
        torch.cuda.synchronize()
        devs.append(a.elapsed_time(b) / calls * 1e3)
    return statistics.median(hosts), statistics.median(devs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev).bfloat16()
    w = torch.randn(4096, 4096, device=dev).bfloat16()
    one = torch.zeros(1, device=dev)
    nw = torch.ones(4096, device=dev).bfloat16()
    xf, wf = torch.randn(4096, 16384, device=dev), torch.randn(72, 16384, device=dev)
    ids = list(range(4096))

    def rms(on: bool):
        def run():
            pdl._choice[:] = [pdl._ON if on else pdl._OFF]
            norm.rms_norm(x, nw, 1e-6)

        return run

    cases = {
        "torch.empty 4096x4096 bf16": lambda: torch.empty(4096, 4096, dtype=torch.bfloat16, device=dev),
        "one-element add_": lambda: one.add_(1.0),
        "torch.tensor(4096 ints) on the host": lambda: torch.tensor(ids, dtype=torch.long),
        "F.linear bf16 4096x4096x4096": lambda: torch.nn.functional.linear(x, w),
        "rms_norm Triton, PDL": rms(True),
        "rms_norm Triton, no PDL": rms(False),
        "torch.mm fp32 4096x16384x72": lambda: torch.mm(xf, wf.t()),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call, {args.calls} calls a round")
    print("| case | host µs | device µs |")
    print("|---|---:|---:|")
    for name, fn in cases.items():
        h, d = per_call(fn, args.calls)
        print(f"| {name} | {h:.1f} | {d:.1f} |", flush=True)
    pdl.reset()


if __name__ == "__main__":
    main()
