"""The index arithmetic of DeepSeek-V4's decode step in two Triton kernels (``models/deepseek_v4/decode_step.py``),
and ``NvidiaOps``' entry to every decode-step glue kernel (``fits``; the row copies and element-wise ones are in
``kernels.step_glue_rows``).

A decode step derives, from its plan's ``meta [4, S]`` (slot, position, window start, liveness per row) and block
tables ``[S, P]``, a few dozen small index tensors: the window ring's rows, the key lists, each compression ratio's
visible rows and list offsets, each compressor ring's groups and the page its completed row goes to. In torch that is
a chain of tiny element-wise kernels (``ReferenceOps.step_indices``, the definition); here:

* ``step_indices``: all of them in one launch, grid ``(S, 1 + ratios + rings)``: program ``(s, 0)`` writes row
  ``s``'s window indices (``first``, ``put``, ``take``, ``start``, ``count``, the window-only key list), program
  ``(s, 1 + i)`` ratio ``i``'s (visible count, list offsets, the ``visible`` mask where asked, the all-rows key list
  where asked) and program ``(s, 1 + R + g)`` ring ``g``'s groups (``at``, ``cur``, ``prev``, ``has_prev``, ``w``,
  ``done``, ``page``, ``row``). Every output is a view of one int64 and one bool buffer allocated per call: shapes
  are host ints of the plan, so a call is capturable in a CUDA graph. Up to three ratios and three rings (V4 has two
  of each); more go to the reference.
* ``key_lists``: a CSA layer's key lists (its window rows, then the indexer's chosen rows offset into the key pool),
  grid ``(S, column blocks)``.

Integer arithmetic only, so the results are the reference's bit for bit (``%`` is torch's floor modulo, written out:
Triton's is C's). No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.step_glue_rows import APPEND_MAX, append_rows, compress_score, moe_combine, store_rows

MAX_RATIOS, MAX_RINGS = 3, 3  # step_indices' sections (ops.step_indices falls back past them)
_BLOCK = 256


@triton.jit
def _mod(x, n):
    """``x mod n`` with the sign of ``n`` (torch's ``%``); Triton's ``%`` truncates."""
    r = x % n
    return tl.where(r < 0, r + n, r)


@triton.jit
def _window_of(meta, ms0, ms1, s, W):
    """Row ``s``'s slot, position, first window position and window count."""
    slot = tl.load(meta + s * ms1)
    pos = tl.load(meta + ms0 + s * ms1)
    floor = tl.load(meta + 2 * ms0 + s * ms1)
    first = tl.maximum(floor, tl.maximum(pos - W + 1, 0))
    return slot, pos, floor, first, pos - first + 1


@triton.jit
def _lists(o, s, w_start, w_cnt, win_width, c_start, c_width, BLOCK: tl.constexpr):
    """Row ``s`` of ``key_lists`` over the compressed rows ``c_start + k`` (``k < c_width``): ``[win_width +
    c_width]`` at ``o``."""
    n = win_width + c_width
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        comp = c_start + tl.minimum(tl.maximum(j - w_cnt, 0), tl.maximum(c_width - 1, 0))
        comp = tl.where(c_width > 0, comp, 0)
        tl.store(o + s * n + j, tl.where(j < w_cnt, w_start + j, comp), mask=j < n)


@triton.jit
def _window(meta, ms0, ms1, o, b, s, S, W, win_width, BLOCK: tl.constexpr):
    slot, pos, floor, first, count = _window_of(meta, ms0, ms1, s, W)
    start = s * W + (W - count)
    tl.store(o + s, first)
    tl.store(o + S + s, slot * W + _mod(pos, W))
    tl.store(o + 2 * S + s, start)
    tl.store(o + 3 * S + s, count)
    tl.store(b + s, (tl.load(meta + 3 * ms0 + s * ms1) != 0).to(tl.uint8))
    for j0 in range(0, W, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(o + 4 * S + s * W + j, slot * W + _mod(pos - W + 1 + j, W), mask=j < W)
    for j0 in range(0, win_width, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(o + 4 * S + S * W + s * win_width + j, start + j, mask=j < win_width)


@triton.jit
def _ratio(meta, ms0, ms1, o, b, s, S, W, win_width, m, R, per_row, base, vbase, LISTS: tl.constexpr,
           VISIBLE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    slot, pos, floor, first, w_cnt = _window_of(meta, ms0, ms1, s, W)
    count = (pos + 1) // m
    r_start = S * W + s * per_row
    o = o + base
    tl.store(o + s, count)
    tl.store(o + S + s, r_start)
    tl.store(o + 2 * S + s, s * per_row)
    if VISIBLE:
        for r0 in range(0, R, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            tl.store(b + vbase + s * R + r, (r < count).to(tl.uint8), mask=r < R)
    if LISTS:
        tl.store(o + 3 * S + s, w_cnt + count)
        _lists(o + 4 * S, s, s * W + (W - w_cnt), w_cnt, win_width, r_start, R, BLOCK)


@triton.jit
def _ring(meta, ms0, ms1, tables, ts0, ts1, P, o, b, s, S, m, cap, per_page, scratch, base, hbase,
          BLOCK: tl.constexpr):  # fmt: skip
    slot = tl.load(meta + s * ms1)
    pos = tl.load(meta + ms0 + s * ms1)
    floor = tl.load(meta + 2 * ms0 + s * ms1)
    live = tl.load(meta + 3 * ms0 + s * ms1) != 0
    ring = slot * cap
    w = tl.maximum((pos + 1) // m - 1, 0)
    done = live & (_mod(pos + 1, m) == 0)
    k = w // per_page
    table = tl.load(tables + s * ts0 + k * ts1, mask=done & (k < P), other=0)
    o = o + base
    tl.store(o + s, ring + _mod(pos, cap))
    tl.store(o + S + s, w)
    tl.store(o + 2 * S + s, tl.where(done, table, scratch))
    tl.store(o + 3 * S + s, w % per_page)
    tl.store(b + hbase + s, (w > 0).to(tl.uint8))
    tl.store(b + hbase + S + s, done.to(tl.uint8))
    for j0 in range(0, m, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mask = j < m
        tl.store(o + 4 * S + s * m + j, ring + _mod(tl.maximum(w * m + j, floor), cap), mask=mask)
        tl.store(o + 4 * S + S * m + s * m + j, ring + _mod(tl.maximum((w - 1) * m + j, floor), cap), mask=mask)


@triton.jit
def _step_indices_kernel(meta, ms0, ms1, tables, ts0, ts1, P, o, b, S, W, win_width, page_size, scratch,
                         m0, R0, pr0, base0, vb0, m1, R1, pr1, base1, vb1, m2, R2, pr2, base2, vb2,
                         g0, c0, gb0, hb0, g1, c1, gb1, hb1, g2, c2, gb2, hb2,
                         NR: tl.constexpr, NG: tl.constexpr, L0: tl.constexpr, V0: tl.constexpr, L1: tl.constexpr,
                         V1: tl.constexpr, L2: tl.constexpr, V2: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    sec = tl.program_id(1)
    if sec == 0:
        _window(meta, ms0, ms1, o, b, s, S, W, win_width, BLOCK)
    if NR > 0:
        if sec == 1:
            _ratio(meta, ms0, ms1, o, b, s, S, W, win_width, m0, R0, pr0, base0, vb0, L0, V0, BLOCK)
    if NR > 1:
        if sec == 2:
            _ratio(meta, ms0, ms1, o, b, s, S, W, win_width, m1, R1, pr1, base1, vb1, L1, V1, BLOCK)
    if NR > 2:
        if sec == 3:
            _ratio(meta, ms0, ms1, o, b, s, S, W, win_width, m2, R2, pr2, base2, vb2, L2, V2, BLOCK)
    if NG > 0:
        if sec == 1 + NR:
            _ring(meta, ms0, ms1, tables, ts0, ts1, P, o, b, s, S, g0, c0, page_size // g0, scratch, gb0, hb0, BLOCK)
    if NG > 1:
        if sec == 2 + NR:
            _ring(meta, ms0, ms1, tables, ts0, ts1, P, o, b, s, S, g1, c1, page_size // g1, scratch, gb1, hb1, BLOCK)
    if NG > 2:
        if sec == 3 + NR:
            _ring(meta, ms0, ms1, tables, ts0, ts1, P, o, b, s, S, g2, c2, page_size // g2, scratch, gb2, hb2, BLOCK)


def step_indices(
    meta: torch.Tensor,
    tables: torch.Tensor | None,
    window: int,
    win_width: int,
    ratios: tuple[tuple[int, int, int, bool, bool], ...],
    rings: tuple[tuple[int, int], ...],
    page_size: int,
    scratch_page: int,
) -> tuple:
    """``ReferenceOps.step_indices`` in one launch (module docstring): the same structure, the same values, bit for
    bit. ``meta`` int64 ``[4, S]``, ``tables`` int64 ``[S, P]`` (any strides; None without ratios and rings)."""
    if len(ratios) > MAX_RATIOS or len(rings) > MAX_RINGS:
        raise ValueError(f"step_indices: at most {MAX_RATIOS} ratios and {MAX_RINGS} rings")
    if (ratios or rings) and tables is None:
        raise ValueError("step_indices: ratios and rings need block tables")
    s, dev = meta.shape[1], meta.device
    n64, n8, rat_at, ring_at = 4 * s + s * window + s * win_width, s, [], []
    for _, r, _, lists, visible in ratios:
        rat_at.append((n64, n8))
        n64 += 3 * s + (s + s * (win_width + r) if lists else 0)
        n8 += s * r if visible else 0
    for m, _ in rings:
        ring_at.append((n64, n8))
        n64, n8 = n64 + 4 * s + 2 * s * m, n8 + 2 * s
    o = torch.empty(n64, dtype=torch.long, device=dev)
    b = torch.empty(n8, dtype=torch.uint8, device=dev)
    rat_args, ring_args, flags = [], [], []
    for i in range(MAX_RATIOS):
        if i < len(ratios):
            m, r, pages, lists, visible = ratios[i]
            rat_args += [m, r, pages * (page_size // m), *rat_at[i]]
            flags += [bool(lists), bool(visible)]
        else:
            rat_args += [1, 0, 0, 0, 0]
            flags += [False, False]
    for i in range(MAX_RINGS):
        ring_args += [*rings[i], *ring_at[i]] if i < len(rings) else [1, 1, 0, 0]
    tab = tables if tables is not None else meta
    if s:
        _step_indices_kernel[(s, 1 + len(ratios) + len(rings))](
            meta, meta.stride(0), meta.stride(1), tab, tab.stride(0), tab.stride(1), tab.shape[1], o, b, s, window,
            win_width, page_size, scratch_page, *rat_args, *ring_args, NR=len(ratios), NG=len(rings),
            L0=flags[0], V0=flags[1], L1=flags[2], V1=flags[3], L2=flags[4], V2=flags[5], BLOCK=_BLOCK, num_warps=4,
            **pdl.launch(),
        )  # fmt: skip
    bb = b.view(torch.bool)
    win = (o[:s], bb[:s], o[s : 2 * s], o[4 * s : 4 * s + s * window], o[2 * s : 3 * s], o[3 * s : 4 * s],
           o[4 * s + s * window : 4 * s + s * window + s * win_width].view(s, win_width))  # fmt: skip
    per_ratio = []
    for (_, r, _, lists, visible), (at, vat) in zip(ratios, rat_at):
        vis = bb[vat : vat + s * r].view(s, r) if visible else None
        idx = o[at + 4 * s : at + 4 * s + s * (win_width + r)].view(s, win_width + r) if lists else None
        per_ratio.append((o[at : at + s], o[at + s : at + 2 * s], o[at + 2 * s : at + 3 * s], vis, idx,
                          o[at + 3 * s : at + 4 * s] if lists else None))  # fmt: skip
    per_ring = []
    for (m, _), (at, hat) in zip(rings, ring_at):
        cur = o[at + 4 * s : at + 4 * s + s * m].view(s, m)
        prev = o[at + 4 * s + s * m : at + 4 * s + 2 * s * m].view(s, m)
        at_, w, page, row = (o[at + k * s : at + (k + 1) * s] for k in range(4))
        per_ring.append((at_, cur, prev, bb[hat : hat + s].view(-1, 1, 1), w, bb[hat + s : hat + 2 * s], page, row))
    return win, tuple(per_ratio), tuple(per_ring)


@triton.jit
def _key_lists_kernel(ws_ptr, wc_ptr, sel_ptr, ss0, ss1, rs_ptr, rc_ptr, idx_ptr, cnt_ptr, win_width, C,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = win_width + C
    w_cnt = tl.load(wc_ptr + s)
    k = tl.minimum(tl.maximum(j - w_cnt, 0), tl.maximum(C - 1, 0))
    comp = tl.load(sel_ptr + s * ss0 + k * ss1, mask=(j < n) & (k < C), other=0) + tl.load(rs_ptr + s)
    comp = tl.where(C > 0, comp, 0)
    tl.store(idx_ptr + s * n + j, tl.where(j < w_cnt, tl.load(ws_ptr + s) + j, comp), mask=j < n)
    if tl.program_id(1) == 0:
        tl.store(cnt_ptr + s, w_cnt + tl.load(rc_ptr + s))


def key_lists(
    w_start: torch.Tensor,
    w_cnt: torch.Tensor,
    win_width: int,
    sel: torch.Tensor,
    r_start: torch.Tensor,
    r_cnt: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceOps.key_lists`` in one launch: int64 ``w_start``, ``w_cnt``, ``r_start``, ``r_cnt`` ``[S]``
    (contiguous), ``sel`` int64 ``[S, C]`` (any strides) → ``(idx [S, win_width + C], cnt [S])``, bit for bit."""
    s, c = sel.shape
    idx = torch.empty(s, win_width + c, dtype=torch.long, device=sel.device)
    cnt = torch.empty(s, dtype=torch.long, device=sel.device)
    block = max(16, min(1024, triton.next_power_of_2(max(win_width + c, 1))))
    if s:
        _key_lists_kernel[(s, triton.cdiv(max(win_width + c, 1), block))](
            w_start, w_cnt, sel, sel.stride(0), sel.stride(1), r_start, r_cnt, idx, cnt, win_width, c, BLOCK=block,
            num_warps=4, **pdl.launch(),
        )  # fmt: skip
    return idx, cnt


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _idx_ok(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda and t.dim() == 1 and t.dtype == torch.long and t.is_contiguous() for t in ts)


def _rows_ok(d: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> bool:
    return (d.is_cuda and s.is_cuda and d.dim() == s.dim() == 2 and d.stride(1) == s.stride(1) == 1
            and d.shape[1] == s.shape[1] and d.dtype in _FLOATS and s.dtype in _FLOATS and _idx_ok(x)
            and x.shape[0] == s.shape[0])  # fmt: skip


def _append_ok(dsts: list, idxs: list, srcs: list, take: torch.Tensor | None, out: torch.Tensor | None) -> bool:
    if not dsts or not all(_rows_ok(d, x, s) for d, x, s in zip(dsts, idxs, srcs)):
        return False
    if take is None:
        return out is None
    d, n = dsts[0], take.shape[0] if take.dim() == 1 else -1
    per = idxs[0].shape[0]
    fit = out is None or (out.dim() == 2 and out.shape == (n, d.shape[1]) and out.dtype == d.dtype
                          and out.stride(1) == 1 and out.device == d.device)  # fmt: skip
    return _idx_ok(take) and fit and (n == 0 or per > 0 and n % per == 0)


def _store_ok(store: torch.Tensor, page: torch.Tensor, row: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor,
              into: torch.Tensor | None) -> bool:  # fmt: skip
    s, n = page.shape[0] if page.dim() == 1 else -1, pages.shape[0] if pages.dim() == 1 else -1
    fit = into is None or (into.dim() == 3 and into.shape == (n, *store.shape[1:]) and into.dtype == store.dtype
                           and into.stride(2) == 1 and into.device == store.device)  # fmt: skip
    return (store.is_cuda and store.dim() == 3 and store.stride(2) == 1 and store.dtype in _FLOATS
            and _idx_ok(page, row) and pages.is_cuda and pages.dtype == torch.long and row.shape == page.shape
            and rows.dim() == 2
            and rows.shape == (s, store.shape[2]) and rows.stride(1) == 1 and rows.dtype in _FLOATS and rows.is_cuda
            and s > 0 and n % s == 0 and fit)  # fmt: skip


def fits(name: str, *args: object) -> bool:
    """Whether ``name(*args)`` runs here: CUDA tensors in the layouts the kernel takes (``NvidiaOps`` falls back to
    the reference otherwise)."""
    if name == "step_indices":
        meta, tables, _, _, ratios, rings = args[:6]
        return (meta.is_cuda and meta.dtype == torch.long and len(ratios) <= MAX_RATIOS and len(rings) <= MAX_RINGS
                and (tables is None and not ratios and not rings
                     or tables is not None and tables.dtype == torch.long and tables.is_cuda))  # fmt: skip
    if name == "key_lists":
        w_start, w_cnt, _, sel, r_start, r_cnt = args
        return sel.is_cuda and sel.dim() == 2 and sel.dtype == torch.long and _idx_ok(w_start, w_cnt, r_start, r_cnt)
    if name == "append_rows":
        return _append_ok(*args)
    if name == "store_rows":
        return _store_ok(*args)
    if name == "compress_score":
        gate, ape, pos, _ = args
        return (gate.is_cuda and gate.dtype == torch.float32 and gate.dim() == ape.dim() == 2 and gate.stride(1) == 1
                and ape.stride(1) == 1 and ape.dtype in _FLOATS and ape.shape[1] == gate.shape[1] and _idx_ok(pos)
                and pos.shape == gate.shape[:1])  # fmt: skip
    if name == "moe_combine":
        y, shared, dtype = args
        return (y.is_cuda and y.dtype == torch.float32 and y.is_contiguous() and shared.is_contiguous()
                and shared.shape == y.shape and shared.dtype in _FLOATS and dtype in _FLOATS)  # fmt: skip
    return False


__all__ = [
    "APPEND_MAX", "MAX_RATIOS", "MAX_RINGS", "append_rows", "compress_score", "fits", "key_lists", "moe_combine",
    "step_indices", "store_rows",
]  # fmt: skip
