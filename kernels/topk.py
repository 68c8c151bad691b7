"""The lightning indexer's row selection (``Ops.select_rows``) as one Triton kernel: a radix select per row; and the
routers' small top-k (``topk_rows``: ``Ops.topk_indices`` of rows of at most 4096 columns, ``k <= 32``, ``k`` rounds
of a maximum over the row's unique keys in one program, for the stable sort that took ~20 µs a call on an H200).

``select_rows(scores [..., W], visible [..., W] bool, k) -> (rows [..., min(k, W)] long, count [...] long)``: each row's
top ``kk = min(k, W)`` columns in the order of a stable descending sort of the scores (a higher score first; among equal
scores the lower column first), of which the visible ones, ascending, are ``rows[..., :count]``. ``rows[..., :count]``
and ``count`` equal ``ReferenceOps.select_rows`` (and ``backends.nvidia.topk.packed_select_rows``) exactly. The entries
past ``count`` are the chosen invisible columns in DESCENDING order (``packed_select_rows`` lists them ascending; the
callers never read them): valid column indices in ``[0, W)``.

Keys. A score (float32 / bfloat16 / float16, compared in fp32, which holds them exactly) is ordered by
``backends.nvidia.topk.packed_keys``' int32 ``v``: ``+bits(|s|)`` for ``s ≥ 0``, ``−bits(|s|)`` for ``s < 0``, so
``−0.0`` and ``+0.0`` tie (``v = 0``) and every NaN gets ``0x7f800001``, above ``+inf`` and tied with the other NaNs.
Ties go to the lower column. The kk-th key is ``T`` (a ``v``) with ``need ≥ 0``: a column is chosen iff ``v > T``, or
``v == T`` and fewer than ``need`` columns left of it have ``v == T``. A coarse 8-bit key ``c(v)``, non-decreasing in
``v``, narrows the search: 0 is ``-inf`` (the masked columns), 1..127 the other negatives and 128..255 the rest, by
quarter binades of ``|s|`` in ``[2^-16, 2^16)`` (clamped outside).

One program per row; the row is read in chunks of ``BLOCK`` columns, the candidate list in chunks of ``LBLOCK``:

A. (full row) the number of non-``-inf`` columns ``n_pos`` and a 256-bin ``tl.histogram`` of the maximum ``c`` of
   each group of ``GROUP`` columns (a partition of the chunk): ``c*``, the largest bin with at least ``kk`` groups at
   or above it, has at least ``kk`` columns with ``c ≥ c*`` (each such group holds one), so the top ``kk`` lie there.
   ``GROUP = 4`` (rows of at least ``4·kk``) makes this pass cheap; ``GROUP = 1`` is the exact histogram.
   If ``n_pos ≤ kk``: ``T = v(-inf)``, ``need = kk − n_pos`` and the last step walks the full row.
B. (full row) compaction of the columns with ``c ≥ max(c*, 1)`` into a per-row scratch list ``L``, ascending (a
   running ``tl.cumsum``); ``|L| ≥ kk`` holds the top ``kk``. An entry packs ``v``, the visibility and the column
   into an int64, so the passes over ``L`` read one contiguous array and gather nothing.
C. (over ``L``) the exact histogram of ``c``: the bin ``b`` of the kk-th key and ``g``, the columns above it; then
   the AND and OR of the (order-preserving, unsigned) bits of the keys in bin ``b``: the bits where they agree are
   ``T``'s; every 8-bit digit where they differ is resolved by one more histogram pass over ``L``, from the top
   (typically 3 for fp32 scores, 1 for bf16 ones), giving ``T`` and ``need``.
D. (over ``L``, or the full row) in column order: the chosen columns, visible ones written at
   ``running count + exclusive cumsum`` (ascending from the front), invisible ones from the back. Stops once ``kk``
   columns are written. ``kk ≥ W`` skips A-C (every column is chosen).

Cost: two passes over the full row (A: keys and a histogram of ``W / GROUP`` values; B: keys and a scan), then a
few over ``L`` (for continuous scores about ``kk`` to ``3·kk`` columns; at worst, e.g. every score equal, ``W``).
The row is read from L2 (the indexer has just written it), the next chunk loaded while the current one is worked.
Any ``k ≥ 1`` (no register sort: ``k`` bounds nothing). No host synchronisation and no data-dependent shape (the
scratch list is ``[n, W]`` int64): capturable in a CUDA graph. Runs in Triton's interpreter (the tests, fp32 scores:
the interpreter's bf16 arithmetic is unreliable; bf16 / fp16 loads convert exactly) and on NVIDIA GPUs (compiled
for sm_90 with Triton 3.6 and 3.9).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_WARPS = {4096: 16, 2048: 8}  # by block (smaller blocks: 4). One program per row: 16 warps hide a lone row's latency
_NEG_INF = tl.constexpr(-0x7F800000)  # v(-inf)
INT_MIN = tl.constexpr(-2147483648)  # below every v: "every column is chosen"; u = v ^ INT_MIN


@triton.jit
def order_value(s):
    """The order-preserving int32 ``v`` of fp32 scores ``s`` (``packed_keys``' high half)."""
    mag = tl.minimum(s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800001)
    return tl.where(s < 0, -mag, mag)  # s < 0 is False for -0.0 and every NaN, as in packed_keys


@triton.jit
def _coarse(v):
    """The coarse key ``c(v)`` in ``[0, 256)``, non-decreasing in ``v`` (module docstring)."""
    quarter = tl.minimum(tl.maximum((tl.abs(v) >> 21) - 444, 0), 127)  # 4·exponent + 2 mantissa bits, from 2^-16
    c = tl.where(v < 0, tl.maximum(127 - quarter, 1), 128 + quarter)
    return tl.where(v == _NEG_INF, 0, c)


@triton.jit
def pick(hist, need):
    """``(d, above)``: the largest bin ``d`` with ``Σ_{b ≥ d} hist[b] ≥ need`` (0 if none) and ``Σ_{b > d} hist[b]``."""
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    d = tl.maximum(tl.sum((at_least >= need).to(tl.int32), 0) - 1, 0)
    above = tl.sum(tl.where(tl.arange(0, 256) > d, hist, 0), 0)
    return d, above


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _entries(cand_row, start, n_src, LBLOCK: tl.constexpr):
    """Entries ``start + [0, LBLOCK)`` of the list ``L`` (int64: ``v << 32 | visible << 31 | column``): their
    columns, in-range mask, keys ``v`` and visibility."""
    i = start + tl.arange(0, LBLOCK)
    m = i < n_src
    p = tl.load(cand_row + i, mask=m, other=0)
    return (p & 0x7FFFFFFF).to(tl.int32), m, (p >> 32).to(tl.int32), ((p >> 31) & 1) != 0


@triton.jit
def _threshold(cand_row, n_src, kk, LBLOCK: tl.constexpr):
    """Step C over the list ``L`` (``n_src`` entries): ``(T, need)`` of the kk-th key."""
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, n_src, LBLOCK):
        cols, m, v, vis = _entries(cand_row, start, n_src, LBLOCK)
        hist += tl.histogram(_coarse(v), 256, mask=m)
    b, above = pick(hist, kk)
    need = kk - above
    ones = tl.full([LBLOCK], -1, dtype=tl.int32)
    any_set = tl.zeros([LBLOCK], dtype=tl.int32)
    for start in range(0, n_src, LBLOCK):
        cols, m, v, vis = _entries(cand_row, start, n_src, LBLOCK)
        u = v ^ INT_MIN  # the bits of v + 2^31: unsigned order = v's order
        tie = m & (_coarse(v) == b)
        ones = ones & tl.where(tie, u, -1)
        any_set = any_set | tl.where(tie, u, 0)
    all_set = ~tl.reduce(~ones, 0, _or)
    varying = all_set ^ tl.reduce(any_set, 0, _or)
    target = all_set  # T's bits where the keys of bin b agree; the varying digits are chosen below
    for j in tl.static_range(4):
        if ((varying >> (24 - 8 * j)) & 255) != 0:
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, n_src, LBLOCK):
                cols, m, v, vis = _entries(cand_row, start, n_src, LBLOCK)
                u = v ^ INT_MIN
                match = m & (_coarse(v) == b)
                if j > 0:
                    match = match & (((u ^ target) >> (32 - 8 * j)) == 0)
                hist += tl.histogram((u >> (24 - 8 * j)) & 255, 256, mask=match)
            d, above = pick(hist, need)
            need -= above
            target = target | (d << (24 - 8 * j))
    return target ^ INT_MIN, need


