"""Batch-invariant Triton kernels for the lightning indexer's scores of DeepSeek-V4 (``ReferenceOps.indexer_scores``,
``indexer_scores_ranges``), on CUDA in place of the padded einsums.

* ``indexer_scores_fixed``: ``scores[i, r] = Σ_h weights[i, h] · relu(q[i, h] · keys[r])``. One program per
  (query, block of ``INDEXER_BLOCK_R`` keys): one ``tl.dot`` ``[h, d] x [d, BLOCK_R]``, relu, weights, then a
  fixed-shape ``tl.sum`` over the heads.
* ``indexer_scores_ranges``: the same over a range of keys per query (several sequences' keys in one tensor, or read
  through a page list from a paged store: ``kernels.paged_keys``).

Why invariant: a score's reduction order is fixed by constexpr tile sizes, never by the number of queries, the width
or the other rows; the runtime sizes are ``do_not_specialize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.attention import DTYPES, INT_DTYPES, block_pow2, dot_precision
from deepinfer.kernels.paged_keys import check_paged, key_rows
from deepinfer.kernels.pdl import pdl_wait

INDEXER_BLOCK_R = 64  # keys per program
INDEXER_NUM_WARPS = 4
INDEXER_NUM_STAGES = 1
INDEXER_RANGE_STEPS = 4  # key blocks a range program scores when there are many programs
INDEXER_RANGE_MIN_PROGRAMS = 1056  # ... at least this many after the merge (8 waves of 132 SMs)


@triton.jit
def _query(q_ptr, w_ptr, row, offs_h, offs_d, NH: tl.constexpr, D: tl.constexpr):
    """Query ``row``'s heads ``[BLOCK_HH, BLOCK_D]`` and their weights ``[BLOCK_HH]`` (0 past ``NH`` / ``D``)."""
    mask_h = offs_h < NH
    q = tl.load(
        q_ptr + row * (NH * D) + offs_h[:, None] * D + offs_d[None, :],
        mask=mask_h[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    return q, tl.load(w_ptr + row * NH + offs_h, mask=mask_h, other=0.0)


@triton.jit
def _score(q, w, k, PRECISION: tl.constexpr):
    """``Σ_h w_h · relu(q_h · k)`` for each key row of ``k [BLOCK_R, BLOCK_D]``: ``[BLOCK_R]`` fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_HH, BLOCK_R] fp32
    return tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)


@triton.jit(do_not_specialize=["R"])
def _indexer_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    out_ptr,
    R,
    NH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_HH)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask_r = offs_r < R
    q, w = _query(q_ptr, w_ptr, row, offs_h, offs_d, NH, D)
    k = tl.load(k_ptr + offs_r[:, None] * D + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    tl.store(out_ptr + row * R + offs_r, _score(q, w, k, PRECISION), mask=mask_r)


@triton.jit(do_not_specialize=["N", "WIDTH", "R"])
def _indexer_ranges_kernel(
    q_ptr,
    k_ptr,
    p_ptr,
    pages_ptr,
    R,
    w_ptr,
    start_ptr,
    out_ptr,
    N,
    WIDTH,
    NH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    STEPS: tl.constexpr = 1,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HH)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    first = tl.load(start_ptr + row).to(tl.int64)
    q, w = _query(q_ptr, w_ptr, row, offs_h, offs_d, NH, D)  # once for the program's STEPS key blocks
    for step in range(STEPS):
        offs_r = (tl.program_id(1).to(tl.int64) * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        kr = first + offs_r
        mask_k = (offs_r < WIDTH) & (kr < N) & (kr >= 0)
        at = key_rows(k_ptr, p_ptr, pages_ptr, kr, mask_k, 0, R, D, PAGED)  # PAGED: every key in the store's pages
        k = tl.load(at[:, None] + offs_d[None, :], mask=mask_k[:, None] & mask_d[None, :], other=0.0)
        tl.store(out_ptr + row * WIDTH + offs_r, _score(q, w, k, PRECISION), mask=offs_r < WIDTH)


def _check(name: str, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> None:
    if q.dtype not in DTYPES or keys.dtype != q.dtype:
        raise ValueError(f"{name}: q and keys must both be float32 or both bfloat16, got {q.dtype} and {keys.dtype}")
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"{name}: expected q [n, h, d] and keys [R, d], got {tuple(q.shape)} and {tuple(keys.shape)}")
    n, nh, _ = q.shape
    if weights.shape != (n, nh) or weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights must be float32 [{n}, {nh}], got {weights.dtype} {tuple(weights.shape)}")
    if len({q.device, keys.device, weights.device}) != 1:
        raise ValueError(f"{name}: q, keys, weights are on {q.device}, {keys.device}, {weights.device}")


def indexer_scores_fixed(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``Σ_h weights[:, h] · relu(q[:, h] · keys)`` → ``[n, R]`` fp32.

    ``q [n, h, d]`` and ``keys [R, d]`` are both float32 or both bfloat16, ``weights [n, h]`` float32. Score
    ``(i, r)`` depends only on ``q[i]``, ``weights[i]`` and ``keys[r]``: not on ``n``, ``R`` nor the other rows.
    """
    _check("indexer_scores_fixed", q, keys, weights)
    n, nh, d = q.shape
    R = keys.shape[0]
    if n == 0 or R == 0 or nh == 0 or d == 0:
        return torch.zeros((n, R), dtype=torch.float32, device=q.device)
    q, keys, weights = q.contiguous(), keys.contiguous(), weights.contiguous()
    out = torch.empty((n, R), dtype=torch.float32, device=q.device)
    _indexer_scores_kernel[(n, triton.cdiv(R, INDEXER_BLOCK_R))](
        q,
        keys,
        weights,
        out,
        R,
        **_meta(nh, d, q.dtype),
    )
    return out


def _meta(nh: int, d: int, dtype: torch.dtype) -> dict:
    """The launch parameters both score kernels share (tiles, precision, warps, PDL)."""
    return dict(
        NH=nh,
        D=d,
        BLOCK_HH=block_pow2(nh),
        BLOCK_D=block_pow2(d),
        BLOCK_R=INDEXER_BLOCK_R,
        PRECISION=dot_precision(dtype),
        num_warps=INDEXER_NUM_WARPS,
        num_stages=INDEXER_NUM_STAGES,
        **pdl.launch(),
    )


def indexer_scores_ranges(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    start: torch.Tensor,
    width: int,
    paged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``indexer_scores_fixed`` with a key range per query → ``[n, width]`` fp32: column ``r`` of row ``i`` scores
    ``keys[start[i] + r]`` (0 where that row is outside ``keys``). Several sequences' keys share one tensor, each query
    reading its own sequence's range; the per-element arithmetic is ``indexer_scores_fixed``'s. ``paged = (store
    [P, R, d], pages [M])`` with no ``keys`` (``[0, d]``): the keys are the listed pages' rows, read in place (key
    ``j`` is row ``j % R`` of page ``pages[j // R]``, ``kernels.paged_keys``)."""
    _check("indexer_scores_ranges", q, keys, weights)
    n, nh, d = q.shape
    if start.shape != (n,) or start.dtype not in INT_DTYPES:
        raise ValueError(
            f"indexer_scores_ranges: start must be int32/int64 [{n}], got {start.dtype} {tuple(start.shape)}"
        )
    if paged is not None and keys.shape[0]:
        raise ValueError("indexer_scores_ranges: paged keys are read from the pages alone (keys must be [0, d])")
    store, pages, rows_per_page, is_paged = check_paged(keys, paged)
    size = pages.shape[0] * rows_per_page if is_paged else keys.shape[0]
    out = torch.zeros((n, width), dtype=torch.float32, device=q.device)
    if n == 0 or width == 0 or size == 0 or nh == 0 or d == 0:
        return out
    q, keys, weights, start = q.contiguous(), keys.contiguous(), weights.contiguous(), start.contiguous()
    blocks = triton.cdiv(width, INDEXER_BLOCK_R)
    # many queries (a prefill): a program scores several key blocks with its query loaded once; few (a decode step)
    # keep one block a program for the parallelism. The same per-element arithmetic either way (bit-identical).
    steps = INDEXER_RANGE_STEPS if n * blocks >= INDEXER_RANGE_STEPS * INDEXER_RANGE_MIN_PROGRAMS else 1
    _indexer_ranges_kernel[(n, triton.cdiv(blocks, steps))](
        q,
        keys,
        store,
        pages,
        rows_per_page,
        weights,
        start,
        out,
        size,
        width,
        PAGED=is_paged,
        STEPS=steps,
        **_meta(nh, d, q.dtype),
    )
    return out


__all__ = ["INDEXER_BLOCK_R", "indexer_scores_fixed", "indexer_scores_ranges"]
