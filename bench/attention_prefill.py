"""The sparse attention of a 4096-token V4-Flash prefill (``kernels.attention``'s unsplit kernel) under several tile
configurations, interleaved in one run, beside the FLOP roofline and the time to read each query's key rows once.

Three layer kinds (H = 64 heads, d = 512): SWA (a 128-key window), HCA (the window and every 128th-token compressed
row: 32 at 4096 tokens), CSA (the window and the indexer's top 512 of the 1024 4-token compressed rows, random
here). Each query's list: its window keys, then its compressed keys; ``count`` as causality allows. A configuration
is ``(BLOCK_H, BLOCK_N, warps, stages)``: ``narrow`` and ``wide`` are the kernel's two unsplit modes, ``gluon`` the
wide tiles as a Gluon kernel (``kernels.attention_wgmma``; its time includes a copy of the output), the rest
candidates; last, each configuration's total over the sweep's four layers (SWA, SWA, CSA, HCA).

    PYTHONPATH=libs python3 bench/attention_prefill.py --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "libs") not in sys.path:
    sys.path.insert(0, str(ROOT / "libs"))

from cuda_timing import per_call_us  # noqa: E402

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
    ap.add_argument("--bf16-tflops", type=float, default=798.0, help="measured dense bf16 peak (bench/sweep.py)")
    ap.add_argument("--hbm-tbs", type=float, default=4.0, help="measured copy bandwidth, TB/s")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev, n = "cuda", args.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for kind in args.kinds.split(","):
        idx, count, pool = lists(n, kind, g, dev)
        q = torch.randn(n, H, D, generator=g, device=dev).bfloat16()
        keys = torch.randn(pool, D, generator=g, device=dev).bfloat16()
        sink = torch.randn(H, generator=g, device=dev)
        scale = D**-0.5
        pairs = int(count.sum())
        roof_us = 4 * pairs * H * D / (args.bf16_tflops * 1e12) * 1e6
        read_us = pairs * D * 2 / (args.hbm_tbs * 1e12) * 1e6
        ref = torch.empty(n, H, D, dtype=torch.bfloat16, device=dev)
        run_config(CONFIGS["narrow"], q, keys, idx, count, sink, scale, ref)
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
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention-prefill.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            command=" ".join(sys.argv), rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
