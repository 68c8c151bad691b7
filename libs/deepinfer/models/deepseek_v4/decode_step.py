"""DeepSeek-V4's attention for a decode step (one new token per sequence) on pooled state, in fixed shapes.

Every per-sequence decision of a step is made on the device from a few integers per sequence, so the step is the same
kernels whatever each sequence's phase, and a whole step can be captured as one CUDA graph (``graphs.py``):

* ``V4DecodePlan``: per row (sequence) its pool slot, position, first window position and whether it is live (the
  padding rows of a graphed bucket are not: they use the pool's ``scratch`` slot and the cache's ``scratch_page``),
  its block table, and the widths of the step's lists (host ints: the exact maxima in an eager step, a bucket's
  maxima in a graphed one, ``span_for``).
* the window: the new row goes to ring row ``pos % W`` of the row's slot, then all ``W`` ring rows are read in
  position order; the last ``pos - first + 1`` of them are the row's window;
* the compressors: the new projections go to ring row ``pos % cap`` (``StatePool.rbufs``), and the groups that
  complete are pooled (``Compressor._rows`` over every row, ``ops.group_pool`` skipping the others: they pool zeros);
  a completed row is written to its page, the others to the scratch page;
* the compressed rows: the indexer scores the index keys of each row's first pages (``PagedKVCache`` stores, ``pages``
  per row: the rows past its count are other data, never listed) and keeps its top-k (CSA), and one
  ``ops.sparse_attention_lists`` runs over the per-row key lists (window rows by position, then compressed rows);
  both read the rows in their pages through the block tables (``paged``: nothing is gathered).

An eager step takes the same path (``Attention._attend_batched`` builds the plan once per step, ``StatePool.memo``),
with exact widths, so it gives the per-sequence path's results. What every layer derives alike from the plan (window
indices, key lists of the HCA layers, per ratio, per compressor ring) is made once per step (``V4DecodePlan.indices``:
``ops.step_indices``, one kernel on a GPU), as are the compressors' rotations of each ratio (``V4DecodePlan.once``); a
layer's ring appends and its window gather are one ``ops.append_rows``, a compressor's page writes one
``ops.store_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool, stacked_rows
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import StagedCopy, to_device

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.compressor import Compressor, Indexer
    from deepinfer.models.deepseek_v4.layers import RotaryTable

T = TypeVar("T")
SPAN_MIN = 1024  # the smallest span of a graphed step (positions): smaller contexts share its graphs


class AttentionLayer(Protocol):
    """What ``attend`` reads of a layer's attention (``attention.Attention``, which calls it)."""

    layer_id: int
    ratio: int  # compression ratio: 0 (window only), else the compressor's
    head_dim: int
    attn_sink: torch.Tensor
    compressor: Compressor | None
    indexer: Indexer | None  # CSA layers'