@triton.jit
def _select_rows_kernel(s_ptr, vis_ptr, rows_ptr, count_ptr, cand_ptr, W, kk, stride_s, stride_v, stride_r,
                        BLOCK: tl.constexpr, LBLOCK: tl.constexpr, GROUP: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    vis_row = vis_ptr + row * stride_v
    out_row = rows_ptr + row * stride_r
    cand_row = cand_ptr + row * W
    offs = tl.arange(0, BLOCK)
    T = tl.full((), INT_MIN, tl.int32)  # kk == W: every column chosen, walking the full row
    need = tl.full((), 0, tl.int32)
    n_src = tl.full((), 0, tl.int32) + W
    use_list = tl.full((), False, tl.int1)
    if kk < W:
        # A: the non -inf count and the histogram of the group maxima of c
        hist = tl.zeros([256], dtype=tl.int32)
        finite = tl.zeros([BLOCK], dtype=tl.int32)
        ahead = tl.load(s_row + offs, mask=offs < W, other=0.0)
        for start in range(0, W, BLOCK):
            cols = start + offs
            m = cols < W
            s = ahead
            ahead = tl.load(s_row + cols + BLOCK, mask=cols + BLOCK < W, other=0.0)  # the next chunk, in flight
            c = _coarse(order_value(s.to(tl.float32)))
            finite += (m & (c > 0)).to(tl.int32)
            if GROUP == 1:
                hist += tl.histogram(c, 256, mask=m)
            else:
                top = tl.max(tl.reshape(tl.where(m, c, -1), [BLOCK // GROUP, GROUP]), 1)
                hist += tl.histogram(tl.maximum(top, 0), 256, mask=top >= 0)
        n_pos = tl.sum(finite, 0)
        if n_pos <= kk:  # every finite column, then the first -inf ones
            T = tl.full((), _NEG_INF, tl.int32)
            need = kk - n_pos
        else:
            # B: the list L of the columns with c >= max(c*, 1), ascending, with their keys and visibility
            low, _ = pick(hist, kk)
            low = tl.maximum(low, 1)
            n_src = tl.full((), 0, tl.int32)
            ahead = tl.load(s_row + offs, mask=offs < W, other=0.0)
            ahead_vis = tl.load(vis_row + offs, mask=offs < W, other=0)
            for start in range(0, W, BLOCK):
                cols = start + offs
                m = cols < W
                s = ahead
                vis = ahead_vis
                ahead = tl.load(s_row + cols + BLOCK, mask=cols + BLOCK < W, other=0.0)
                ahead_vis = tl.load(vis_row + cols + BLOCK, mask=cols + BLOCK < W, other=0)
                v = order_value(s.to(tl.float32))
                keep = (m & (_coarse(v) >= low)).to(tl.int32)
                entry = (v.to(tl.int64) << 32) | ((vis != 0).to(tl.int64) << 31) | cols.to(tl.int64)
                tl.store(cand_row + n_src + tl.cumsum(keep, 0) - 1, entry, mask=keep != 0)
                n_src += tl.sum(keep, 0)
            use_list = tl.full((), True, tl.int1)
            T, need = _threshold(cand_row, n_src, kk, LBLOCK)
    # D: the chosen columns, visible ones ascending from the front, invisible ones from the back
    seen_eq = tl.full((), 0, tl.int32)
    shown = tl.full((), 0, tl.int32)
    hidden = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    while (start < n_src) & (shown + hidden < kk):
        if use_list:
            cols, m, v, vis = _entries(cand_row, start, n_src, LBLOCK)
        else:
            cols = start + tl.arange(0, LBLOCK)
            m = cols < n_src
            v = order_value(tl.load(s_row + cols, mask=m, other=0.0).to(tl.float32))
            vis = tl.load(vis_row + cols, mask=m, other=0) != 0
        eq = (m & (v == T)).to(tl.int32)
        sel = m & ((v > T) | ((eq != 0) & (seen_eq + tl.cumsum(eq, 0) - eq < need)))
        a = (sel & vis).to(tl.int32)
        b = (sel & ~vis).to(tl.int32)
        rank = tl.cumsum(a + (b << 16), 0)  # both running counts at once (LBLOCK < 2^16)
        pos = tl.where(vis, shown + (rank & 0xFFFF) - 1, kk - hidden - (rank >> 16))
        tl.store(out_row + pos, cols.to(tl.int64), mask=sel)
        seen_eq += tl.sum(eq, 0)
        shown += tl.sum(a, 0)
        hidden += tl.sum(b, 0)
        start += LBLOCK
    tl.store(count_ptr + row, shown.to(tl.int64))


def pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def select_rows(
    scores: torch.Tensor, visible: torch.Tensor, k: int, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Ops.select_rows`` in one launch (module docstring): ``rows[..., :count]`` and ``count`` equal the
    reference's; the entries past ``count`` are the chosen invisible columns, descending. ``scores [..., W]``
    float32 / bfloat16 / float16, ``visible`` bool of the same shape, ``k ≥ 0``. ``block``: the columns a program
    reads at a time (a power of two ≥ 16; by default from the width, up to 4096; the tests make it small). Besides
    the kernel, only allocations (``rows``, ``count`` and the ``[n, W]`` int64 scratch list): no host sync."""
    if scores.dtype not in _FLOATS:
        raise TypeError(f"select_rows takes float32 / bfloat16 / float16 scores, got {scores.dtype}")
    if visible.shape != scores.shape:
        raise ValueError(f"visible {tuple(visible.shape)} must match scores {tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    block = block or min(4096, max(256, pow2(scores.shape[-1])))
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    lead, width = scores.shape[:-1], scores.shape[-1]
    n, kk = lead.numel(), min(k, width)
    rows = torch.empty(*lead, kk, dtype=torch.long, device=scores.device)
    count = torch.empty(lead, dtype=torch.long, device=scores.device)
    if n == 0 or kk == 0:
        return rows, count.zero_()
    s = scores.reshape(n, width)
    if s.stride(-1) != 1:
        s = s.contiguous()
    vis = visible.reshape(n, width).view(torch.uint8)
    if vis.stride(-1) != 1:
        vis = vis.contiguous()
    # groups of 4 columns (one thread's vector load: the maxima need no shuffle) once the row has 4·kk of them
    group = 4 if width >= 4 * kk else 1
    cand = torch.empty((n, width) if kk < width else (1, 1), dtype=torch.int64, device=s.device)  # kk == W: unused
    out = rows.view(n, kk)
    _select_rows_kernel[(n,)](
        s, vis, out, count.view(n), cand, width, kk, s.stride(0), vis.stride(0), out.stride(0),
        BLOCK=block, LBLOCK=min(block, 1024), GROUP=group, num_warps=_WARPS.get(block, 4), **pdl.launch(),
    )  # fmt: skip
    return rows, count


# ``topk_rows``: rows up to this wide and up to this many picks (the MoE routers: 256 or 384 experts, top 6)
SMALL_WIDTH = 4096
SMALL_K = 32


@triton.jit
def _topk_rows_kernel(s_ptr, out_ptr, W, stride_s, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row: ``K`` rounds of the largest ``packed_keys`` key (unique: ``v · 2^32 + 2^32 - 1 - column``), each
    taken out after it is written."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    s = tl.load(s_ptr + row * stride_s + c, mask=c < W, other=0.0).to(tl.float32)
    low = 4294967295 - c.to(tl.int64)
    key = tl.where(c < W, (order_value(s).to(tl.int64) << 32) + low, -9223372036854775807)
    for j in tl.static_range(K):
        top = tl.max(key, 0)
        tl.store(out_ptr + row * K + j, 4294967295 - (top & 4294967295))
        key = tl.where(key == top, -9223372036854775807, key)


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``ReferenceOps.topk_indices`` (the first ``min(k, W)`` columns of a stable descending sort of each row, ties to
    the lower column; NaN and ``±0`` as ``packed_keys``) for rows of at most ``SMALL_WIDTH`` columns and
    ``k <= SMALL_K``, one program a row: ``[..., min(k, W)]`` long. No host sync (CUDA-graph capturable)."""
    if scores.dtype not in _FLOATS:
        raise TypeError(f"topk_rows takes float32 / bfloat16 / float16 scores, got {scores.dtype}")
    lead, width = scores.shape[:-1], scores.shape[-1]
    kk = min(k, width)
    if width > SMALL_WIDTH or not 0 <= kk <= SMALL_K:
        raise ValueError(f"topk_rows takes rows of at most {SMALL_WIDTH} columns and k <= {SMALL_K}, got {width}, {k}")
    n = lead.numel()
    out = torch.empty(*lead, kk, dtype=torch.long, device=scores.device)
    if n == 0 or kk == 0:
        return out
    s = scores.reshape(n, width)
    if s.stride(-1) != 1:
        s = s.contiguous()
    block = max(16, pow2(width))
    warps = 4 if block > 1024 else 1
    _topk_rows_kernel[(n,)](s, out.view(n, kk), width, s.stride(0), K=kk, BLOCK=block, num_warps=warps, **pdl.launch())
    return out
