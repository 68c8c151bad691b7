"""DeepSeek-V4's attention for a decode step (one new token per sequence) on pooled state, in fixed shapes.

Every per-sequence decision of a step is made on the device from a few integers per sequence, so the step is the same
kernels whatever each sequence's phase, and a whole step can be captured as one CUDA graph (``graphs.py``):

* ``StepPlan``: per row (sequence) its pool slot, position, first window position and whether it is live (the padding
  rows of a graphed bucket are not: they use the pool's ``scratch`` slot and the cache's ``scratch_page``), its
  block table, and the widths of the step's lists (host ints: the exact maxima in an eager step, a bucket's
  maxima in a graphed one, ``span_for``).
* the window: the new row goes to ring row ``pos % W`` of the row's slot, then all ``W`` ring rows are read in
  position order; the last ``pos - first + 1`` of them are the row's window;
* the compressors: the new projections go to ring row ``pos % cap`` (``StatePool.rbufs``), and the groups that
  complete are pooled (``Compressor._rows`` over every row, ``ops.group_pool`` skipping the others: they pool zeros);
  a completed row is written to its page, the others to the scratch page;
* the compressed rows: each row's first pages are gathered (``PagedKVCache`` stores, ``pages`` per row: the rows
  past its count are other data, never listed), the indexer scores them and keeps its top-k (CSA), and one
  ``ops.sparse_attention_lists`` runs over the per-row key lists (window rows by position, then compressed rows).

An eager step takes the same path (``Attention._attend_batched`` builds the plan once per step, ``StatePool.memo``),
with exact widths, so it gives the per-sequence path's results. What every layer derives alike from the plan (window
indices, key lists of the HCA layers, per ratio) is made once per step (``StepPlan.once``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from deepinfer.host_copy import to_device
from deepinfer.models.deepseek_v4.state import PagedKVCache, SeqChunk
from deepinfer.models.deepseek_v4.state_pool import StatePool, stacked_rows
from deepinfer.ops import Ops

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.attention import Attention
    from deepinfer.models.deepseek_v4.compressor import Compressor
    from deepinfer.models.deepseek_v4.layers import RotaryTable

T = TypeVar("T")
SPAN_MIN = 1024  # the smallest span of a graphed step (positions): smaller contexts share its graphs


def span_for(end: int, page_size: int) -> int:
    """The span (positions) a graphed step reserves for sequences ending at most at ``end``: ``end`` rounded up to a
    quarter octave (at most 25% more rows read than needed, a few graphs per doubling of the context), a multiple of
    ``page_size``, at least ``SPAN_MIN``."""
    s = max(end, SPAN_MIN, page_size)
    step = max((1 << (s - 1).bit_length()) // 8, 1)
    s = -(-s // step) * step
    return -(-s // page_size) * page_size


@dataclass(eq=False)
class StepPlan:
    """One decode step's rows (module docstring). ``meta [4, S]`` on the device: slot, position, the lowest window
    position (``window_start``) and liveness; ``tables [S, P]``. Host ints: ``win_width`` (window entries listed per
    row) and ``widths`` (per compression ratio: rows listed per row, pages gathered per row)."""

    pool: StatePool
    cache: PagedKVCache | None
    window: int
    meta: torch.Tensor
    tables: torch.Tensor | None
    win_width: int
    widths: dict[int, tuple[int, int]]
    derived: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.meta.shape[1]

    def once(self, key: object, make: Callable[[], T]) -> T:
        """``make()`` once per step (``derived`` is cleared when a step starts)."""
        got = self.derived.get(key)
        if got is None:
            got = self.derived[key] = make()
        return got

    # -- building ------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, pool: StatePool, cache: PagedKVCache | None, window: int, size: int, span: int) -> StepPlan:
        """A graphed bucket's plan: ``size`` rows, lists wide enough for positions below ``span``."""
        dev = pool.device
        widths, pages = {}, 1
        if cache is not None:
            pages = span // cache.page_size
            widths = {m: (span // m, pages) for m in sorted(set(cache.ratios.values()))}
        tables = None if cache is None else torch.full((size, pages), cache.scratch_page, dtype=torch.long, device=dev)
        meta = torch.zeros(4, size, dtype=torch.long, device=dev)
        return cls(pool, cache, window, meta, tables, window, widths)

    @classmethod
    def of(cls, pool: StatePool, cache: PagedKVCache | None, window: int, chunks: list[SeqChunk]) -> StepPlan:
        """An eager step's plan: exactly as many rows as ``chunks``, exact widths."""
        slots = pool.adopt([c.state for c in chunks])
        pos, floor = [c.start for c in chunks], [c.state.window_start for c in chunks]
        widths, pages = cls._widths(cache, max(pos) + 1)
        meta = to_device(torch.tensor([slots, pos, floor, [1] * len(pos)], dtype=torch.long), pool.device)
        tables = None if cache is None else cls._tables(chunks, pos, pages, cache)
        win_width = max(p - max(f, p - window + 1, 0) for p, f in zip(pos, floor)) + 1
        return cls(pool, cache, window, meta, tables, win_width, widths)

    def fill(self, chunks: list[SeqChunk], slots: list[int]) -> None:
        """Load a graphed bucket's plan with the step of ``chunks`` (at most ``size`` of them, positions below its
        span; ``slots``: their pool slots, ``StatePool.adopt``). The rows past them are padding: the scratch slot,
        not live (so they write only there and to the scratch page), stale block tables (valid page ids, read and
        never listed)."""
        n, pad, cache = len(chunks), self.size - len(chunks), self.cache
        pos = [c.start for c in chunks]
        host = [slots + [self.pool.scratch] * pad, pos + [0] * pad, [c.state.window_start for c in chunks] + [0] * pad,
                [1] * n + [0] * pad]  # fmt: skip
        _copy_in(self.meta, torch.tensor(host, dtype=torch.long))
        if cache is not None:
            pages, held = self._widths(cache, max(pos) + 1)[1], self.tables.shape[1]
            if pages > held:
                raise ValueError(f"decode step: {pages} pages a sequence needed, the bucket holds {held}")
            self.tables[:n, :pages].copy_(self._tables(chunks, pos, pages, cache))

    @staticmethod
    def _widths(cache: PagedKVCache | None, top: int) -> tuple[dict[int, tuple[int, int]], int]:
        """Exact widths for positions below ``top``: per ratio (rows, pages), and the most pages of any ratio."""
        widths, pages = {}, 1
        if cache is not None:
            for m in sorted(set(cache.ratios.values())):
                rows = top // m
                widths[m] = (rows, max(-(-rows // (cache.page_size // m)), 1))
                pages = max(pages, widths[m][1])
        return widths, pages

    @staticmethod
    def _tables(chunks: list[SeqChunk], pos: list[int], pages: int, cache: PagedKVCache) -> torch.Tensor:
        """The block tables ``[n, pages]`` (zero-padded past a table's end: never written, never listed)."""
        m, ps = min(cache.ratios.values()), cache.page_size
        for c, p in zip(chunks, pos):
            need = -(-((p + 1) // m * m) // ps)  # the page of the last row of the smallest ratio, + 1
            if need > c.block_table.numel():
                raise IndexError(f"block table has {c.block_table.numel()} pages, position {p} needs {need}")
        t = stacked_rows([c.block_table for c in chunks])
        if t.shape[1] < pages:
            t = torch.nn.functional.pad(t, (0, pages - t.shape[1]))
        return t[:, :pages]

    # -- what every layer derives alike -----------------------------------------------------------------------
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``slot``, ``pos``, ``first`` (first window position) and ``live`` on the device."""

        def make() -> tuple[torch.Tensor, ...]:
            slot, pos, floor, live = self.meta
            return slot, pos, torch.maximum(floor, (pos - self.window + 1).clamp_min(0)), live.bool()

        return self.once("rows", make)

    def window_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``put [S]`` (the new row's row in the rings viewed ``[slots·W, d]``), ``take [S·W]`` (each row's ring rows
        in position order, ending at ``pos``), and per row its window's first row in the gathered pool and count."""

        def make() -> tuple[torch.Tensor, ...]:
            slot, pos, first, _ = self.rows()
            w = self.window
            base = slot * w
            j = torch.arange(w, device=pos.device)
            take = (base.unsqueeze(1) + (pos.unsqueeze(1) - w + 1 + j) % w).flatten()
            count = pos - first + 1
            start = torch.arange(self.size, device=pos.device) * w + (w - count)
            return base + pos % w, take, start, count

        return self.once("window", make)

    def window_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key lists of a layer with no compressed rows: each row's window rows."""

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            _, _, start, count = self.window_rows()
            return start.unsqueeze(1) + torch.arange(self.win_width, device=start.device), count

        return self.once("window lists", make)

    def ratio_rows(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row its visible compressed rows of ratio ``m`` (``(pos + 1) // m``) and its row 0 in the gathered pool
        (after the ``S·W`` window rows)."""

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            _, pos, _, _ = self.rows()
            per_row = self.widths[m][1] * (self.cache.page_size // m)
            return (pos + 1) // m, self.size * self.window + torch.arange(self.size, device=pos.device) * per_row

        return self.once(("ratio", m), make)

    def key_lists(self, r_idx: torch.Tensor, r_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window rows then the compressed rows ``r_idx [S, R]`` (pool rows, the first ``r_cnt`` valid)."""
        _, _, w_start, w_cnt = self.window_rows()
        width, c_width = self.win_width, r_idx.shape[1]
        j = torch.arange(width + c_width, device=r_idx.device).unsqueeze(0)
        cw = w_cnt.unsqueeze(1)
        comp = torch.gather(r_idx, 1, (j - cw).clamp(0, max(c_width - 1, 0))) if c_width else torch.zeros_like(j)
        return torch.where(j < cw, w_start.unsqueeze(1) + j, comp), w_cnt + r_cnt


def attend(attn: Attention, t: dict[str, torch.Tensor], plan: StepPlan, rope: RotaryTable, ops: Ops) -> torch.Tensor:
    """The attention output ``[S, H, d]`` of ``attn`` for the step ``plan`` (``project``'s tensors ``t``): writes the
    new window row and compressor projections, completes the groups that close, reads every row's keys."""
    q, kv, pool = t["q"], t["kv"], plan.pool
    ring = pool.rings[attn.layer_id]
    flat = ring.view(-1, ring.shape[-1])
    put, take, _, _ = plan.window_rows()
    flat.index_copy_(0, put, kv.to(flat.dtype))  # the new row first: the window reads positions first .. pos
    sink, scale = attn.attn_sink, attn.head_dim**-0.5
    if attn.compressor is None:
        idx, cnt = plan.window_lists()
        return ops.sparse_attention_lists(q, flat.index_select(0, take), idx, cnt, sink, scale)
    m = attn.ratio
    # one key pool: the window rows, then every row's compressed rows, each gathered straight into its place
    store, nw = plan.cache.rows[attn.layer_id], take.numel()
    keys = into = None
    if store.dtype == flat.dtype:
        size = plan.size * plan.widths[m][1]  # pages
        keys = torch.empty(nw + size * store.shape[1], flat.shape[-1], dtype=flat.dtype, device=flat.device)
        torch.index_select(flat, 0, take, out=keys[:nw])
        into = keys[nw:].view(size, *store.shape[1:])
    rows = _compress(attn.compressor, attn.layer_id, "main", t["main_kv"], t["main_score"], plan, rope, ops, kv.dtype,
                     into)  # fmt: skip
    if keys is None:  # a store of another dtype: the pool is their concatenation (with its type promotion)
        keys = torch.cat([flat.index_select(0, take), rows])
    count, r_start = plan.ratio_rows(m)
    width = plan.widths[m][0]
    if attn.indexer is not None:
        index = _compress(attn.indexer.compressor, attn.layer_id, "index", t["index_kv"], t["index_score"], plan,
                          rope, ops, kv.dtype)  # fmt: skip
        i_start = r_start - plan.size * plan.window  # the index pool holds no window rows
        sel, r_cnt = attn.indexer.select_ranges(t["iq"], t["iw"], count, index, i_start, width, ops)
        idx, cnt = plan.key_lists(sel + r_start.unsqueeze(1), r_cnt)
    else:  # every visible row: the same lists in every layer of this ratio
        idx, cnt = plan.once(("all rows", m), lambda: plan.key_lists(
            r_start.unsqueeze(1) + torch.arange(width, device=q.device), count))  # fmt: skip
    return ops.sparse_attention_lists(q, keys, idx, cnt, sink, scale)


def _compress(
    comp: Compressor,
    layer: int,
    name: str,
    kv: torch.Tensor,
    score: torch.Tensor,
    plan: StepPlan,
    rope: RotaryTable,
    ops: Ops,
    dtype: torch.dtype,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append the step's projections to the compressor's rings, pool the groups that complete (``ops.group_pool``:
    the other rows pool zeros) and store every row's result, the completed ones in their pages, the rest in the
    scratch page; return every row's first ``pages`` pages of rows ``[S·pages·per page, dim]``, gathered into
    ``into`` (``[S·pages, per page, dim]`` of the store's dtype) when given."""
    m, cache = comp.ratio, plan.cache
    store = cache.rows[layer] if name == "main" else cache.index_keys[layer]
    bkv, bsc = plan.pool.rbufs[(layer, name)]
    cap, per_page = bkv.shape[1], cache.page_size // m

    def groups() -> tuple[torch.Tensor, ...]:  # the same for every compressor of this ratio and width
        slot, pos, _, live = plan.rows()
        floor = plan.meta[2]  # the state's window_start: a bounded replay's buffers start there
        base = (slot * cap).unsqueeze(1)
        w = ((pos + 1) // m - 1).clamp_min(0)
        j = torch.arange(m, device=pos.device)
        first = floor.unsqueeze(1)  # positions below it clamp to it, as the per-sequence path's indices do
        cur = base + torch.maximum(w.unsqueeze(1) * m + j, first) % cap
        prev = base + torch.maximum((w.unsqueeze(1) - 1) * m + j, first) % cap
        done = live & ((pos + 1) % m == 0)
        page = torch.where(done, plan.tables.gather(1, (w // per_page).unsqueeze(1)).squeeze(1), cache.scratch_page)
        return base.squeeze(1) + pos % cap, cur, prev, (w > 0).view(-1, 1, 1), w, done, page, w % per_page

    at, cur, prev, has_prev, w, done, page, row = plan.once(("groups", m, cap), groups)
    fk, fs = bkv.view(-1, bkv.shape[-1]), bsc.view(-1, bsc.shape[-1])
    fk.index_copy_(0, at, kv.float())
    fs.index_copy_(0, at, score.float())
    rows = comp._rows(fk, fs, cur, prev, has_prev, w, rope, ops, dtype, live=done)
    store[page, row] = rows.to(store.dtype)
    pages = plan.once(("pages", m), lambda: plan.tables[:, : plan.widths[m][1]].reshape(-1))
    return torch.index_select(store, 0, pages, out=into).flatten(0, 1)


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` from host memory without waiting for the GPU (``host_copy.to_device``)."""
    dst.copy_(to_device(src, dst.device))


__all__ = ["SPAN_MIN", "StepPlan", "attend", "span_for"]