def span_for(end: int, page_size: int) -> int:
    """The span (positions) a graphed step reserves for sequences ending at most at ``end``: ``end`` rounded up to a
    quarter octave (at most 25% more rows read than needed, a few graphs per doubling of the context), a multiple of
    ``page_size``, at least ``SPAN_MIN``."""
    s = max(end, SPAN_MIN, page_size)
    step = max((1 << (s - 1).bit_length()) // 8, 1)
    s = -(-s // step) * step
    return -(-s // page_size) * page_size


@dataclass(eq=False)
class V4DecodePlan:
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
    ids: torch.Tensor | None = None  # a graphed bucket's token ids [S]: the row after ``meta`` in one buffer
    stage: StagedCopy | None = None  # the buffer's host copies (``fill``)

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
    def empty(cls, pool: StatePool, cache: PagedKVCache | None, window: int, size: int, span: int) -> V4DecodePlan:
        """A graphed bucket's plan: ``size`` rows, lists wide enough for positions below ``span``."""
        widths, tables = bucket_widths(cache, size, span, pool.device)
        meta, ids, stage = staged_meta(4, size, pool.device)
        return cls(pool, cache, window, meta, tables, window, widths, ids=ids, stage=stage)

    @classmethod
    def of(cls, pool: StatePool, cache: PagedKVCache | None, window: int, chunks: list[SeqChunk]) -> V4DecodePlan:
        """An eager step's plan: exactly as many rows as ``chunks``, exact widths."""
        slots = pool.adopt([c.state for c in chunks])
        pos, floor = [c.start for c in chunks], [c.state.window_start for c in chunks]
        widths, pages = step_widths(cache, max(pos) + 1)
        meta = to_device(torch.tensor([slots, pos, floor, [1] * len(pos)], dtype=torch.long), pool.device)
        tables = None if cache is None else block_tables(chunks, pages, cache)
        win_width = max(p - max(f, p - window + 1, 0) for p, f in zip(pos, floor)) + 1
        return cls(pool, cache, window, meta, tables, win_width, widths)

    @classmethod
    def stacked(cls, subs: list[V4DecodePlan]) -> V4DecodePlan:
        """One plan of the rows of ``subs`` (a verify step's sub-steps: the same block tables and widths), sub-step
        after sub-step (``verify_attention``)."""
        s0 = subs[0]
        tables = None if s0.tables is None else s0.tables.repeat(len(subs), 1)
        meta = torch.cat([s.meta for s in subs], 1)
        return cls(s0.pool, s0.cache, s0.window, meta, tables, max(s.win_width for s in subs), s0.widths)

    def fill(self, chunks: list[SeqChunk], slots: list[int], batch: ForwardBatch) -> None:
        """Load a graphed bucket's plan and token ids (``ids``) with the step ``batch`` of ``chunks`` (at most
        ``size`` of them, positions below its span; ``slots``: their pool slots, ``StatePool.adopt``): one host copy
        (``stage``) when the batch's ids are in host memory. The rows past them are padding: the scratch slot, not
        live (so they write only there and to the scratch page), token 0, stale block tables (valid page ids, read
        and never listed)."""
        n, cache = len(chunks), self.cache
        host = np.zeros((4, self.size), dtype=np.int64)
        host[0] = self.pool.scratch
        host[0, :n] = slots
        host[1, :n] = pos = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        host[2, :n] = np.fromiter((c.state.window_start for c in chunks), dtype=np.int64, count=n)
        host[3, :n] = 1
        load_meta(self.stage, self.ids, host, batch)
        if cache is not None:
            pages, held = step_widths(cache, int(pos.max()) + 1)[1], self.tables.shape[1]
            if pages > held:
                raise ValueError(f"decode step: {pages} pages a sequence needed, the bucket holds {held}")
            self.tables[:n, :pages].copy_(block_tables(chunks, pages, cache))

    # -- what every layer derives alike -----------------------------------------------------------------------
    def indices(self, ops: Ops) -> StepIndices:
        """Every index tensor the layers derive alike from the plan, once per step (``ops.step_indices``: one kernel
        on a GPU): the window's, per compression ratio (the mask of visible rows for the CSA layers' indexer, the key
        lists of every visible row for the HCA layers) and per compressor ring (``pool.ring_specs``)."""

        def make() -> StepIndices:
            ratios, rings = (), ()
            if self.cache is not None:
                specs = self.pool.ring_specs
                csa = {r for (_, name), (_, _, r, _) in specs.items() if name == "index"}
                hca = {r for (i, name), (_, _, r, _) in specs.items() if name == "main" and (i, "index") not in specs}
                ratios = tuple((m, rows, pages, m in hca, m in csa) for m, (rows, pages) in self.widths.items())
                rings = tuple(sorted({(r, cap) for cap, _, r, _ in specs.values()}))
            page_size, scratch = (self.cache.page_size, self.cache.scratch_page) if self.cache is not None else (1, 0)
            win, per_ratio, per_ring = ops.step_indices(self.meta, self.tables, self.window, self.win_width, ratios,
                                                        rings, page_size, scratch)  # fmt: skip
            return StepIndices(*win, dict(zip([r[0] for r in ratios], per_ratio)), dict(zip(rings, per_ring)))

        return self.once("indices", make)


def staged_meta(rows: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, StagedCopy]:
    """A graphed bucket's ``meta [rows, size]`` and token ids ``[size]``: one device buffer, loaded by one host copy a
    step (``load_meta``)."""
    buf = torch.zeros(rows + 1, size, dtype=torch.long, device=device)
    return buf[:rows], buf[rows], StagedCopy(buf)


def load_meta(stage: StagedCopy, ids: torch.Tensor, host: np.ndarray, batch: ForwardBatch) -> None:
    """Load ``staged_meta``'s buffer: the plan's rows ``host [rows, size]`` and the ``n`` token ids of ``batch`` (the
    padding ids 0) in one copy when the ids are in host memory, written straight into a pinned buffer of ``stage``
    when one is free (``StagedCopy.take``); ids already on the device (a previous step's samples) are copied there."""
    n, rows = batch.num_tokens, host.shape[0]
    if batch.host_token_ids is None:
        stage.copy(torch.from_numpy(host))
        ids[:n].copy_(batch.token_ids)
        return
    buf = stage.take()
    full = buf if buf is not None else np.empty((rows + 1, host.shape[1]), dtype=np.int64)
    full[:rows] = host
    full[rows, :n] = batch.host_token_ids.numpy()
    full[rows, n:] = 0
    if buf is not None:
        stage.send(rows + 1)
    else:  # no free buffer (counted by take) or host memory
        stage.copy_unstaged(torch.from_numpy(full))


def bucket_widths(
    cache: PagedKVCache | None, size: int, span: int, device: torch.device
) -> tuple[dict[int, tuple[int, int]], torch.Tensor | None]:
    """A graphed bucket's widths for positions below ``span`` (per ratio: rows, pages) and its block tables
    ``[size, pages]`` (the scratch page until a step fills them)."""
    if cache is None:
        return {}, None
    pages = span // cache.page_size
    widths = {m: (span // m, pages) for m in sorted(set(cache.ratios.values()))}
    return widths, torch.full((size, pages), cache.scratch_page, dtype=torch.long, device=device)


def step_widths(cache: PagedKVCache | None, top: int) -> tuple[dict[int, tuple[int, int]], int]:
    """Exact widths of a step for positions below ``top``: per ratio (rows, pages), and the most pages of any ratio."""
    widths, pages = {}, 1
    if cache is not None:
        for m in sorted(set(cache.ratios.values())):
            rows = top // m
            widths[m] = (rows, max(-(-rows // (cache.page_size // m)), 1))
            pages = max(pages, widths[m][1])
    return widths, pages


def block_tables(chunks: list[SeqChunk], pages: int, cache: PagedKVCache) -> torch.Tensor:
    """The chunks' block tables ``[n, pages]`` (zero-padded past a table's end: never written, never listed)."""
    m, ps = min(cache.ratios.values(), default=1), cache.page_size  # (a model of window layers only: 1)
    tables = [c.block_table for c in chunks]
    have = np.array([t.numel() for t in tables], dtype=np.int64)
    starts = np.array([c.start for c in chunks], dtype=np.int64)
    need = -(-((starts + 1) // m * m) // ps)  # the page of the last row of the smallest ratio, + 1
    short = np.flatnonzero(need > have)
    if short.size:
        i = int(short[0])
        raise IndexError(f"block table has {have[i]} pages, position {starts[i]} needs {need[i]}")
    t = stacked_rows(tables, int(have.max()))
    if t.shape[1] < pages:
        t = torch.nn.functional.pad(t, (0, pages - t.shape[1]))
    return t[:, :pages]


@dataclass(frozen=True, eq=False)
class StepIndices:
    """``ops.step_indices`` of a step (``V4DecodePlan.indices``). The window: ``first`` (first window position),
    ``live``, ``put [S]`` (the new row's row in the rings viewed ``[slots·W, d]``), ``take [S·W]`` (each row's ring
    rows in position order, ending at ``pos``), per row its window's first row in the gathered pool and count, and the
    key lists of a layer with no compressed rows (``lists``). ``ratios[m]``: ``(count, r_start, i_start, visible, idx,
    cnt)``: per row its visible compressed rows ``(pos + 1) // m`` and its row 0 in the gathered pool (after the
    ``S·W`` window rows) and in the index pool, the indexer's mask, the HCA layers' lists. ``rings[(m, cap)]``: a
    compressor ring's ``(at, cur, prev, has_prev, w, done, page, row)`` (``_compress``)."""

    first: torch.Tensor
    live: torch.Tensor
    put: torch.Tensor
    take: torch.Tensor
    w_start: torch.Tensor
    w_count: torch.Tensor
    lists: torch.Tensor
    ratios: dict[int, tuple]
    rings: dict[tuple[int, int], tuple]


def attend(
    attn: AttentionLayer, t: dict[str, torch.Tensor], plan: V4DecodePlan, rope: RotaryTable, ops: Ops
) -> torch.Tensor:
    """The attention output ``[S, H, d]`` of ``attn`` for the step ``plan`` (``project``'s tensors ``t``): writes the
    new window row and compressor projections, completes the groups that close, reads every row's keys."""
    kv, pool, ix = t["kv"], plan.pool, plan.indices(ops)
    ring = pool.rings[attn.layer_id]
    flat = ring.view(-1, ring.shape[-1])
    # the new rows first (the window reads positions first .. pos): the window's and the compressors', and the window
    # rows gathered after them, one call
    dsts, idxs, srcs = [flat], [ix.put], [kv]
    for name, comp in compressors(attn):
        bkv, bsc = pool.rbufs[(attn.layer_id, name)]
        at = ix.rings[(comp.ratio, bkv.shape[1])][0]
        dsts += [bkv.view(-1, bkv.shape[-1]), bsc.view(-1, bsc.shape[-1])]
        idxs += [at, at]
        srcs += [t[f"{name}_kv"], t[f"{name}_score"]]
    window = ops.append_rows(dsts, idxs, srcs, ix.take)
    for name, comp in compressors(attn):
        compress(comp, attn.layer_id, name, plan, rope, ops, kv.dtype)
    return read(attn, t, plan, window, ops)


def compressors(attn: AttentionLayer) -> list[tuple[str, Compressor]]:
    """A layer's compressors by ring name: its own (``main``) and its indexer's (``index``)."""
    comps = (("main", attn.compressor), ("index", attn.indexer and attn.indexer.compressor))
    return [(name, comp) for name, comp in comps if comp is not None]


def read(attn: AttentionLayer, t: dict[str, torch.Tensor], plan: V4DecodePlan, window: torch.Tensor, ops: Ops
         ) -> torch.Tensor:  # fmt: skip
    """The attention output of the step's rows once their keys are written: ``window`` (each row's ``W`` window rows,
    gathered in position order), the compressed rows in their pages (the indexer's top-k in a CSA layer, every
    visible row in an HCA one)."""
    q, ix, sink, scale, m = t["q"], plan.indices(ops), attn.attn_sink, attn.head_dim**-0.5, attn.ratio
    if attn.compressor is None:
        return ops.sparse_attention_lists(q, window, ix.lists, ix.w_count, sink, scale)
    # the keys: the window rows, then every row's compressed rows, read in their pages through the block tables
    # (kernels.paged_keys: nothing gathered; the lists number them as if gathered after the window rows)
    paged = (plan.cache.rows[attn.layer_id], _pages(plan, m))
    count, r_start, i_start, visible, idx, cnt = ix.ratios[m]
    if attn.indexer is not None:  # the indexer's rows; the HCA layers' lists (every visible row) are the plan's
        index = plan.cache.index_keys[attn.layer_id]  # its keys too read in their pages
        sel, r_cnt = attn.indexer.select_ranges(t["iq"], t["iw"], count, index.new_empty(0, index.shape[-1]), i_start,
                                                plan.widths[m][0], ops, visible, paged=(index, paged[1]))  # fmt: skip
        idx, cnt = ops.key_lists(ix.w_start, ix.w_count, plan.win_width, sel, r_start, r_cnt)
    return ops.sparse_attention_lists(q, window, idx, cnt, sink, scale, paged=paged)


def _pages(plan: V4DecodePlan, m: int) -> torch.Tensor:
    """Every row's first pages of compression ratio ``m``, one row after another ``[S·pages]``."""
    return plan.once(("pages", m), lambda: plan.tables[:, : plan.widths[m][1]].reshape(-1))


def compress(comp: Compressor, layer: int, name: str, plan: V4DecodePlan, rope: RotaryTable, ops: Ops,
             dtype: torch.dtype, source: tuple | None = None) -> None:  # fmt: skip
    """Pool the groups that complete (``ops.group_pool`` over the compressor's rings, where ``attend`` appended the
    step's projections: the other rows pool zeros) and store every row's result, the completed ones in their pages,
    the rest in the scratch page (``ops.store_rows`` with no gather: the readers read the pages). ``source``: the
    projections ``(kv, score)`` flat and the groups' rows ``(cur, prev)`` in them, where they are not the ring's (a
    verify step's: ``verify_attention``)."""
    m, cache = comp.ratio, plan.cache
    store = cache.rows[layer] if name == "main" else cache.index_keys[layer]
    bkv, bsc = plan.pool.rbufs[(layer, name)]
    _, cur, prev, has_prev, w, done, page, row = plan.indices(ops).rings[(m, bkv.shape[1])]
    fk, fs = bkv.view(-1, bkv.shape[-1]), bsc.view(-1, bsc.shape[-1])
    if source is not None:
        fk, fs, cur, prev = source
    cos_sin = plan.once(("rope", m, rope), lambda: rope(w * m, ops))  # the same for every compressor of this ratio
    rows = comp._rows(fk, fs, cur, prev, has_prev, w, rope, ops, dtype, live=done, cos_sin=cos_sin)
    ops.store_rows(store, page, row, rows, page[:0])


__all__ = [
    "SPAN_MIN",
    "AttentionLayer",
    "StepIndices",
    "V4DecodePlan",
    "attend",
    "block_tables",
    "bucket_widths",
    "compress",
    "compressors",
    "load_meta",
    "read",
    "span_for",
    "staged_meta",
    "step_widths",
]
