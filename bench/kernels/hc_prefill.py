"""The mHC kernels and the stream embedding of a prefill, one GPU: ``hc_expand``, ``hc_pre``'s kernel (the mixes
given) and ``embed_streams``' copy, at V4-Flash widths (``D`` 4096, 4 streams, bf16) and ``--tokens`` tokens, for each
launch configuration asked, beside the HBM roofline of the bytes each must move (read and write once, at the copy
bandwidth measured in the same run) and the peer (``ReferenceOps``' torch ops on the same device).

    PYTHONPATH=libs:. python3 bench/kernels/hc_prefill.py --tokens 4096 [--expand 512:4,2048:8] [--pre 1024:4,2048:8]
    PYTHONPATH=libs:. python3 bench/kernels/hc_prefill.py --tiny --device cpu   # smoke: 16 tokens, interpreter

Prints one line per variant (µs per call from CUDA events over back-to-back calls); the default configuration is the
first of each list (expand: the block of more than ``hc.SMALL_T`` tokens).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.harness import (
    add_common_args,
    copy_gbps,
    interpret_if_cpu,
    per_call_us,
    pick_device,
    result_header,
    write_json,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import hc  # noqa: E402


def configs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--expand", default="2048:4,512:4,1024:4,1024:8,2048:8", help="BLOCK_D:warps of hc_expand")
    ap.add_argument("--pre", default="1024:4,1024:8,2048:4,2048:8,4096:8", help="BLOCK_D:warps of hc_pre's kernel")
    ap.add_argument("--calls", type=int, default=50)
    add_common_args(ap)
    args = ap.parse_args()
    dev = pick_device(args)
    vocab = 129280
    if args.tiny:  # the interpreter's bf16 math is wrong: fp32 on the CPU
        args.tokens, args.dim, args.calls, vocab = 16, 256, 1, 1000
        args.expand, args.pre = args.expand.split(",")[0], args.pre.split(",")[0]
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    t, n, d = args.tokens, args.streams, args.dim
    gbps = copy_gbps(dev, numel=1 << 20 if args.tiny else 1 << 29)
    g = torch.Generator(device=dev).manual_seed(0)
    res = torch.randn(t, n, d, device=dev, generator=g).to(dtype)
    y = torch.randn(t, d, device=dev, generator=g).to(dtype)
    rows = []
    post = torch.rand(t, n, device=dev, generator=g) * 2
    comb = torch.rand(t, n, n, device=dev, generator=g)
    ref = ReferenceOps()
    print(f"T={t} D={d} N={n}, copy bandwidth {gbps:.0f} GB/s")

    def line(name: str, us: float, nbytes: int) -> None:
        roof = nbytes / gbps / 1e3
        rows.append({"name": name, "us": us, "roofline_us": roof})
        print(f"  {name:<34} {us:8.1f} µs   roofline {roof:6.1f} µs   x{us / roof:5.2f}")

    # hc_expand: reads y and the streams, writes the streams
    expand_bytes = (t * d + 2 * t * n * d) * 2
    want = ref.hc_expand(y, res, post, comb)
    line("hc_expand peer (torch)", per_call_us(lambda: ref.hc_expand(y, res, post, comb), args.calls), expand_bytes)
    saved = hc.EXPAND_BLOCK_D, hc.EXPAND_WIDE_BLOCK_D, hc.EXPAND_WARPS
    for block, warps in configs(args.expand):
        hc.EXPAND_BLOCK_D = hc.EXPAND_WIDE_BLOCK_D = block
        hc.EXPAND_WARPS = warps
        got = hc.hc_expand(y, res, post, comb)
        err = (got.float() - want.float()).abs().max().item()
        us = per_call_us(lambda: hc.hc_expand(y, res, post, comb), args.calls)
        line(f"hc_expand {block}:{warps} (max err {err:.1e})", us, expand_bytes)
    hc.EXPAND_BLOCK_D, hc.EXPAND_WIDE_BLOCK_D, hc.EXPAND_WARPS = saved

    # hc_pre's kernel on given mixes: reads the streams (twice: the norm, then the collapse), writes x
    m = 2 * n + n * n
    fn = torch.randn(m, n * d, device=dev, generator=g) * 0.02
    scale, base = torch.rand(3, device=dev), torch.randn(m, device=dev) * 0.1
    mixes = torch.mm(res.view(t, n * d).float(), fn.t()).contiguous()
    pre_bytes = (t * n * d + t * d) * 2
    call = (res, mixes, 1, m, scale, base, 20, 1e-6, 1e-6, True)
    want_x = hc._from_mixes(*call)[0]
    saved = hc.HC_BLOCK_D, hc.HC_WARPS
    for block, warps in configs(args.pre):
        hc.HC_BLOCK_D, hc.HC_WARPS = block, warps
        x = hc._from_mixes(*call)[0]
        err = (x.float() - want_x.float()).abs().max().item()
        us = per_call_us(lambda: hc._from_mixes(*call), args.calls)
        line(f"hc_pre kernel {block}:{warps} (diff {err:.1e})", us, pre_bytes)
    hc.HC_BLOCK_D, hc.HC_WARPS = saved

    # embed_streams: [T] ids -> [T, N, D] copies of their rows
    weight = torch.randn(vocab, d, device=dev, generator=g).to(dtype)
    ids = torch.randint(0, vocab, (t,), device=dev, generator=g)
    emb_bytes = 2 * t * n * d * 2

    def broadcast() -> torch.Tensor:
        return F.embedding(ids, weight).unsqueeze(1).expand(-1, n, -1).contiguous()

    def gather() -> torch.Tensor:
        return F.embedding(ids.unsqueeze(1).expand(-1, n), weight)

    same = torch.equal(broadcast(), gather())
    line("embed: rows, then a broadcast copy", per_call_us(broadcast, args.calls), emb_bytes)
    line(f"embed: one gather (equal: {same})", per_call_us(gather, args.calls), emb_bytes)
    if args.out:
        head = result_header(dev, args)
        write_json(args.out / f"{head['date']}-hc-prefill.json", {**head, "copy_GBps": gbps, "rows": rows})


if __name__ == "__main__":
    main()
