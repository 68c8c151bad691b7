"""The small kernels of a decode step against the torch code they replace, on one GPU, under CUDA graphs.

Each row times the old path (the peer: the torch ops the model ran before) and the kernel on the same inputs,
interleaved in one process, beside the HBM roofline of the bytes the kernel must read, and checks the results:

* ``group_pool``: a compressor's group pooling by index (``kernels/group_pool.py``) against the gathers, ``where``,
  ``cat`` and softmax of ``ReferenceOps.group_pool``; half the rows complete a group (``live``);
* ``attention``: ``sparse_attention_gather`` split over the key list (``kernels/attention_split.py``) against the
  unsplit kernel, H = 64 heads of 512, bf16, random key rows;
* ``select_rows``: the indexer's top-k (k = 512) by ``NvidiaOps`` against ``ReferenceOps`` (two stable sorts);
* ``hc_mixes``: the mHC mixes GEMM from bf16 streams (``kernels/hc_mixes.py``) against ``h.float() @ fnᵀ``;
* ``small_mm``: decode's bf16 GEMMs with fp32 output (``kernels/small_gemm.py``: one launch, in-kernel split-K)
  against ``torch.mm(x, w.t(), out_dtype=torch.float32)`` (cuBLAS: a split-K GEMM and its reduction), at the
  routers', compressors' and mHC mixes' widths of V4-Flash and V4.1-Flash, M = 1, 16, 64.

    PYTHONPATH=libs:tests:bench python3 bench/decode_kernels.py [--out DIR] [--only small_mm,hc_mixes]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "libs", ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def us(fn) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=100)


def row(kernel: str, case: str, peer, ours, nbytes: float, bw: float, **extra) -> dict:
    """One result: the peer's and our time (µs, CUDA graphs) and the roofline of ``nbytes`` at ``bw``."""
    return {"kernel": kernel, "case": case, "peer_us": us(peer), "us": us(ours), "roofline_us": 1e6 * nbytes / bw,
            **extra}  # fmt: skip


def hbm_bw(dev: torch.device) -> float:
    """Measured copy bandwidth (read + write bytes / s) of a 1 GiB copy."""
    a = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    t = us(lambda: b.copy_(a)) * 1e-6
    return 2 * a.numel() * 4 / t


def group_pool_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.group_pool import group_pool
    from deepinfer.ops.reference import ReferenceOps

    ref, rows = ReferenceOps(), []
    for name, ov, m, d in (("HCA", False, 128, 512), ("CSA", True, 4, 512)):
        for s in (1, 64, 256):
            c, cap, dev = d * (1 + ov), 2 * m, "cuda"
            kv, sc = torch.randn(s * cap, c, device=dev), torch.randn(s * cap, c, device=dev)
            j, base = torch.arange(m, device=dev), torch.arange(s, device=dev)[:, None] * cap
            cur, prev = base + m + j, (base + j if ov else None)
            hp, live = torch.ones(s, dtype=torch.bool, device=dev), torch.arange(s, device=dev) % 2 == 0
            a = (kv, sc, cur, prev, hp, live, d)
            err = (group_pool(*a) - ref.group_pool(*a)).abs().max().item()
            live_rows = int(live.sum())
            nbytes = live_rows * (2 * m if ov else m) * d * 4 * 2  # kv and score of the live groups
            case = f"{name} m={m} d={d} S={s} (half live)"
            rows.append(row("group_pool", case, lambda a=a: ref.group_pool(*a), lambda a=a: group_pool(*a), nbytes,
                            bw, max_abs_diff=err))  # fmt: skip
    return rows


