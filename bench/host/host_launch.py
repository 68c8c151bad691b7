"""The host's cost of one launch, by kind, on this machine: what a prefill pays per op before the GPU sees it.

Each case is called ``--calls`` times back to back after a warm-up, without a sync between calls (the device
queue never fills: the work is small or the calls are few), and the host's time per call is printed in µs beside
the device's time per call (CUDA events over the same calls, after the host's loop) and how many launches the
call makes. Cases: a CUDA tensor allocation, a one-element torch op, ``torch.tensor`` of a 4096-int Python list, a
bf16 ``F.linear`` (cuBLAS) at a 4096-token prefill's width, the RMSNorm Triton kernel with and without PDL, and
``torch.mm`` at fp32 (the mHC mixes).

    PYTHONPATH=libs:. python3 bench/host/host_launch.py [--out DIR]
    PYTHONPATH=libs:. python3 bench/host/host_launch.py --tiny --device cpu   # smoke: 64-wide shapes, interpreter

The smoke mode times the same cases on the host's clock at tiny shapes (the RMSNorm kernel in Triton's interpreter,
fp32); the device column and the PDL case (CUDA events; PDL needs Hopper) are skipped there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.harness import add_common_args, interpret_if_cpu, note_skipped, pick_device, result_header, save_result

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

from deepinfer.kernels import norm, pdl  # noqa: E402


def per_call(fn, calls: int, dev: torch.device) -> tuple[float, float | None]:
    """(host µs, device µs) per call of ``fn``: the median of 3 rounds of ``calls`` calls; on the CPU (the smoke
    mode) the host's time alone, the device's None."""
    fn()
    if dev.type != "cuda":
        hosts = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            hosts.append((time.perf_counter() - t) / calls * 1e6)
        return statistics.median(hosts), None
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
    add_common_args(ap)
    args = ap.parse_args()
    dev = pick_device(args)
    n, k = 4096, 16384
    if args.tiny:  # the interpreter's bf16 math is wrong: fp32 on the CPU
        n, k, args.calls = 64, 256, 2
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(n, n, device=dev).to(dtype)
    w = torch.randn(n, n, device=dev).to(dtype)
    one = torch.zeros(1, device=dev)
    nw = torch.ones(n, device=dev).to(dtype)
    xf, wf = torch.randn(n, k, device=dev), torch.randn(72, k, device=dev)
    ids = list(range(n))

    def rms(on: bool):
        def run():
            pdl._choice[:] = [pdl._ON if on else pdl._OFF]
            norm.rms_norm(x, nw, 1e-6)

        return run

    dt = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    cases = {
        f"torch.empty {n}x{n} {dt}": lambda: torch.empty(n, n, dtype=dtype, device=dev),
        "one-element add_": lambda: one.add_(1.0),
        f"torch.tensor({n} ints) on the host": lambda: torch.tensor(ids, dtype=torch.long),
        f"F.linear {dt} {n}x{n}x{n}": lambda: torch.nn.functional.linear(x, w),
        "rms_norm Triton, PDL": rms(True),
        "rms_norm Triton, no PDL": rms(False),
        f"torch.mm fp32 {n}x{k}x72": lambda: torch.mm(xf, wf.t()),
    }
    skipped = {}
    if dev.type != "cuda":
        skipped["rms_norm Triton, PDL"] = "PDL needs a Hopper GPU (the interpreter has no grid dependency control)"
        skipped["device µs"] = "CUDA events: no device on the CPU, host time only"
    note_skipped(skipped)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (rms_norm in Triton's interpreter)"
    print(f"{gpu}, torch {torch.__version__}; µs per call, {args.calls} calls a round")
    table = ["| case | host µs | device µs |", "|---|---:|---:|"]
    print("\n".join(table))
    rows = []
    for name, fn in cases.items():
        if name in skipped:
            continue
        h, d = per_call(fn, args.calls, dev)
        rows.append({"case": name, "host_us": h, "device_us": d})
        table.append(f"| {name} | {h:.1f} | {'—' if d is None else f'{d:.1f}'} |")
        print(table[-1], flush=True)
    pdl.reset()
    if args.out:
        res = {**result_header(dev, args), "calls": args.calls, "rows": rows, "skipped": skipped}
        save_result(args.out, f"{res['date']}-host-launch", res, table)


if __name__ == "__main__":
    main()
