"""Instructions of the MXFP4 gate/up kernel's K loop on Hopper, counted without a GPU (a kernel's issue cost).

``kernels.moe_mxfp4._mx_gate_up_kernel`` is compiled for sm_90 by Triton on any host (its own ``ptxas``), the cubin
disassembled with the ``cuobjdump`` Triton ships, and the instructions of the K loop (the backward branch around the
most MMA instructions) counted by opcode. One trip of that loop decodes ``2 · block_n · block_k`` weights (gate and
up) and issues ``count · num_warps`` warp instructions; at decode sizes the kernel is issue-bound (ncu on the H200:
56% of the schedulers' issue slots used, DRAM at 44%), so fewer instructions a trip is a faster kernel. Compares the
decodes of ``bench/results/kernels/2026-11-30-moe-mxfp4-shift.md``: the byte-lookup decode of the codes as stored,
the shift
decode of the shift order (``quant.nibble_order``), that with the weight tiles read by the TMA unit, and the rotate
decode of the rotate order with TMA.

    PYTHONPATH=libs:. python bench/kernels/moe_sass.py --configs 16,64,128,2,3 16,128,128,4,3 128,128,128,8,3
    PYTHONPATH=libs:. python bench/kernels/moe_sass.py --tiny --device cpu --out /tmp/x   # smoke: the first config

No GPU is used in either mode (``--device`` is accepted for the common flags; the kernels are compiled, not run, so
Triton's interpreter is never used here); ``--tiny`` keeps the first config alone. With ``--out`` the table and the
opcode counts (with each compile's seconds) are written as JSON and markdown.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.harness import add_common_args, result_header, save_result, timed
from deepinfer.kernels import moe_mxfp4  # noqa: E402

VARIANTS = {"plain": (0, False), "shift": (1, False), "shift_tma": (1, True), "rotate_tma": (2, True)}  # (ORDER, TMA)
_ALIGNED = ("KH", "N", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_hm")


def compile_sm90(block_m: int, block_n: int, block_k: int, warps: int, stages: int, order: int, tma: bool) -> bytes:
    """The cubin of the gate/up kernel for bf16 activations, as a launch on V4-Flash shapes specialises it (16-byte
    aligned pointers and strides)."""
    kern = moe_mxfp4._mx_gate_up_kernel
    words = f"tensordesc<i32[{block_n}, {block_k // 8}]>" if tma else "*i32"
    sig = dict(x_ptr="*bf16", w1_ptr=words, s1_ptr="*u8", w3_ptr=words, s3_ptr="*u8", rw_ptr="*fp32",
               slots_ptr="*i32", bexp_ptr="*i32", h_ptr="*bf16", TK="i32", E="i32", N="i32", KH="i32",
               stride_xm="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_hm="i32",
               limit="fp32")  # fmt: skip
    const = dict(TOPK=6, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=True, FAST=True, ORDER=order,
                 TMA=tma, SWAP=block_m >= 64, PRECISION="tf32", DT=tl.bfloat16, SALIGN=16, PDL=True)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    names = kern.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in sig if sig[k].startswith("*") or k in _ALIGNED}
    src = ASTSource(kern, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return compiled.asm["cubin"]


def loop_opcodes(cubin: bytes) -> collections.Counter:
    """Opcodes of the longest loop (the region of the longest backward branch) of the cubin's SASS."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = []  # (start, end) of every backward branch
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))

    def mma(loop: tuple[int, int]) -> int:
        return sum(1 for addr, op, _ in ins if loop[0] <= addr <= loop[1] and op.split(".")[0] in ("HMMA", "HGMMA"))

    # the K loop: the most MMA instructions, and of those regions the shortest (a barrier's retry branch placed
    # after the epilogue spans the epilogue too)
    loop = min(loops, key=lambda lp: (-mma(lp), lp[1] - lp[0]))
    return collections.Counter(op.split(".")[0] for addr, op, _ in ins if loop[0] <= addr <= loop[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["16,64,128,2,3", "16,128,128,4,3", "128,128,128,8,3"],
                    help="block_m,block_n,block_k,num_warps,num_stages")  # fmt: skip
    add_common_args(ap, out_help="write the counts (JSON and markdown) here")
    args = ap.parse_args()
    if args.tiny:  # the first config alone: four compiles for sm_90, a few seconds
        args.configs = args.configs[:1]
    table = ["| config | decode | instructions a trip (a warp) | warp instructions a 1k weights | top opcodes |",
             "|---|---|---:|---:|---|"]  # fmt: skip
    print("\n".join(table))
    rows = []
    for cfg in args.configs:
        bm, bn, bk, nw, ns = (int(v) for v in cfg.split(","))
        for name, (order, tma) in VARIANTS.items():
            got, c = [], (bm, bn, bk, nw, ns, order, tma)
            secs = timed(lambda c=c, got=got: got.append(compile_sm90(*c)), "cpu")  # the compile's seconds
            ops = loop_opcodes(got[0])
            n = sum(ops.values())
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            per_k = 1000 * n * nw / (2 * bn * bk)
            rows.append({"config": cfg, "decode": name, "instructions": n, "warp_instructions_per_1k_weights": per_k,
                         "opcodes": dict(ops.most_common()), "compile_s": secs})  # fmt: skip
            table.append(f"| {cfg} | {name} | {n} | {per_k:.1f} | {top} |")
            print(table[-1], flush=True)
    if args.out:
        res = {**result_header(torch.device("cpu"), args), "target": "sm_90", "rows": rows}
        save_result(args.out, f"{res['date']}-moe-sass", res, table)


if __name__ == "__main__":
    main()
