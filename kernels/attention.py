"""Batch-invariant Triton kernels for DeepSeek-V4's sparse attention (the lightning indexer's scores are in
``kernels.indexer``).

``deepinfer.ops`` uses these on CUDA (the NVIDIA backend, ``DEEPINFER_BATCH_INVARIANT=1``) in place of the gathered,
padded einsums of ``BatchInvariantOps``; the semantics are those of ``ReferenceOps.sparse_attention``.

* ``sparse_attention_gather``: attention with K = V and a per-head sink logit over a per-query key list. Query ``i``
  attends to ``keys[idx[i, :count[i]]]`` in list order: ``out[i, h] = Σ_j p_j · k_j`` with
  ``p_j = exp(s_j - m) / (Σ_j exp(s_j - m) + exp(sink_h - m))``, ``s_j = scale · q[i, h] · k_j``. One program per
  (query, block of ``ATTN_BLOCK_H`` heads) runs an online softmax (running max seeded with the sink, fp32 running
  denominator and accumulator) over the query's keys in blocks of ``ATTN_BLOCK_N``, from j = 0 upward, each block
  one gather and two ``tl.dot`` of fixed shape. The loop is bounded by ``count[i]``, not by the padded width ``W``.
  For few queries (``split``) the key lists are instead cut at fixed list positions, multiples of
  ``attention_split.SPLIT_CHUNK``, into partials merged in a fixed order (``deepinfer.kernels.attention_split``).
  For many bf16 queries (a prefill, ``wide``) the same kernel runs with wide tiles (``ATTN_WIDE``: every one of 64
  heads in one program, 64 keys a step, 8 warps: the ``tl.dot`` become Hopper's ``wgmma``), so a query's gathered
  key rows are read once for all its heads instead of once per 16 heads. H200, 4096 queries of V4-Flash width
  (``bench/kernels/attention_prefill.py``): 497 against 787 µs for a 128-key window, 1346 against 2160 for CSA's 640
  keys.
  Where ``attention_wgmma.use`` (``attention_wgmma.ENABLED``: ``DEEPINFER_ATTN_PREFILL=gluon``, the default) the wide
  tiles run as a Gluon kernel instead (``kernels.attention_wgmma``).

Why invariant: every output element's reduction order is fixed by constexpr tile sizes (and, for attention, by the
query's own key list), never by the number of queries, the padded width or the other rows. A query's program reads
only its own ``q``, ``idx``, ``count`` rows; a ``tl.dot`` reduces every output lane the same way, and masked heads,
keys and padded ``d`` lanes are exact zeros (keys past ``count``: ``-inf`` logits, ``p = 0``) that touch no other lane.
There is no autotuning, the runtime sizes (``W``, ``R``) are ``do_not_specialize``, so every batch size and padding
width runs the same compiled binary, and the split of the attention over the key list, where on, is at fixed list
positions. Each attention mode (split, narrow or wide tiles) is batch-invariant; the automatic choice between them
(``split=None``) looks at ``n``, so callers that need invariance fix the mode (``split=False``: narrow tiles unless
``wide=True``). The modes round differently (other key blocks, other MMA instructions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import attention_split, attention_wgmma, pdl
from deepinfer.kernels.paged_keys import check_paged, key_rows
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import is_pinned, row_slices

ATTN_BLOCK_H = 16  # heads per program (the smallest tl.dot M)
ATTN_BLOCK_N = 32  # keys per step: a [32, 512] bf16 gathered tile is 32 KB of shared memory
# sm_90, bf16, d=512 (ptxas -v, compiled offline): 234 registers, no spills, 56 KB shared memory, mma.sync
ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
# split=None splits the key lists when n · cdiv(H, ATTN_BLOCK_H) programs would be fewer than this: one wave of a
# 132-SM H200 (for H = 64: n <= 32)
ATTN_SPLIT_MAX_PROGRAMS = 132
ATTN_SPLIT_DEFAULT: bool | None = None  # benchmarks: the mode split=None takes (None: the rule above)
# the narrow tiles (split=False, decode batches): the constants above
ATTN_NARROW = {
    "BLOCK_H": ATTN_BLOCK_H,
    "BLOCK_N": ATTN_BLOCK_N,
    "num_warps": ATTN_NUM_WARPS,
    "num_stages": ATTN_NUM_STAGES,
}
# the wide tiles (module docstring): heads and keys per program, warps, stages; bf16 only (fp32 tiles of this size
# exceed the shared memory). H200, sm_90, d = 512: 255 registers, one program an SM (bench/kernels/attention_prefill.py)
ATTN_WIDE = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
# split=None takes the wide tiles from this many bf16 queries on: two waves of 132 programs (fewer programs than
# SMs would leave the GPU idle; decode batches stay on the narrow tiles)
ATTN_WIDE_MIN_QUERIES = 264

DTYPES = (torch.float32, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["W", "N1", "R"])
def _sparse_attention_kernel(
    q_ptr,
    k_ptr,
    p_ptr,
    pages_ptr,
    N1,
    R,
    idx_ptr,
    count_ptr,
    sink_ptr,
    out_ptr,
    W,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < H
    mask_d = offs_d < D
    hd = offs_h[:, None] * D + offs_d[None, :]
    mask_hd = mask_h[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + row * (H * D) + hd, mask=mask_hd, other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    m = sink  # running max, seeded with the sink: finite, so masked logits give exp(-inf) = 0
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    cnt = tl.load(count_ptr + row)
    cnt = tl.minimum(tl.maximum(cnt, 0), W)
    for start in range(0, cnt, BLOCK_N):
        j = start + offs_n
        valid = j < cnt
        kid = tl.load(idx_ptr + row * W + j, mask=valid, other=0).to(tl.int64)
        at = key_rows(k_ptr, p_ptr, pages_ptr, kid, valid, N1, R, D, PAGED)
        k = tl.load(at[:, None] + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    den += tl.exp(sink - m)
    out = acc / den[:, None]
    tl.store(out_ptr + row * (H * D) + hd, out.to(out_ptr.dtype.element_ty), mask=mask_hd)


def block_pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # bf16 ignores it; fp32 gets true fp32 products (no TF32)


def use_split(n: int, H: int) -> bool:
    """The mode ``sparse_attention_gather(split=None)`` takes for ``n`` queries of ``H`` heads: ``ATTN_SPLIT_DEFAULT``
    if set, else split when the unsplit grid ``n · cdiv(H, ATTN_BLOCK_H)`` is below ``ATTN_SPLIT_MAX_PROGRAMS``."""
    if ATTN_SPLIT_DEFAULT is not None:
        return ATTN_SPLIT_DEFAULT
    return n * triton.cdiv(H, ATTN_BLOCK_H) < ATTN_SPLIT_MAX_PROGRAMS


def use_wide(n: int, dtype: torch.dtype) -> bool:
    """Whether ``sparse_attention_gather(split=None)``, not splitting, takes the wide tiles: ``n`` bf16 queries, at
    least ``ATTN_WIDE_MIN_QUERIES``."""
    return dtype == torch.bfloat16 and n >= ATTN_WIDE_MIN_QUERIES


def sparse_attention_gather(
    q: torch.Tensor,
    keys: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    split: bool | None = None,
    wide: bool | None = None,
    paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse attention with K = V and a per-head sink over gathered key lists → ``[n, H, d]`` in ``q.dtype``,
    written into ``out`` when given (contiguous, ``q``'s shape and dtype, not overlapping the inputs) and returned.

    ``q [n, H, d]`` and ``keys [K, d]`` are both float32 or both bfloat16; ``idx [n, W]`` (int32/int64) lists, in
    order, the key rows query ``i`` attends to, of which the first ``count[i]`` (``count [n]`` int32/int64, clamped
    to ``[0, W]``) are used and the rest never read; ``sink [H]`` is a per-head logit in the denominator with no
    value. Valid ``idx`` entries must be in ``[0, K)`` (not checked: that would sync the host). A query with
    ``count == 0`` gets zeros. Accumulation is fp32; fp32 inputs use IEEE fp32 products.

    ``split``: ``False``, one program per (query, head block) walks the whole list; ``True``, the lists are cut into
    splits of ``attention_split.SPLIT_CHUNK`` entries at fixed list positions, one program each, their fp32 partials
    merged in split order (more parallelism for few queries; other rounding when ``count > SPLIT_CHUNK``); ``None``
    (default), ``use_split(n, H)`` picks from ``n`` and ``H`` only, and an unsplit call takes the wide tiles where
    ``use_wide(n, dtype)``. ``wide``: the unsplit kernel's tiles, ``ATTN_WIDE`` (``True``) or the narrow
    ``ATTN_BLOCK_H`` × ``ATTN_BLOCK_N`` (``False``; ``None``: narrow with ``split=False``, the rule with
    ``split=None``); ``split=True, wide=True`` is an error. In each fixed mode query ``i``'s output depends only on
    ``q[i]``, its valid key list, ``keys``, ``sink`` and ``scale``: not on ``n``, ``W`` nor the other queries. With
    ``None`` the mode, hence the rounding, may change with ``n``: batch-invariant callers pass ``split=False``. No
    mode reads ``count`` on the host (capturable in CUDA graphs).

    ``paged = (store [P, R, d], pages [M])``: keys ``K ..< K + M·R`` are read from the store through the page list,
    key ``K + j`` being row ``j % R`` of page ``pages[j // R]`` (``kernels.paged_keys``), as if ``gathered(keys,
    paged)`` were the keys: no copy of the paged rows is made.
    """
    if q.dtype not in DTYPES or keys.dtype != q.dtype:
        raise ValueError(
            f"sparse_attention_gather: q and keys must both be float32 or both bfloat16, got {q.dtype} and {keys.dtype}"
        )
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(
            "sparse_attention_gather: expected q [n, H, d] and keys [K, d], "
            f"got {tuple(q.shape)} and {tuple(keys.shape)}"
        )
    n, H, d = q.shape
    if idx.dim() != 2 or idx.shape[0] != n or idx.dtype not in INT_DTYPES:
        raise ValueError(
            f"sparse_attention_gather: idx must be int32/int64 [{n}, W], got {idx.dtype} {tuple(idx.shape)}"
        )
    if count.shape != (n,) or count.dtype not in INT_DTYPES:
        raise ValueError(
            f"sparse_attention_gather: count must be int32/int64 [{n}], got {count.dtype} {tuple(count.shape)}"
        )
    if sink.shape != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_attention_gather: sink must be float32 [{H}], got {sink.dtype} {tuple(sink.shape)}")
    devices = {t.device for t in (q, keys, idx, count, sink)}
    if len(devices) != 1:
        raise ValueError(f"sparse_attention_gather: all tensors must be on one device, got {sorted(map(str, devices))}")
    if split and wide:
        raise ValueError("sparse_attention_gather: split=True takes the narrow tiles (wide=True is unsplit only)")
    W = idx.shape[1]
    store, pages, rows_per_page, is_paged = check_paged(keys, paged)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
        raise ValueError(
            f"sparse_attention_gather: out must be contiguous {q.dtype} {tuple(q.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if n == 0 or H == 0 or d == 0 or W == 0 or (keys.shape[0] == 0 and not is_paged):
        return torch.zeros((n, H, d), dtype=q.dtype, device=q.device) if out is None else out.zero_()
    auto = split is None
    if auto and is_pinned():  # kernels.pinning: one mode for any number of queries, the split scratch bounded
        auto, split = False, True
        if len(slices := row_slices(n)) > 1:
            out = torch.empty((n, H, d), dtype=q.dtype, device=q.device) if out is None else out
            for a, b in slices:
                sparse_attention_gather(q[a:b], keys, idx[a:b], count[a:b], sink, scale, split=True, paged=paged,
                                        out=out[a:b])  # fmt: skip
            return out
    q, keys, idx, count, sink = (t.contiguous() for t in (q, keys, idx, count, sink))
    pool = (keys, store, pages, keys.shape[0], rows_per_page, is_paged)
    if use_split(n, H) if auto else split:
        return attention_split.sparse_attention_split(
            q,
            pool,
            idx,
            count,
            sink,
            scale,
            block_h=ATTN_BLOCK_H,
            block_n=ATTN_BLOCK_N,
            block_d=block_pow2(d),
            precision=dot_precision(q.dtype),
            num_warps=ATTN_NUM_WARPS,
            num_stages=ATTN_NUM_STAGES,
            out=out,
        )
    if wide is None:
        wide = auto and use_wide(n, q.dtype)
    if wide and attention_wgmma.use(q):  # DEEPINFER_ATTN_PREFILL=gluon: the Gluon kernel of the wide tiles
        done = attention_wgmma.sparse_attention_wgmma(q, keys, store, pages, rows_per_page, is_paged, idx, count,
                                                      sink, scale, out)  # fmt: skip
        if done is not None:
            return done
    tiles = dict(ATTN_WIDE) if wide else dict(ATTN_NARROW)
    out = torch.empty((n, H, d), dtype=q.dtype, device=q.device) if out is None else out
    grid = (n, triton.cdiv(H, tiles["BLOCK_H"]))
    _sparse_attention_kernel[grid](
        q,
        keys,
        store,
        pages,
        keys.shape[0],
        rows_per_page,
        idx,
        count,
        sink,
        out,
        W,
        float(scale),
        H=H,
        D=d,
        BLOCK_D=block_pow2(d),
        PRECISION=dot_precision(q.dtype),
        PAGED=is_paged,
        **tiles,
        **pdl.launch(),
    )
    return out


__all__ = ["sparse_attention_gather", "use_split", "use_wide"]
