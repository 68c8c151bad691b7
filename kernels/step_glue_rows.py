"""The row copies and element-wise glue of DeepSeek-V4's decode step in Triton (``kernels.step_glue`` holds its
index arithmetic); each replaces a few torch kernels with one launch, with the reference's values bit for bit:

* ``append_rows``: a layer's ring appends (the window row, the compressors' projections and scores: several
  ``index_copy_``), and, given ``take``, the window rows gathered after them (``index_select``), grid
  ``(programs, triples + 1)``. The gather takes a row's own new row from its source (``take`` entry equal to the
  row's ``idx``), not from the ring the same launch writes;
* ``store_rows``: a compressor's rows written to their pages (``store[page, row] = rows``) and every row's pages
  gathered (``index_select(store, 0, pages)``), grid ``(S·P + S, row blocks)``, a row's own new row again taken from
  its source;
* ``compress_score`` (a compressor's gate plus its position bias) and ``moe_combine`` (the routed experts' sum plus
  the shared expert's, rounded).

In a decode step two rows write the same ring row or page row only where they are both padding (the scratch slot,
the scratch page) or not completing a group (the scratch page): what a gather reads there is never listed. No host
synchronisation; shapes from the arguments (capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait

APPEND_MAX = 6  # (dst, index, src) triples per launch of append_rows


@triton.jit
def _copy_rows(dst, ds, idx, src, ss, s, n, width, BLOCK: tl.constexpr):
    """``dst[idx[s]] = src[s]`` (cast to ``dst``'s dtype), when ``s < n``."""
    if s < n:
        at = tl.load(idx + s)
        for c0 in range(0, width, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            v = tl.load(src + s * ss + c, mask=c < width)
            tl.store(dst + at * ds + c, v.to(dst.dtype.element_ty), mask=c < width)


@triton.jit
def _gather_rows(dst, ds, idx, src, ss, take, out, os, g, n_take, per_row, width, BLOCK_E: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """``out[e] = dst[take[e]]`` for the entries ``e`` of block ``g``; entry ``e`` of row ``e // per_row`` equal to
    that row's ``idx`` takes its new row from ``src``."""
    e = g * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < n_take
    at = tl.load(take + e, mask=em, other=0)
    s = e // per_row
    new = (at == tl.load(idx + s, mask=em, other=-1)) & em
    old = em & (new == 0)
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cm = c < width
        v = tl.load(dst + at[:, None] * ds + c[None, :], mask=old[:, None] & cm[None, :])
        f = tl.load(src + s[:, None] * ss + c[None, :], mask=new[:, None] & cm[None, :]).to(dst.dtype.element_ty)
        tl.store(out + e[:, None] * os + c[None, :], tl.where(new[:, None], f, v), mask=em[:, None] & cm[None, :])


@triton.jit
def _append_rows_kernel(d0, e0, i0, s0, t0, n0, w0, d1, e1, i1, s1, t1, n1, w1, d2, e2, i2, s2, t2, n2, w2,
                        d3, e3, i3, s3, t3, n3, w3, d4, e4, i4, s4, t4, n4, w4, d5, e5, i5, s5, t5, n5, w5,
                        take, out, os, n_take, per_row, N: tl.constexpr, GATHER: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p == 0:
        _copy_rows(d0, e0, i0, s0, t0, s, n0, w0, BLOCK)
    if N > 1:
        if p == 1:
            _copy_rows(d1, e1, i1, s1, t1, s, n1, w1, BLOCK)
    if N > 2:
        if p == 2:
            _copy_rows(d2, e2, i2, s2, t2, s, n2, w2, BLOCK)
    if N > 3:
        if p == 3:
            _copy_rows(d3, e3, i3, s3, t3, s, n3, w3, BLOCK)
    if N > 4:
        if p == 4:
            _copy_rows(d4, e4, i4, s4, t4, s, n4, w4, BLOCK)
    if N > 5:
        if p == 5:
            _copy_rows(d5, e5, i5, s5, t5, s, n5, w5, BLOCK)
    if GATHER:
        if p == N:
            _gather_rows(d0, e0, i0, s0, t0, take, out, os, s, n_take, per_row, w0, BLOCK_E, BLOCK)


def append_rows(
    dsts: list[torch.Tensor],
    idxs: list[torch.Tensor],
    srcs: list[torch.Tensor],
    take: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``ReferenceOps.append_rows`` (``dst.index_copy_(0, idx, src.to(dst.dtype))`` for every triple, then with
    ``take`` the rows ``dsts[0][take]``, into ``out`` when given) in one launch per ``APPEND_MAX`` triples: ``dst
    [N, C]`` and ``src [n, C]`` with unit column strides, ``idx`` int64 ``[n]`` and ``take`` int64 ``[n·k]``
    contiguous (``k`` entries per row of the first triple). A row written twice gets one of its values, as
    ``index_copy_`` on CUDA; a ``take`` entry naming another row's new row may read the old value or the new one. The
    casts round as torch's (to nearest even)."""
    got = None
    for i in range(0, len(dsts), APPEND_MAX):
        part = list(zip(dsts[i : i + APPEND_MAX], idxs[i : i + APPEND_MAX], srcs[i : i + APPEND_MAX]))
        args, rows = [], 0
        for d, x, s in part:
            args += [d, d.stride(0), x, s, s.stride(0), x.shape[0], d.shape[1]]
            rows = max(rows, x.shape[0])
        args += args[:7] * (APPEND_MAX - len(part))  # never run (N), any valid pointers
        gather = i == 0 and take is not None
        n_take, per_row, programs = 0, 1, rows
        if gather:
            d, n_take = dsts[0], take.shape[0]
            got = out if out is not None else torch.empty(n_take, d.shape[1], dtype=d.dtype, device=d.device)
            per_row = max(n_take // max(idxs[0].shape[0], 1), 1)
            programs = max(rows, triton.cdiv(n_take, 16))
        if programs:
            _append_rows_kernel[(programs, len(part) + gather)](
                *args, take if gather else args[2], got if gather else args[0], got.stride(0) if gather else 0,
                n_take, per_row, N=len(part), GATHER=gather, BLOCK_E=16, BLOCK=256, num_warps=4, **pdl.launch(),
            )  # fmt: skip
    return got


@triton.jit
def _store_rows_kernel(store, ss0, ss1, page_ptr, row_ptr, rows, rs, pages_ptr, ps, into, is0, is1, S, P, R, D,
                       BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    if i >= S * P:  # write row i - S·P
        s = i - S * P
        if tl.program_id(1) == 0:
            at = store + tl.load(page_ptr + s) * ss0 + tl.load(row_ptr + s) * ss1
            for c0 in range(0, D, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                tl.store(at + c, tl.load(rows + s * rs + c, mask=c < D).to(store.dtype.element_ty), mask=c < D)
    else:  # gather rows r of page i
        s = i // P
        pg = tl.load(pages_ptr + i * ps)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < R
        # a vector of the page, not a scalar: the interpreter's `tensor & scalar comparison` is an int32 mask
        new = ((tl.zeros([BLOCK_R], tl.int64) + pg) == tl.load(page_ptr + s)) & (r == tl.load(row_ptr + s)) & rm
        old = rm & (new == 0)
        for c0 in range(0, D, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            cm = c < D
            v = tl.load(store + pg * ss0 + r[:, None] * ss1 + c[None, :], mask=old[:, None] & cm[None, :])
            f = tl.load(rows + s * rs + r[:, None] * 0 + c[None, :], mask=new[:, None] & cm[None, :])
            v = tl.where(new[:, None], f.to(store.dtype.element_ty), v)
            tl.store(into + i * is0 + r[:, None] * is1 + c[None, :], v, mask=rm[:, None] & cm[None, :])


def store_rows(
    store: torch.Tensor,
    page: torch.Tensor,
    row: torch.Tensor,
    rows: torch.Tensor,
    pages: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ReferenceOps.store_rows`` (``store[page, row] = rows.to(store.dtype)``, then ``index_select(store, 0, pages,
    out=into)``) in one launch: ``store [N, R, D]`` and ``into [S·P, R, D]`` with unit last strides, ``page``, ``row``
    int64 ``[S]`` contiguous, ``pages`` int64 ``[S·P]`` (row ``s``'s pages ``s·P ..``; any stride: an eager step's
    table columns), ``rows [S, D]`` with a unit column stride. A gathered row equal to row ``s``'s written one, in row
    ``s``'s pages, is ``rows[s]``; in another row's pages it may read the old value or the new one."""
    s, (_, r, d) = page.shape[0], store.shape
    p = pages.shape[0] // max(s, 1)
    if into is None:
        into = torch.empty(pages.shape[0], r, d, dtype=store.dtype, device=store.device)
    block_r, block = max(1, min(16, triton.next_power_of_2(r))), max(16, min(256, triton.next_power_of_2(d)))
    if s:
        _store_rows_kernel[(s * p + s, triton.cdiv(r, block_r))](
            store, store.stride(0), store.stride(1), page, row, rows, rows.stride(0), pages, pages.stride(0), into,
            into.stride(0), into.stride(1), s, p, r, d, BLOCK_R=block_r, BLOCK=block, num_warps=4, **pdl.launch(),
        )  # fmt: skip
    return into


@triton.jit
def _score_kernel(g_ptr, gs, a_ptr, as_, pos_ptr, out_ptr, os, C, m, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(pos_ptr + t) % m
    r = tl.where(r < 0, r + m, r)  # torch's floor modulo (positions are never negative)
    g = tl.load(g_ptr + t * gs + c, mask=c < C)
    a = tl.load(a_ptr + r * as_ + c, mask=c < C).to(tl.float32)
    tl.store(out_ptr + t * os + c, g + a, mask=c < C)


def compress_score(gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """``ReferenceOps.compress_score`` (``gate + ape.float()[positions % ratio]``) in one launch: ``gate`` fp32
    ``[T, C]`` and ``ape`` ``[ratio, C]`` with unit column strides, ``positions`` int64 ``[T]`` contiguous → fp32
    ``[T, C]``, bit for bit (one fp32 addition per element)."""
    t, c = gate.shape
    out = torch.empty(t, c, dtype=torch.float32, device=gate.device)
    block = max(16, min(1024, triton.next_power_of_2(max(c, 1))))
    if t and c:
        _score_kernel[(t, triton.cdiv(c, block))](
            gate,
            gate.stride(0),
            ape,
            ape.stride(0),
            positions,
            out,
            out.stride(0),
            c,
            ratio,
            BLOCK=block,
            num_warps=4,
            **pdl.launch(),
        )
    return out


@triton.jit
def _combine_kernel(y_ptr, s_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + i, mask=i < N).to(tl.float32)
    s = tl.load(s_ptr + i, mask=i < N).to(tl.float32)
    tl.store(out_ptr + i, (y + s).to(out_ptr.dtype.element_ty), mask=i < N)


def moe_combine(y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``ReferenceOps.moe_combine`` (``(y + shared.float()).to(dtype)``) in one launch: ``y`` fp32 and ``shared``
    contiguous of one shape → ``dtype``, bit for bit on a GPU (one fp32 addition, a round to nearest even)."""
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    n = y.numel()
    if n:
        _combine_kernel[(triton.cdiv(n, 1024),)](y, shared, out, n, BLOCK=1024, num_warps=4, **pdl.launch())
    return out


__all__ = ["APPEND_MAX", "append_rows", "compress_score", "moe_combine", "store_rows"]
