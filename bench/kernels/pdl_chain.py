"""What programmatic dependent launch (PDL) saves between the kernels of a CUDA graph, one GPU.

A decode step at batch 1 is a chain of ~240 short kernels in one CUDA graph; `step_census.py` measured about
1.4 µs a kernel beyond its own work. With PDL (Hopper+), a kernel launched with ``launch_pdl=True`` may start
while the kernel before it drains; it waits with ``gdc_wait`` before it touches memory, and the kernel before it
may release it early with ``gdc_launch_dependents``. This measures, for a chain of ``--kernels`` dependent Triton
kernels that each read ``--kib`` KiB and write a small vector (a GEMV-like read of a weight slice plus a
dependency on the previous kernel's output), the time per kernel in one graph:

- ``plain``: ordinary launches (the peer: what the step does now);
- ``pdl``: ``launch_pdl`` with ``gdc_wait`` first thing;
- ``pdl_early``: also ``gdc_launch_dependents`` first thing (the next kernel's programs become resident early);
- the roofline: the bytes each kernel reads over the copy bandwidth measured in the same run.

    PYTHONPATH=libs:. python bench/kernels/pdl_chain.py --kernels 200 --kib 16,256,2048
    PYTHONPATH=libs:. python bench/kernels/pdl_chain.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode runs the plain chain (4 kernels of 4 programs, 32-wide tiles, fp32) eagerly in Triton's interpreter,
timed on the host's clock, beside the roofline at the host's copy bandwidth; the PDL modes (Hopper's grid dependency
control) and the CUDA graph are skipped there.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.harness import (
    add_common_args,
    copy_gbps,
    device_name,
    interpret_if_cpu,
    median_ms,
    note_skipped,
    pick_device,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _link_kernel(w_ptr, x_ptr, y_ptr, n_per_prog, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid * n_per_prog
    for start in range(0, n_per_prog, BLOCK):
        acc += tl.load(w_ptr + base + start + offs).to(tl.float32)
    prev = tl.load(x_ptr + pid)
    tl.store(y_ptr + pid, prev * 0.5 + tl.sum(acc, 0))


def chain(kernels: int, kib: int, mode: str, dev, progs: int = 132, block: int = 1024) -> float:
    n_per_prog = max(block, kib * 1024 // 2 // progs // block * block)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter's bf16 math is wrong
    w = torch.randn(progs * n_per_prog, device=dev, dtype=dtype)
    bufs = [torch.zeros(progs, device=dev, dtype=torch.float32) for _ in range(2)]
    pdl, early = mode != "plain", mode == "pdl_early"
    extra = {"launch_pdl": True} if pdl else {}

    def run():
        for i in range(kernels):
            _link_kernel[(progs,)](
                w, bufs[i % 2], bufs[(i + 1) % 2], n_per_prog, PDL=pdl, EARLY=early, BLOCK=block, **extra
            )

    if dev.type != "cuda":  # the smoke mode: eager launches in the interpreter, the host's clock
        return median_ms(run, dev, repeats=1) * 1e3 / kernels, w.numel() * 2
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / kernels)
    return statistics.median(times), w.numel() * 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=int, default=200)
    p.add_argument("--kib", default="16,256,2048")
    add_common_args(p)
    args = p.parse_args()
    dev = pick_device(args)
    progs, block, modes, skipped = 132, 1024, ("plain", "pdl", "pdl_early"), {}
    if args.tiny:
        args.kernels, args.kib, progs, block = 4, "1", 4, 32
    if dev.type != "cuda":
        modes = ("plain",)
        skipped["pdl, pdl_early"] = "PDL is Hopper's grid dependency control: not in Triton's interpreter"
        skipped["CUDA graph, CUDA events"] = "eager launches on the host's clock instead"
        bw = copy_gbps(dev, numel=1 << 20) * 1e9
    else:
        bw = copy_bandwidth(dev)
    note_skipped(skipped)
    rows = []
    name = f"Triton {triton.__version__}" + (", interpreter" if dev.type != "cuda" else "")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {name}, PDL API: {gdc_wait is not None}")
    print("| KiB read a kernel | roofline µs | plain µs | pdl µs | pdl_early µs |")
    print("|---:|---:|---:|---:|---:|")
    for kib in [int(k) for k in args.kib.split(",")]:
        row = {"kib": kib}
        for mode in ("plain", "pdl", "pdl_early"):
            row[mode] = None
            if mode not in modes:
                continue
            try:
                row[mode], nbytes = chain(args.kernels, kib, mode, dev, progs, block)
            except Exception as exc:  # noqa: BLE001 - a Triton without launch_pdl
                row[mode + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        row["roofline_us"] = nbytes / bw * 1e6
        rows.append(row)
        f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {kib} | {row['roofline_us']:.2f} | {f(row['plain'])} | {f(row['pdl'])} | {f(row['pdl_early'])} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else device_name(dev)
        res = {"gpu": gpu, "triton": triton.__version__, "kernels": args.kernels, "rows": rows}
        if skipped:
            res["skipped"] = skipped
        (args.out / "pdl_chain.json").write_text(json.dumps(res, indent=1))


def copy_bandwidth(dev) -> float:
    """Bytes / s (read + write) of a 1 GiB device copy, CUDA events over 5 copies."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize()
    bw = 5 * 2 * src.numel() * 4 / (a.elapsed_time(b) * 1e-3)
    del src, dst
    return bw


if __name__ == "__main__":
    main()
