"""CSA2 attention of a whole batch at once (every op set but the batch-invariant one).

The same keys and selections as ``Attention._attend_each``, computed once per layer for the batch: one pool of every
chunk's window rows (ring rows in position order, then the new rows), one gather of every chunk's owner rows and
index keys (``PagedKVCache.read_many``, read once per step and owner), one indexer scoring over per-query row ranges
(``ops.indexer_scores_ranges``), the candidate blocks and the top-k over the padded ``[T, width]`` score matrix, and
one ``ops.sparse_attention_lists`` over per-query key lists (window rows by position, then the selected rows by
index). Padding columns score ``-inf`` and the tie rule keeps the lower index, so a row selects what it selects
alone. The selection of an index source is kept in the step context for the Reuse layers after it.
"""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.state import ring_span
from deepinfer.models.deepseek_v41.indexer import candidate_blocks
from deepinfer.models.deepseek_v41.step_context import AttentionLayer, StepContext
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import to_device


def _window(
    attn: AttentionLayer, kv: torch.Tensor, ctx: StepContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The window pool of the batch, each query's first pool row and row count, and the largest count (a host int);
    then the rings keep the last ``W`` rows of every chunk (a decode step on the model's ``StatePool`` takes
    ``decode_step`` instead)."""
    win, lid, decoder = attn.window, attn.layer_id, attn.spec.stage == "decoder"
    pieces, first_pos, offs, o = [], [], [], 0
    for chunk, (a, b) in zip(ctx.chunks, ctx.offsets):
        st, s = chunk.state, chunk.start
        ring = st.window(lid, win, attn.head_dim, kv.dtype, kv.device)
        floor = max(st.window_start, st.decoder_start if decoder else 0)
        first = max(floor, s - win + 1, 0)
        pieces += ring_span(ring, first, s - first) + [kv[a:b]]
        first_pos.append(first)
        offs.append(o)
        o += s - first + b - a
    pool = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    dst, src = [], []
    for chunk, (a, _) in zip(ctx.chunks, ctx.offsets):
        s, e = chunk.start, chunk.end
        keep = max(s, e - win)
        at = a + keep - s
        for piece in ring_span(chunk.state.windows[lid], keep, e - keep):
            dst.append(piece)
            src.append(kv[at : at + piece.shape[0]])
            at += piece.shape[0]
    if dst:
        torch._foreach_copy_(dst, src)
    lens = torch.tensor([b - a for a, b in ctx.offsets], dtype=torch.long)
    cid = torch.repeat_interleave(torch.arange(len(ctx.chunks)), lens)
    pos = torch.cat([torch.arange(c.start, c.end) for c in ctx.chunks])
    lo = torch.tensor(first_pos, dtype=torch.long)[cid]
    w_first = torch.maximum(pos - win + 1, lo)
    start = torch.tensor(offs, dtype=torch.long)[cid] + (w_first - lo)
    count = pos - w_first + 1
    if ctx.queries is not None:  # (context parallelism: this rank's queries)
        start, count = start[ctx.queries], count[ctx.queries]
    meta = to_device(torch.stack([start, count]), kv.device)
    return pool, meta[0], meta[1], int(count.max()) if count.numel() else 0


def _owner_pool(attn: AttentionLayer, ctx: StepContext, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's owner rows (``kind`` rows or index) in one pool, read once per step, and each token's offset."""
    owner = attn.spec.kv_source
    got = ctx.pools.get((owner, kind))
    if got is None:
        tables = [c.block_table for c in ctx.chunks]
        got = ctx.pools[(owner, kind)] = ctx.cache.read_many(
            kind, owner, tables, [c.end // attn.ratio for c in ctx.chunks]
        )
    pool, offsets = got
    lens = torch.tensor([b - a for a, b in ctx.offsets], dtype=torch.long)
    tok_off = torch.repeat_interleave(torch.tensor(offsets, dtype=torch.long), lens)
    if ctx.queries is not None:
        tok_off = tok_off[ctx.queries]
    return pool, to_device(tok_off, pool.device)


def _select(
    attn: AttentionLayer, iq: torch.Tensor, iw: torch.Tensor, ctx: StepContext, ops: Ops
) -> tuple[torch.Tensor, torch.Tensor]:
    """An index source's selection for every token: owner rows ``[T, k]`` (ascending, valid first) and counts."""
    ix, r = attn.indexer, attn.ratio
    width = max(c.end // r for c in ctx.chunks)
    keys, start = _owner_pool(attn, ctx, "index")
    t = iq.shape[0]
    visible = (ctx.query_positions() + 1) // r
    cols = torch.arange(width, device=iq.device).unsqueeze(0)
    allowed = cols < visible.unsqueeze(1)
    if width == 0:
        none = torch.zeros(t, 0, dtype=torch.long, device=iq.device)
        ctx.cand = allowed if ix.candidate_source else ctx.cand
        return none, none.sum(1)
    scores = ops.indexer_scores_ranges(iq, keys, iw, start, width).masked_fill(~allowed, float("-inf"))
    if ix.candidate_source:
        ctx.cand = candidate_blocks(scores, visible, ix.topk_blocks, ix.block_size, ops) & allowed
    elif ix.uses_candidates:
        if ctx.cand is None or ctx.cand.shape != scores.shape:
            raise ValueError("a candidate-restricted index source needs the candidate source's selection")
        scores = scores.masked_fill(~ctx.cand, float("-inf"))
    # the top-k of the finite scores, ascending (``ops.select_rows``: the reference's stable sorts, one Triton
    # program a row on CUDA); entries past a row's count are never read
    return ops.select_rows(scores, torch.isfinite(scores), min(ix.topk, width))


def attend_batched(
    attn: AttentionLayer,
    q: torch.Tensor,
    kv: torch.Tensor,
    iq: torch.Tensor | None,
    iw: torch.Tensor | None,
    ctx: StepContext,
    ops: Ops,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention output ``[T, H, d]`` of every query of the step (module docstring), written into ``out`` when
    given."""
    pool, w_start, w_cnt, width = _window(attn, kv, ctx)
    scale, dev = attn.head_dim**-0.5, q.device
    if not attn.ratio:
        idx = w_start.unsqueeze(1) + torch.arange(width, device=dev)
        return ops.sparse_attention_lists(q, pool, idx, w_cnt, attn.attn_sink, scale, out=out)
    if attn.indexer is not None:
        ctx.sel_rows, ctx.sel_count = _select(attn, iq, iw, ctx, ops)
    if ctx.sel_rows is None or ctx.sel_rows.shape[0] != q.shape[0]:
        raise ValueError(f"layer {attn.layer_id} reuses a selection no index source made for this step")
    rows, r_start = _owner_pool(attn, ctx, "rows")
    sel, cnt = ctx.sel_rows, ctx.sel_count
    c_width = sel.shape[1]
    keys = torch.cat([pool, rows.to(pool.dtype)])
    j = torch.arange(width + c_width, device=dev).unsqueeze(0)
    cw = w_cnt.unsqueeze(1)
    comp = (
        torch.gather(sel, 1, (j - cw).clamp(0, max(c_width - 1, 0))) + (pool.shape[0] + r_start).unsqueeze(1)
        if c_width
        else torch.zeros_like(j)
    )
    idx = torch.where(j < cw, w_start.unsqueeze(1) + j, comp)
    return ops.sparse_attention_lists(q, keys, idx, w_cnt + cnt, attn.attn_sink, scale, out=out)
