"""The encoder/decoder split of DeepSeek-V4.1 (docs/deepseek_v41.md ("Encoder/decoder split and bounded decoder
replay")): a chunk with ``decoder_from`` runs the decoder layers only on positions ``>= decoder_from``. At the first
decoder layer, :func:`split_at_decoder` publishes that layer's compressed rows and index keys for the positions the
decoder skips (so its long-range memory stays complete) and picks the batch rows it runs on; :func:`decoder_context`
cuts the step context to those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v41.block import Block
from deepinfer.models.deepseek_v41.layout import LayerSpec
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.ops import Ops


def split_at_decoder(
    layer: Block,
    specs: Sequence[LayerSpec],
    h: torch.Tensor,
    pre: torch.Tensor,
    ctx: StepContext,
    rows: torch.Tensor | None,
    image: torch.Tensor | None,
    rope: RotaryTable,
    ops: Ops,
) -> torch.Tensor | None:
    """At the first decoder layer ``layer``: publish its compressed rows for the positions the decoder skips and
    return the batch rows it runs on (None when it runs on all). ``specs``: every layer's."""
    if any(s.kind == "full" and s.index != layer.spec.index for s in specs if s.stage == "decoder"):
        raise ValueError(
            "a bounded decoder replay needs every decoder KV source at the first decoder layer "
            f"({layer.spec.index}): later ones would miss the skipped positions' rows"
        )
    skip, chunks, offsets, o = [], [], [], 0
    for chunk, (a, _) in zip(ctx.chunks, ctx.offsets):
        d = chunk.start if chunk.decoder_from is None else min(max(chunk.decoder_from, chunk.start), chunk.end)
        if d > chunk.start:
            skip.append(torch.arange(a, a + d - chunk.start))
            chunks.append(SeqChunk(chunk.state, chunk.start, d - chunk.start, chunk.block_table))
            offsets.append((o, o + d - chunk.start))
            o += d - chunk.start
            chunk.state.decoder_start = max(chunk.state.decoder_start, d)
    if not skip:
        return None
    idx = torch.cat(skip).to(h.device)
    hs = h[idx]
    if layer.engram is not None:
        hs = layer.engram(hs, rows[idx][:, layer.engram.slot], None if image is None else ~image[idx], ops)
    xs = layer.attn_norm(ops.hc_collapse(hs, pre[idx]), ops)
    layer.attn.publish(xs, StepContext(chunks, offsets, ctx.positions[idx], ctx.cache), rope, ops)
    keep = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    keep[idx] = False
    return keep.nonzero().flatten()


def decoder_context(ctx: StepContext, active: torch.Tensor) -> StepContext:
    """The step context of the decoder rows ``active`` (sorted batch rows): chunks cut to their decoder part,
    their selection / candidate masks cut alike."""
    act = set(active.tolist())
    chunks, offsets, sel, cand, o = [], [], {}, {}, 0
    for i, (chunk, (a, b)) in enumerate(zip(ctx.chunks, ctx.offsets)):
        n = sum(1 for r in range(a, b) if r in act)
        if not n:
            continue
        j = len(chunks)
        chunks.append(SeqChunk(chunk.state, chunk.end - n, n, chunk.block_table))
        offsets.append((o, o + n))
        o += n
        if i in ctx.selection:
            sel[j] = ctx.selection[i][-n:]
        if ctx.candidates.get(i) is not None:
            cand[j] = ctx.candidates[i][-n:]
    out = StepContext(chunks, offsets, ctx.positions[active], ctx.cache, selection=sel, candidates=cand)
    if ctx.sel_rows is not None:  # the batched path's per-token selection
        out.sel_rows, out.sel_count = ctx.sel_rows[active], ctx.sel_count[active]
    out.cand = None if ctx.cand is None else ctx.cand[active]
    return out
