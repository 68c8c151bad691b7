"""The sparse attention of a 4096-token V4-Flash prefill (``kernels.attention``'s unsplit kernel) under several tile
configurations, interleaved in one run, beside the FLOP roofline and the time to read each query's key rows once.

Three layer kinds (H = 64 heads, d = 512): SWA (a 128-key window), HCA (the window and every 128th-token compressed
row: 32 at 4096 tokens), CSA (the window and the indexer's top 512 of the 1024 4-token compressed rows, random
here). Each query's list: its window keys, then its compressed keys; ``count`` as causality allows. A configuration
is ``(BLOCK_H, BLOCK_N, warps, stages)``: ``narrow`` and ``wide`` are the kernel's two unsplit modes, ``gluon`` the
wide tiles as a Gluon kernel (``kernels.attention_wgmma``; its time includes a copy of the output), the rest
candidates; last, each configuration's total over the sweep's four layers (SWA, SWA, CSA, HCA).

    PYTHONPATH=libs:. python3 bench/kernels/attention_prefill.py --tokens 4096 [--out DIR]
    PYTHONPATH=libs:. python3 bench/kernels/attention_prefill.py --tiny --device cpu   # smoke: interpreter, fp32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from bench.harness import interpret_if_cpu, per_call_us, pick_device, result_header, write_json

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

from deepinfer.kernels import attention as attn  # noqa: E402
from deepinfer.kernels import attention_wgmma  # noqa: E402

H, D, WINDOW, TOPK = 64, 512, 128, 512
CONFIGS = {  # (BLOCK_H, BLOCK_N, warps, stages)
    "narrow": (attn.ATTN_BLOCK_H, attn.ATTN_BLOCK_N, attn.ATTN_NUM_WARPS, attn.ATTN_NUM_STAGES),
    "wide": tuple(attn.ATTN_WIDE[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")),
    "h32n32w4": (32, 32, 4, 2),
    "h32n64w4": (32, 64, 4, 2),
    "h64n32w8": (64, 32, 8, 2),
    "h64n64w8s3": (64, 64, 8, 3),
    "h64n64w16": (64, 64, 16, 2),
    "gluon": "gluon",  # kernels.attention_wgmma (the wide tiles in Gluon; sm_90)
}
STACK = ("swa", "swa", "csa", "hca")  # the sweep's four layers


def lists(n: int, kind: str, g: torch.Generator, dev: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``idx [n, W]``, ``count [n]`` and the pool size for one layer kind (module docstring)."""
    i = torch.arange(n, device=dev)
    nwin = (i + 1).clamp_max(WINDOW)
    # window keys first, oldest first: rows i - nwin + 1 .. i (the tail past nwin is never read)
    win = (i[:, None] - nwin[:, None] + 1 + torch.arange(WINDOW, device=dev)[None, :]).clamp(0, n - 1)
    if kind == "swa":
        return win, nwin, n
    ratio = 128 if kind == "hca" else 4
    ncomp = n // ratio
    visible = ((i + 1) // ratio).clamp_max(ncomp)
    if kind == "hca":
        comp = torch.arange(ncomp, device=dev)[None, :].expand(n, ncomp)
        take = visible
    else:
        score = torch.rand(n, ncomp, generator=g, device=dev)
        score = score.masked_fill(torch.arange(ncomp, device=dev)[None, :] >= visible[:, None], -1.0)
        comp = score.topk(min(TOPK, ncomp), dim=1).indices
        take = visible.clamp_max(TOPK)
    idx = torch.zeros(n, WINDOW + comp.shape[1], dtype=torch.int32, device=dev)
    j = torch.arange(idx.shape[1], device=dev)[None, :]
    # per row: its nwin window keys, then its `take` compressed keys (pool rows n ..)
    wpart = torch.gather(win, 1, j.clamp_max(WINDOW - 1).expand(n, -1))
    cpart = torch.gather(comp + n, 1, (j - nwin[:, None]).clamp(0, comp.shape[1] - 1))
    idx = torch.where(j < nwin[:, None], wpart, cpart).to(torch.int32)
    return idx, nwin + take, n + ncomp


def run_config(cfg, q, keys, idx, count, sink, scale, out):
    if cfg == "gluon":
        got = attention_wgmma.sparse_attention_wgmma(q, keys, keys, keys, 1, False, idx, count, sink, scale)
        if got is None:
            raise RuntimeError("the Gluon build failed (logged)")
        out.copy_(got)
        return
    bh, bn, warps, stages = cfg
    grid = (q.shape[0], triton.cdiv(H, bh))
    attn._sparse_attention_kernel[grid](
        q, keys, keys, keys, keys.shape[0], 1, idx, count, sink, out, idx.shape[1], scale,
        H=H, D=D, BLOCK_D=D, BLOCK_H=bh, BLOCK_N=bn, PRECISION="tf32", PAGED=False,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--kinds", default="swa,hca,csa")
    ap.add_argument("--bf16-tflops", type=float, default=798.0, help="measured dense bf16 peak (bench/engine/sweep.py)")
    ap.add_argument("--hbm-tbs", type=float, default=4.0, help="measured copy bandwidth, TB/s")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 160 tokens, two configurations, one call")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    args = ap.parse_args()
    dev = pick_device(args)
    if args.tiny:
        args.tokens, args.calls, args.configs = 160, 1, "narrow,wide"
    n = args.tokens
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16  # the interpreter's bf16 math is wrong
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for kind in args.kinds.split(","):
        idx, count, pool = lists(n, kind, g, dev)
        q = torch.randn(n, H, D, generator=g, device=dev).to(dtype)
        keys = torch.randn(pool, D, generator=g, device=dev).to(dtype)
        sink = torch.randn(H, generator=g, device=dev)
        scale = D**-0.5
        pairs = int(count.sum())
        roof_us = 4 * pairs * H * D / (args.bf16_tflops * 1e12) * 1e6
        read_us = pairs * D * 2 / (args.hbm_tbs * 1e12) * 1e6
        ref = torch.empty(n, H, D, dtype=dtype, device=dev)
        try:
            run_config(CONFIGS["narrow"], q, keys, idx, count, sink, scale, ref)
        except Exception as e:  # noqa: BLE001 - the interpreter cannot run every kernel: say so, keep the row
            rows.append(dict(kind=kind, config="narrow", us=None, note=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"{kind}: the reference tiles did not run on {dev}: {rows[-1]['note']}", flush=True)
            continue
        for name in args.configs.split(","):
            out = torch.empty_like(ref)
            try:
                args_ = (CONFIGS[name], q, keys, idx, count, sink, scale, out)
                us = min(per_call_us(lambda a=args_: run_config(*a), args.calls) for _ in range(2))
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                same = bool(torch.equal(out, ref))
            except Exception as e:  # noqa: BLE001 - one config failing must not lose the rest
                us, err, same = None, None, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(dict(kind=kind, config=name, tiles=CONFIGS[name], us=us, rel_err=err, identical=same,
                             roofline_us=roof_us, key_read_us=read_us))  # fmt: skip
            print(f"{kind} {name:14s} {'-' if us is None else round(us):>6} µs  FLOP roofline {roof_us:.0f}  "
                  f"key rows once {read_us:.0f}  err {err}  identical {same}", flush=True)  # fmt: skip
    for name in args.configs.split(","):
        us = {r["kind"]: r["us"] for r in rows if r["config"] == name}
        if all(us.get(k) is not None for k in STACK):
            print(f"four layers {name:14s} {sum(us[k] for k in STACK):.0f} µs", flush=True)
    if args.out:
        write_json(args.out / "attention-prefill.json", {**result_header(dev, args), "rows": rows})


if __name__ == "__main__":
    main()
