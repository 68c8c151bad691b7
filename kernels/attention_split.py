"""The key-list-split ("flash-decoding") variant of ``attention.sparse_attention_gather``, for few queries.

With few queries the unsplit kernel runs ``n · cdiv(H, BLOCK_H)`` programs only (4 for one query at H = 64), each
walking its whole key list, and most of the GPU idles. This variant cuts every query's key list at fixed list
positions: split ``s`` covers list entries ``[s · CHUNK, (s + 1) · CHUNK) ∩ [0, count[i])``.

* ``_split_partial_kernel``, grid ``(n, cdiv(H, BLOCK_H), cdiv(W, CHUNK))``: program ``(i, head block, s)`` runs the
  unsplit kernel's online softmax over split ``s``'s entries (running max seeded with the sink, fp32 denominator and
  accumulator, blocks of ``BLOCK_N`` keys from the split's first entry upward, one gather and two ``tl.dot`` of fixed
  shape each) and stores its partial: running max ``m_s`` (``≥ sink``), denominator ``l_s`` (without the sink) and
  unnormalised accumulator ``acc_s``, all fp32, in scratch. A split past the query's count (``s · CHUNK ≥
  count[i]``) is empty: it stores nothing, and the combine never reads it.
* ``_split_combine_kernel``, grid ``(n, cdiv(H, COMBINE_BLOCK_H))``: for each (query, head), over the non-empty
  splits ``s = 0, 1, …, cdiv(count[i], CHUNK) − 1`` in that fixed order: ``M = max(sink, m_0, m_1, …)``, then
  ``L = Σ_s l_s · exp(m_s − M)`` and ``A = Σ_s acc_s · exp(m_s − M)`` accumulated from ``s = 0`` upward, then the sink
  joins the denominator as in the unsplit kernel, ``L += exp(sink − M)``, and ``out = A / L`` in ``q.dtype``. Every
  exponent is finite (``M ≥ m_s ≥ sink``): no ``-inf − -inf``. A query with ``count == 0`` has no split:
  ``out = 0 / exp(0) = 0``.

Why invariant: a partial depends only on ``q[i]``, the split's entries of the query's list, ``keys``, ``sink`` and
``scale`` (fixed tile shapes, masked lanes exact zeros, as in the unsplit kernel); which splits are merged, and in
which order, depends only on ``count[i]`` and the constant ``CHUNK``; the merge is lane-wise arithmetic. So query
``i``'s output does not depend on ``n``, on the padded width ``W`` (which sets only how many programs are launched,
the extra ones empty, and the scratch strides) nor on the other queries. The runtime sizes ``W`` and ``S`` are
``do_not_specialize``: every batch size and width runs the same binaries. With one split (``count ≤ CHUNK``) the
merge is exact (``M = m_0``, ``exp(0) = 1``), so the output is the unsplit kernel's formula on the same partial.
The two modes differ in rounding when ``count > CHUNK``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.paged_keys import key_rows
from deepinfer.kernels.pdl import pdl_wait

SPLIT_CHUNK = 128  # list entries per split: a results-defining constant (outputs depend on it; keep it fixed)
COMBINE_BLOCK_H = 4  # heads per combine program ([4, 512] fp32 tiles)
COMBINE_NUM_WARPS = 4


@triton.jit(do_not_specialize=["W", "S", "N1", "R"])
def _split_partial_kernel(
    q_ptr,
    k_ptr,
    p_ptr,
    pages_ptr,
    N1,
    R,
    idx_ptr,
    count_ptr,
    sink_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    W,
    S,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < H
    mask_d = offs_d < D
    hd = offs_h[:, None] * D + offs_d[None, :]
    mask_hd = mask_h[:, None] & mask_d[None, :]
    cnt = tl.load(count_ptr + row)
    cnt = tl.minimum(tl.maximum(cnt, 0), W).to(tl.int32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, cnt)  # <= lo for an empty split: the loop below runs no step
    # per head, not a scalar: Triton 3.9's interpreter turns `tensor & scalar comparison` into an int32 mask
    live = (offs_h * 0 + lo) < cnt
    q = tl.load(q_ptr + row * (H * D) + hd, mask=mask_hd & live[:, None], other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    m = sink  # running max, seeded with the sink: finite, so masked logits give exp(-inf) = 0
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        valid = j < hi
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
    part = (row * S + split) * H + offs_h  # [n, S, H] for m and l, [n, S, H, D] for acc
    tl.store(m_ptr + part, m, mask=mask_h & live)
    tl.store(l_ptr + part, den, mask=mask_h & live)
    tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_hd & live[:, None])


@triton.jit(do_not_specialize=["W", "S"])
def _split_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    count_ptr,
    sink_ptr,
    out_ptr,
    W,
    S,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_d = offs_d < D
    mask_hd = mask_h[:, None] & mask_d[None, :]
    cnt = tl.load(count_ptr + row)
    cnt = tl.minimum(tl.maximum(cnt, 0), W).to(tl.int32)
    n_split = (cnt + CHUNK - 1) // CHUNK  # the non-empty splits only: set by count, never by W
    sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    big = sink
    for s in range(0, n_split):
        part = (row * S + s) * H + offs_h
        big = tl.maximum(big, tl.load(m_ptr + part, mask=mask_h, other=0.0))
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for s in range(0, n_split):
        part = (row * S + s) * H + offs_h
        w = tl.exp(tl.load(m_ptr + part, mask=mask_h, other=0.0) - big)  # in (0, 1]: m_s and big are finite
        den += tl.load(l_ptr + part, mask=mask_h, other=0.0) * w
        a = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=mask_hd, other=0.0)
        acc += a * w[:, None]
    den += tl.exp(sink - big)
    out = acc / den[:, None]
    tl.store(
        out_ptr + row * (H * D) + offs_h[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_hd
    )


def sparse_attention_split(
    q: torch.Tensor,
    pool: tuple,
    idx: torch.Tensor,
    count: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    block_h: int,
    block_n: int,
    block_d: int,
    precision: str,
    num_warps: int,
    num_stages: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attention_gather``'s split mode → ``[n, H, d]`` in ``q.dtype`` (module docstring). ``pool``: the
    keys as ``sparse_attention_gather`` passes them to its kernel, ``(keys, store, pages, N1, R, PAGED)``.

    Inputs are validated, contiguous and non-empty (``sparse_attention_gather`` does that); the tile sizes and
    compile options of the partial kernel are the unsplit kernel's. Launches ``cdiv(W, SPLIT_CHUNK)`` splits per
    query (the empty ones store nothing) and allocates ``n · cdiv(W, SPLIT_CHUNK) · H · (d + 2)`` fp32 of scratch;
    never reads ``count`` on the host (capturable in a CUDA graph). Query ``i``'s output depends only on ``q[i]``, its
    valid key list, ``keys``, ``sink``, ``scale`` (and ``SPLIT_CHUNK``): not on ``n``, ``W`` nor the other queries.
    """
    chunk = SPLIT_CHUNK
    if chunk <= 0 or chunk % block_n:
        raise ValueError(f"SPLIT_CHUNK must be a positive multiple of the key block {block_n}, got {chunk}")
    n, H, d = q.shape
    W = idx.shape[1]
    S = triton.cdiv(W, chunk)
    m = torch.empty((n, S, H), dtype=torch.float32, device=q.device)
    den = torch.empty((n, S, H), dtype=torch.float32, device=q.device)
    acc = torch.empty((n, S, H, d), dtype=torch.float32, device=q.device)
    keys, store, pages, n1, rows_per_page, paged = pool
    _split_partial_kernel[(n, triton.cdiv(H, block_h), S)](
        q,
        keys,
        store,
        pages,
        n1,
        rows_per_page,
        idx,
        count,
        sink,
        m,
        den,
        acc,
        W,
        S,
        float(scale),
        H=H,
        D=d,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        CHUNK=chunk,
        PRECISION=precision,
        PAGED=paged,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch(),
    )
    out = torch.empty((n, H, d), dtype=q.dtype, device=q.device) if out is None else out
    _split_combine_kernel[(n, triton.cdiv(H, COMBINE_BLOCK_H))](
        m,
        den,
        acc,
        count,
        sink,
        out,
        W,
        S,
        H=H,
        D=d,
        BLOCK_D=block_d,
        BLOCK_H=COMBINE_BLOCK_H,
        CHUNK=chunk,
        num_warps=COMBINE_NUM_WARPS,
        **pdl.launch(),
    )
    return out


__all__ = ["COMBINE_BLOCK_H", "SPLIT_CHUNK", "sparse_attention_split"]