def attention_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.attention import sparse_attention_gather as attend

    torch.manual_seed(0)
    k_rows, h, d, rows = 65536, 64, 512, []
    keys = torch.randn(k_rows, d, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(h, device="cuda")
    for w in (640, 1152):
        for n in (1, 16, 64):
            q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
            idx = torch.randint(0, k_rows, (n, w), device="cuda", dtype=torch.int32)
            cnt = torch.full((n,), w, device="cuda", dtype=torch.int32)

            def run(split, q=q, idx=idx, cnt=cnt):
                return attend(q, keys, idx, cnt, sink, d**-0.5, split=split)

            err = (run(True).float() - run(False).float()).abs().max().item()
            nbytes = n * w * d * 2 + n * h * d * 2 * 2
            case = f"n={n} W={w} H={h} d={d} bf16"
            rows.append(row("attention", case, lambda r=run: r(False), lambda r=run: r(True), nbytes, bw,
                            max_abs_diff=err))  # fmt: skip
    return rows


def select_rows_rows(bw: float) -> list[dict]:
    from deepinfer.ops.nvidia import NvidiaOps
    from deepinfer.ops.reference import ReferenceOps

    ref, ours, rows = ReferenceOps("nvidia"), NvidiaOps(), []
    for n in (1, 64, 256):
        for w in (1280, 5120, 32768):
            vis = torch.arange(w, device="cuda") < torch.randint(w // 2, w + 1, (n, 1), device="cuda")
            s = torch.randn(n, w, device="cuda").masked_fill(~vis, float("-inf"))
            a, b = ref.select_rows(s, vis, 512), ours.select_rows(s, vis, 512)
            valid = enumerate(a[1].tolist())
            same = torch.equal(a[1], b[1]) and all(torch.equal(a[0][i, :c], b[0][i, :c]) for i, c in valid)
            rows.append(row("select_rows", f"n={n} W={w} k=512", lambda s=s, v=vis: ref.select_rows(s, v, 512),
                            lambda s=s, v=vis: ours.select_rows(s, v, 512), n * w * 5, bw, same=same))  # fmt: skip
    return rows


def hc_mixes_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.hc_mixes import mixes_gemm as fn_mixes

    rows = []
    fn = torch.randn(24, 16384, device="cuda")
    for t in (1, 64, 256, 4096):
        h = torch.randn(t, 4, 4096, device="cuda", dtype=torch.bfloat16)

        def old(h=h):
            return torch.mm(h.flatten(1).float(), fn.t())

        err = (fn_mixes(h, fn) - old()).abs().max().item()
        nbytes = h.numel() * 2 + fn.numel() * 4
        rows.append(row("hc_mixes", f"T={t} h bf16 [T, 4, 4096], fn [24, 16384]", old,
                        lambda h=h: fn_mixes(h, fn), nbytes, bw, max_abs_diff=err))  # fmt: skip
    return rows


def small_mm_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.small_gemm import plan, small_mm_fp32

    torch.manual_seed(0)
    shapes = [("V4 router / indexer compressor", 4096, 256), ("V4 CSA compressor", 4096, 1024),
              ("V4 HCA compressor", 4096, 512), ("V4 mHC mixes (3 parts)", 16384, 72),
              ("V4 head mixes (3 parts)", 16384, 12), ("V4.1 router", 5120, 384),
              ("V4.1 mHC mixes (3 parts)", 20480, 72)]  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device="cuda").bfloat16()
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda").bfloat16()

            def peer(x=x, w=w):
                return torch.mm(x, w.t(), out_dtype=torch.float32)

            def ours(x=x, w=w):
                return small_mm_fp32(x, w)

            got = ours()
            err = (got - peer()).abs().max().item()
            nbytes = (n + m) * k * 2 + m * n * 4
            _, s, _ = plan(m, n, k, sms)
            rows.append(row("small_mm", f"{name} M={m} K={k} N={n} S={s}", peer, ours, nbytes, bw,
                            max_abs_diff=err, same=torch.equal(got, ours())))  # fmt: skip
    return rows


PARTS = {"group_pool": group_pool_rows, "attention": attention_rows, "select_rows": select_rows_rows,
         "hc_mixes": hc_mixes_rows, "small_mm": small_mm_rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated cases of {', '.join(PARTS)}")
    a = ap.parse_args()
    dev = torch.device("cuda")
    bw = hbm_bw(dev)
    rows = []
    for part in (PARTS[p] for p in a.only.split(",")):
        got = part(bw)
        rows += got
        for r in got:
            extra = " ".join(([f"diff {r['max_abs_diff']:.1e}"] if "max_abs_diff" in r else [])
                             + ([f"same {r['same']}"] if "same" in r else []))  # fmt: skip
            print(f"{r['kernel']:12s} {r['case']:44s} peer {r['peer_us']:8.1f} us  ours {r['us']:8.1f} us  "
                  f"roofline {r['roofline_us']:7.1f} us  {extra}", flush=True)  # fmt: skip
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / f"decode-kernels-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
        meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "copy_GBps": bw / 1e9,
                "command": " ".join(sys.argv)}  # fmt: skip
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
