"""A DeepSeek-V4.1 step split over a context-parallel group (``parallel.context_parallel``): each rank its own tokens
through every layer (Engram, mHC, the attention's projections and queries, the output, the MoE), every token's
window KV and compressor projections gathered so the state (window rings, ratio-2 buffers, compressed rows and index
keys) advances with every row on every rank; the attention paths attend the rank's queries only
(``StepContext.queries``). The Engram rows are hashed for every token on every rank (that advances each sequence's
token history), then each rank takes its own. Steps with a chunk in a bounded decoder replay, and steps that capture
DSpark's features, run whole (``DeepseekV41Model.forward``)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v41.mhc import embed_streams, final_collapse, initial_pre
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.parallel.context_parallel import ContextParallel

STATE_KEYS = ("kv", "ckv", "cgate")  # the projections the state takes


def split_forward(model: nn.Module, batch: object, cache: object, cp: ContextParallel) -> torch.Tensor:
    """The trunk output ``[T, hidden]`` of every token of ``batch``, this rank computing its own (module docstring)."""
    ops, c, offsets = model.ops, model.text, batch.offsets()
    rows = cp.split(offsets, batch.token_ids.shape[0], batch.token_ids.device)
    cp.steps += 1
    mine = rows.mine
    x = model.embed(batch.token_ids[mine]) if batch.input_embeds is None else batch.input_embeds[mine]
    h, pre = embed_streams(x, c.hc_mult), initial_pre(x.shape[0], c.hc_mult, x.device)
    e_rows = model._engram_rows(batch)  # (every token's: it advances the histories)
    e_rows = None if e_rows is None else e_rows[mine]
    image = None if batch.image_mask is None else batch.image_mask[mine]
    ctx = StepContext(batch.chunks, offsets, batch.positions, cache, queries=mine.cpu())
    pos = batch.positions[mine]
    for layer in model.layers:
        rope = model.rope_of(layer)
        if layer.engram is not None:
            h = layer.engram(h, e_rows[:, layer.engram.slot], None if image is None else ~image, ops)
        mix, t = layer.attn_in(h, pre, pos, rope, ops)
        t.update(cp.gather_many({k: t[k] for k in STATE_KEYS if k in t}, rows))
        h, pre = layer.ffn_out(layer.attn.attend(t, ctx, rope, ops), t, h, mix, image, ops)
    return cp.gather(final_collapse(h, pre, ops), rows)


__all__ = ["STATE_KEYS", "split_forward"]
