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

    PYTHONPATH=libs:. python3 bench/kernels/decode_kernels.py [--out DIR] [--only small_mm,hc_mixes]
    PYTHONPATH=libs:. python3 bench/kernels/decode_kernels.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode runs every part at tiny shapes (32-wide rows, a few of them, fp32 where the kernel takes it) with the
kernels in Triton's interpreter, each timed once eagerly on the host's clock, beside the roofline at the host's copy
bandwidth; CUDA graphs (``do_bench_cudagraph``) are skipped there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.harness import add_common_args, device_name, interpret_if_cpu, median_ms, note_skipped, pick_device

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before triton and the kernels are imported

from triton.testing import do_bench_cudagraph  # noqa: E402

# the device the parts run on and whether at the smoke mode's tiny shapes (main sets them)
DEV, TINY = "cuda", False


def us(fn) -> float:
    if DEV != "cuda":  # the smoke mode: one eager call after a warm-up, the host's clock
        return 1e3 * median_ms(fn, DEV, repeats=1)
    return 1e3 * do_bench_cudagraph(fn, rep=100)


def fdt() -> torch.dtype:
    """bf16 on a GPU; fp32 in the interpreter (its bf16 math is wrong)."""
    return torch.bfloat16 if DEV == "cuda" else torch.float32


def row(kernel: str, case: str, peer, ours, nbytes: float, bw: float, **extra) -> dict:
    """One result: the peer's and our time (µs, CUDA graphs) and the roofline of ``nbytes`` at ``bw``."""
    return {"kernel": kernel, "case": case, "peer_us": us(peer), "us": us(ours), "roofline_us": 1e6 * nbytes / bw,
            **extra}  # fmt: skip


def hbm_bw(dev: torch.device) -> float:
    """Measured copy bandwidth (read + write bytes / s) of a 1 GiB copy."""
    a = torch.empty(1 << (16 if TINY else 28), dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    t = us(lambda: b.copy_(a)) * 1e-6
    return 2 * a.numel() * 4 / t


def group_pool_rows(bw: float) -> list[dict]:
    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.kernels.group_pool import group_pool

    ref, rows = ReferenceOps(), []
    kinds = (("HCA", False, 8, 32), ("CSA", True, 4, 32)) if TINY else (("HCA", False, 128, 512), ("CSA", True, 4, 512))
    for name, ov, m, d in kinds:
        for s in (1, 2) if TINY else (1, 64, 256):
            c, cap, dev = d * (1 + ov), 2 * m, DEV
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
    k_rows, h, d, rows = (64, 4, 32, []) if TINY else (65536, 64, 512, [])
    keys = torch.randn(k_rows, d, device=DEV, dtype=fdt())
    sink = torch.randn(h, device=DEV)
    for w in (40,) if TINY else (640, 1152):
        for n in (1, 2) if TINY else (1, 16, 64):
            q = torch.randn(n, h, d, device=DEV, dtype=fdt())
            idx = torch.randint(0, k_rows, (n, w), device=DEV, dtype=torch.int32)
            cnt = torch.full((n,), w, device=DEV, dtype=torch.int32)

            def run(split, q=q, idx=idx, cnt=cnt):
                return attend(q, keys, idx, cnt, sink, d**-0.5, split=split)

            err = (run(True).float() - run(False).float()).abs().max().item()
            nbytes = n * w * d * 2 + n * h * d * 2 * 2
            case = f"n={n} W={w} H={h} d={d} {str(fdt())[6:]}"
            rows.append(row("attention", case, lambda r=run: r(False), lambda r=run: r(True), nbytes, bw,
                            max_abs_diff=err))  # fmt: skip
    return rows


def select_rows_rows(bw: float) -> list[dict]:
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.backends.reference import ReferenceOps

    ref, ours, rows = ReferenceOps("nvidia"), NvidiaOps(), []
    k = 16 if TINY else 512
    if DEV != "cuda":
        ours.select_backend = "kernel"  # auto takes the Triton top-k for CUDA scores only
    for n in (1, 2) if TINY else (1, 64, 256):
        for w in (64,) if TINY else (1280, 5120, 32768):
            vis = torch.arange(w, device=DEV) < torch.randint(w // 2, w + 1, (n, 1), device=DEV)
            s = torch.randn(n, w, device=DEV).masked_fill(~vis, float("-inf"))
            a, b = ref.select_rows(s, vis, k), ours.select_rows(s, vis, k)
            valid = enumerate(a[1].tolist())
            same = torch.equal(a[1], b[1]) and all(torch.equal(a[0][i, :c], b[0][i, :c]) for i, c in valid)
            rows.append(row("select_rows", f"n={n} W={w} k={k}", lambda s=s, v=vis: ref.select_rows(s, v, k),
                            lambda s=s, v=vis: ours.select_rows(s, v, k), n * w * 5, bw, same=same))  # fmt: skip
    return rows


def hc_mixes_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.hc_mixes import mixes_gemm as fn_mixes

    rows = []
    d = 32 if TINY else 4096
    fn = torch.randn(24, 4 * d, device=DEV)
    for t in (1, 4) if TINY else (1, 64, 256, 4096):
        h = torch.randn(t, 4, d, device=DEV, dtype=fdt())

        def old(h=h):
            return torch.mm(h.flatten(1).float(), fn.t())

        err = (fn_mixes(h, fn) - old()).abs().max().item()
        nbytes = h.numel() * 2 + fn.numel() * 4
        rows.append(row("hc_mixes", f"T={t} h {str(fdt())[6:]} [T, 4, {d}], fn [24, {4 * d}]", old,
                        lambda h=h: fn_mixes(h, fn), nbytes, bw, max_abs_diff=err))  # fmt: skip
    return rows


def small_mm_rows(bw: float) -> list[dict]:
    from deepinfer.kernels.small_gemm import plan, small_mm_fp32

    torch.manual_seed(0)
    shapes = [("V4 router / indexer compressor", 4096, 256), ("V4 CSA compressor", 4096, 1024),
              ("V4 HCA compressor", 4096, 512), ("V4 mHC mixes (3 parts)", 16384, 72),
              ("V4 head mixes (3 parts)", 16384, 12), ("V4.1 router", 5120, 384),
              ("V4.1 mHC mixes (3 parts)", 20480, 72)]  # fmt: skip
    if TINY:
        shapes = [("tiny router", 256, 32)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device=DEV).bfloat16()  # the kernel takes bf16 / fp16 (fp32 accumulation)
        for m in (1, 4) if TINY else (1, 16, 64):
            x = torch.randn(m, k, device=DEV).bfloat16()

            def peer(x=x, w=w):
                if DEV != "cuda":  # no bf16 -> fp32 mm on the CPU: the same products in fp32
                    return torch.mm(x.float(), w.float().t())
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
    global DEV, TINY
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated cases of {', '.join(PARTS)}")
    a = ap.parse_args()
    dev = pick_device(a)
    DEV, TINY = dev.type, a.tiny
    if dev.type != "cuda":
        note_skipped({"CUDA graphs": "each case is timed eagerly on the host's clock, the kernels interpreted"})
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
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else device_name(dev)
        meta = {"gpu": gpu, "torch": torch.__version__, "copy_GBps": bw / 1e9,
                "command": " ".join(sys.argv)}  # fmt: skip
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
