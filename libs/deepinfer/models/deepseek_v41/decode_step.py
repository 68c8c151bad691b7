"""DeepSeek-V4.1's attention for a decode step (one new token per sequence) on pooled state, in fixed shapes.

The V4.1 port of ``deepseek_v4.decode_step``: every per-sequence decision of a step is made on the device from a few
integers per sequence, so the step is the same kernels whatever each sequence's phase, and a whole step can be
captured as one CUDA graph (``graphs.py``).

* ``V41DecodePlan``: per row (sequence) its pool slot, position, the lowest window position of the encoder layers
  (``window_start``) and of the decoder layers (``decoder_start`` too: a bounded decoder replay started there) and
  whether it is live (the padding rows of a graphed bucket are not: they use the pool's ``scratch`` slot and the
  cache's ``scratch_page``), its block table, and the widths of the step's lists (host ints: the exact maxima in an
  eager step, a bucket's maxima in a graphed one, ``deepseek_v4.decode_step.span_for``).
* what every layer derives alike (window indices per stage, per ratio its visible rows and list offsets, per ratio
  the compressed row a token falls in and the page it goes to, the ratio-2 rings' groups) is made once per step by
  ``ops.step_indices`` (V4's, one kernel on a GPU): once over the encoder rows of ``meta``, once over the decoder rows
  (their window floor);
* the window of every layer: the new row goes to ring row ``pos % W`` of the row's slot, then all ``W`` ring rows are
  read in position order; the last ``pos - first + 1`` of them are the row's window (with a ratio-2 KV source's ring
  appends, one ``ops.append_rows``);
* the KV sources (Full layers): a ratio-2 compressor's projections go to ring row ``pos % 2`` (``StatePool.rbufs``,
  registered by ``Attention.pool_specs``), and every row's group is pooled (``ops.group_pool``: the rows that complete
  nothing pool zeros); ratio 1 emits a row per token. Every row's compressed row and index key (rotated, rounded) is
  written to its page, or to the scratch page when it completes nothing (``ops.store_rows``);
* an index source scores the owner's index keys of every row's first pages (``ops.indexer_scores_ranges``, read in
  their pages; ``PagedKVCache`` stores, ``pages`` per row: the rows past its count are other data, never listed),
  the candidate source keeps its
  candidate blocks, later index sources restrict to them, and the top-k (``ops.select_rows``) is handed to the Reuse
  layers after it; one ``ops.sparse_attention_lists`` runs over the per-row key lists (``ops.key_lists``: window rows
  by position, then the selected rows), reading the owner's compressed rows in their pages (``paged``: no copy).

An eager step takes the same path (``Attention.attend`` builds the plan once per step, ``StepContext.plan``) with
exact widths, so it gives the per-sequence path's results bit for bit (``tests/models/test_v41_state_pool.py``).
The index keys of a ratio-2 owner are projected one row at a time in every path (``Indexer.keys``' ``rowwise``):
this step computes every row's key, the per-sequence path only the completed ones, and a GEMM's rows round with the
number of rows computed together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from deepinfer.models.deepseek_v4.decode_step import (
    SPAN_MIN,
    StepIndices,
    block_tables,
    bucket_widths,
    load_meta,
    span_for,
    staged_meta,
    step_widths,
)
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v41.indexer import candidate_blocks
from deepinfer.models.deepseek_v41.step_context import AttentionLayer
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import StagedCopy, to_device

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.layers import RotaryTable

T = TypeVar("T")
POS = 1  # ``V41DecodePlan.meta``: rows 0-3 slot, position, encoder window floor, live; rows 4-7 the same, decoder floor


def pooled_decode(chunks: list[SeqChunk]) -> bool:
    """Whether a step is a decode step this module runs: one new token per sequence, no bounded (decoder) replay."""
    return bool(chunks) and all(
        c.length == 1 and c.decoder_from is None and c.state.replay_until <= c.start for c in chunks
    )


@dataclass(eq=False)
class V41DecodePlan:
    """One decode step's rows (module docstring). ``meta [8, S]`` on the device: slot, position, lowest window
    position and liveness of the encoder layers (rows 0-3: V4's ``meta``) and of the decoder layers (rows 4-7);
    ``tables [S, P]``. Host ints: ``win_widths`` (window entries listed per row, encoder and decoder layers) and
    ``widths`` (per compression ratio: rows listed per row, pages gathered per row)."""

    pool: StatePool
    cache: PagedKVCache | None
    window: int
    meta: torch.Tensor
    tables: torch.Tensor | None
    win_widths: tuple[int, int]
    widths: dict[int, tuple[int, int]]
    derived: dict = field(default_factory=dict)  # what the layers share within one step (``once``)
    ids: torch.Tensor | None = None  # a graphed bucket's token ids [S]: the row after ``meta`` in one buffer
    stage: StagedCopy | None = None  # the buffer's host copies (``fill``)

    @property
    def size(self) -> int:
        return self.meta.shape[1]

    def once(self, key: object, make: Callable[[], T]) -> T:
        """``make()`` once per step (``derived`` is cleared when a graphed step starts; an eager step has its own
        plan)."""
        got = self.derived.get(key)
        if got is None:
            got = self.derived[key] = make()
        return got

    # -- building ------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, pool: StatePool, cache: PagedKVCache | None, window: int, size: int, span: int) -> V41DecodePlan:
        """A graphed bucket's plan: ``size`` rows, lists wide enough for positions below ``span``."""
        widths, tables = bucket_widths(cache, size, span, pool.device)
        meta, ids, stage = staged_meta(8, size, pool.device)
        return cls(pool, cache, window, meta, tables, (window, window), widths, ids=ids, stage=stage)

    @classmethod
    def of(cls, pool: StatePool, cache: PagedKVCache | None, window: int, chunks: list[SeqChunk],
           span: int | None = None) -> V41DecodePlan:  # fmt: skip
        """An eager step's plan: exactly as many rows as ``chunks``, exact widths (``span``: a graphed bucket's
        widths instead, for positions below it)."""
        slots = pool.adopt([c.state for c in chunks])
        host = cls._host_meta(chunks, slots, 0)
        pos = host[POS]
        widths, pages = step_widths(cache, int(pos.max()) + 1)
        if span is not None and cache is not None:
            pages = max(span // cache.page_size, pages)
            widths = {m: (span // m, pages) for m in widths}
        tables = None if cache is None else block_tables(chunks, pages, cache)
        if span is not None:
            win_widths = (window, window)
        else:
            first = [torch.maximum(host[f], (pos - window + 1).clamp_min(0)) for f in (2, 6)]
            win_widths = tuple(int((pos - f).max()) + 1 for f in first)
        return cls(pool, cache, window, to_device(host, pool.device), tables, win_widths, widths)

    @classmethod
    def stacked(cls, subs: list[V41DecodePlan]) -> V41DecodePlan:
        """One plan of the rows of ``subs`` (a verify step's sub-steps: the same block tables and widths), sub-step
        after sub-step (``deepseek_v4.verify_attention``)."""
        s0 = subs[0]
        tables = None if s0.tables is None else s0.tables.repeat(len(subs), 1)
        wins = tuple(max(s.win_widths[i] for s in subs) for i in (0, 1))
        return cls(s0.pool, s0.cache, s0.window, torch.cat([s.meta for s in subs], 1), tables, wins, s0.widths)

    def fill(self, chunks: list[SeqChunk], slots: list[int], batch: ForwardBatch) -> None:
        """Load a graphed bucket's plan and token ids (``ids``) with the step ``batch`` of ``chunks`` (at most
        ``size`` of them, positions below its span; ``slots``: their pool slots, ``StatePool.adopt``): one host copy
        (``stage``) when the batch's ids are in host memory. The rows past them are padding: the scratch slot, not
        live (so they write only there and to the scratch page), token 0, stale block tables (valid page ids, read
        and never listed)."""
        n, cache = len(chunks), self.cache
        host = self._host_meta(chunks, slots, self.size - n, self.pool.scratch)
        load_meta(self.stage, self.ids, host.numpy(), batch)
        if cache is not None:
            pages, held = step_widths(cache, int(host[POS, :n].max()) + 1)[1], self.tables.shape[1]
            if pages > held:
                raise ValueError(f"decode step: {pages} pages a sequence needed, the bucket holds {held}")
            self.tables[:n, :pages].copy_(block_tables(chunks, pages, cache))

    @staticmethod
    def _host_meta(chunks: list[SeqChunk], slots: list[int], pad: int, scratch: int = 0) -> torch.Tensor:
        """``meta`` in host memory: ``pad`` padding rows after the chunks' (slot ``scratch``, position 0, not live)."""
        rows = []
        for c, s in zip(chunks, slots):
            st = c.state
            rows.append((s, c.start, st.window_start, 1, s, c.start, max(st.window_start, st.decoder_start), 1))
        rows += [(scratch, 0, 0, 0, scratch, 0, 0, 0)] * pad
        return torch.tensor(rows, dtype=torch.long).t().contiguous()

    # -- what every layer derives alike (once per step) -------------------------------------------------------
    def indices(self, ops: Ops) -> StepIndices:
        """``ops.step_indices`` over the encoder rows of ``meta``: the window's (encoder layers), per compression
        ratio (visible rows, list offsets, the indexer's mask) and per ratio a ring of ``m`` rows (the compressed row
        each token falls in, whether it completes it, its page and row; the ratio-2 compressors' groups)."""

        def make() -> StepIndices:
            ratios = tuple((m, rows, pages, False, True) for m, (rows, pages) in self.widths.items())
            rings = tuple((m, m) for m in self.widths)
            page_size, scratch = (self.cache.page_size, self.cache.scratch_page) if self.cache is not None else (1, 0)
            win, per_ratio, per_ring = ops.step_indices(self.meta[:4], self.tables, self.window, self.win_widths[0],
                                                        ratios, rings, page_size, scratch)  # fmt: skip
            return StepIndices(*win, dict(zip(self.widths, per_ratio)), dict(zip(rings, per_ring)))

        return self.once("indices", make)

    def window_lists(self, ops: Ops, decoder: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row its window's first row in the gathered ``[S·W]`` rows, its count and its window key list
        ``[S, width]`` (``start + j``; entries past the count are never read), of the encoder or decoder layers."""
        if not decoder:
            ix = self.indices(ops)
            return ix.w_start, ix.w_count, ix.lists

        def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            win = ops.step_indices(self.meta[4:], None, self.window, self.win_widths[1], (), (), 1, 0)[0]
            return win[4], win[5], win[6]

        return self.once("decoder window", make)


def attend(
    attn: AttentionLayer, t: dict[str, torch.Tensor], plan: V41DecodePlan, rope: RotaryTable, ops: Ops
) -> torch.Tensor:
    """The attention output ``[S, H, d]`` of ``attn`` for the step ``plan`` (``Attention.project``'s tensors ``t``):
    writes the new window row (and, in a KV source, the compressed row and index key), selects (index sources) or
    reuses the latest selection, and attends over every row's keys."""
    kv, pool, ix, m = t["kv"], plan.pool, plan.indices(ops), attn.ratio
    ring = pool.rings[attn.layer_id]
    # the new rows first (the window reads positions first .. pos): the window's and a ratio-2 compressor's, and the
    # window rows gathered after them, one call
    dsts, idxs, srcs = [ring.view(-1, ring.shape[-1])], [ix.put], [kv]
    if attn.compressor is not None and m > 1:
        bkv, bsc = pool.rbufs[(attn.layer_id, "main")]
        at = ix.rings[(m, m)][0]
        dsts += [bkv.view(-1, bkv.shape[-1]), bsc.view(-1, bsc.shape[-1])]
        idxs += [at, at]
        srcs += [t["ckv"], t["cgate"]]
    window = ops.append_rows(dsts, idxs, srcs, ix.take)
    if m and attn.compressor is not None:
        publish(attn, t, plan, rope, ops, kv.dtype)
    return read(attn, t, plan, window, ops)


def _cache(attn: AttentionLayer, plan: V41DecodePlan) -> PagedKVCache:
    if plan.cache is None:
        raise ValueError(f"layer {attn.layer_id} is compressed and needs a PagedKVCache")
    return plan.cache


def read(attn: AttentionLayer, t: dict[str, torch.Tensor], plan: V41DecodePlan, window: torch.Tensor, ops: Ops
         ) -> torch.Tensor:  # fmt: skip
    """The attention output of the step's rows once their keys are written: ``window`` (each row's ``W`` window rows,
    gathered in position order), then (a compressed layer) the selection (an index source's, or the latest one) of
    the owner's compressed rows, read in their pages."""
    q, ix, m = t["q"], plan.indices(ops), attn.ratio
    w_start, w_cnt, w_idx = plan.window_lists(ops, attn.spec.stage == "decoder")
    sink, scale = attn.attn_sink, attn.head_dim**-0.5
    if not m:
        return ops.sparse_attention_lists(q, window, w_idx, w_cnt, sink, scale)
    cache = _cache(attn, plan)
    if attn.indexer is not None:
        plan.derived["selection"] = _select(attn, t["iq"], t["iw"], plan, ops)
    got = plan.derived.get("selection")
    if got is None or got[0].shape[0] != q.shape[0]:
        raise ValueError(f"layer {attn.layer_id} reuses a selection no index source made for this step")
    sel, cnt = got
    idx, cnt = ops.key_lists(w_start, w_cnt, w_idx.shape[1], sel, ix.ratios[m][1], cnt)
    # the owner's compressed rows read in their pages (kernels.paged_keys: the lists number them after the window)
    paged = (cache.rows[attn.spec.kv_source], _pages(plan, m))
    return ops.sparse_attention_lists(q, window, idx, cnt, sink, scale, paged=paged)


def _pages(plan: V41DecodePlan, m: int) -> torch.Tensor:
    """Every row's first pages of compression ratio ``m``, one row after another ``[S·pages]``."""
    return plan.once(("pages", m), lambda: plan.tables[:, : plan.widths[m][1]].reshape(-1))


def publish(attn: AttentionLayer, t: dict[str, torch.Tensor], plan: V41DecodePlan, rope: RotaryTable, ops: Ops,
            dtype: torch.dtype, source: tuple | None = None) -> None:  # fmt: skip
    """A KV source's compressed row and index key of every row (``Attention._publish``'s values for the rows that
    complete one) written to its page, the others to the scratch page (both are read in their pages). ``source``:
    the projections ``(kv, score)`` flat and the groups' rows ``cur`` in them, where they are not the ring's (a
    verify step's: ``deepseek_v4.verify_attention``)."""
    comp, m, layer, cache = attn.compressor, attn.ratio, attn.layer_id, _cache(attn, plan)
    _, cur, _, has_prev, w, done, page, row = plan.indices(ops).rings[(m, m)]
    if m == 1:  # a row per token
        lat = comp.norm(t["ckv"], ops)
    else:  # every row's group pooled from the ring (``attend`` appended this step's projections; rows not done: 0)
        bkv, bsc = plan.pool.rbufs[(layer, "main")]
        fk, fs = bkv.view(-1, bkv.shape[-1]), bsc.view(-1, bsc.shape[-1])
        if source is not None:
            fk, fs, cur = source
        d = fk.shape[-1]
        lat = comp.norm(ops.group_pool(fk, fs, cur, None, has_prev, done, d).to(dtype), ops)
    cos, sin = plan.once(("rope", m, rope), lambda: rope(w * m, ops))
    rows = ops.rope(lat, cos, sin)
    ik = ops.rope(attn.indexer.keys(lat, ops, rowwise=m > 1), cos, sin)
    if attn.quant_sim:
        rows, ik = ops.cache_round(rows, "nvfp4"), ops.cache_round(ik, "mxfp4")
    ops.store_rows(cache.rows[layer], page, row, rows, page[:0])
    ops.store_rows(cache.index_keys[layer], page, row, ik, page[:0])


def _select(attn: AttentionLayer, iq: torch.Tensor, iw: torch.Tensor, plan: V41DecodePlan, ops: Ops
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """An index source's selection for every row: owner rows ``[S, k]`` (ascending, valid first) and counts
    (``attention_batched._select`` over the plan's pools)."""
    ix, m = attn.indexer, attn.ratio
    width = plan.widths[m][0]
    visible, _, start, allowed, _, _ = plan.indices(ops).ratios[m]
    if width == 0:
        if ix.candidate_source:
            plan.derived["candidates"] = allowed
        none = torch.zeros(iq.shape[0], 0, dtype=torch.long, device=iq.device)
        return none, none.sum(1)
    keys = plan.cache.index_keys[attn.spec.kv_source]  # the owner's index keys, read in their pages
    paged = (keys, _pages(plan, m))
    scores = ops.indexer_scores_ranges(iq, keys.new_empty(0, keys.shape[-1]), iw, start, width, paged=paged)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if ix.candidate_source:
        plan.derived["candidates"] = candidate_blocks(scores, visible, ix.topk_blocks, ix.block_size, ops) & allowed
    elif ix.uses_candidates:
        cand = plan.derived.get("candidates")
        if cand is None or cand.shape != scores.shape:
            raise ValueError("a candidate-restricted index source needs the candidate source's selection")
        scores = scores.masked_fill(~cand, float("-inf"))
    return ops.select_rows(scores, torch.isfinite(scores), min(ix.topk, width))


__all__ = ["SPAN_MIN", "V41DecodePlan", "attend", "pooled_decode", "publish", "read", "span_for"]
