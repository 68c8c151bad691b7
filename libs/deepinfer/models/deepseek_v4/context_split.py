"""A DeepSeek-V4 step split over a context-parallel group (``parallel.context_parallel``): each rank its own tokens
through every layer, every token's state inputs gathered."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.parallel.context_parallel import ContextParallel

STATE_KEYS = ("kv", "main_kv", "main_score", "index_kv", "index_score")  # the projections the state takes


def split_forward(model: nn.Module, batch: object, cache: object, cp: ContextParallel) -> torch.Tensor:
    """A DeepSeek-V4 step split over ``cp`` (module docstring): the final hidden streams of every token."""
    ops, offsets = model.ops, batch.offsets()
    rows = cp.split(offsets, batch.token_ids.shape[0], batch.token_ids.device)
    cp.steps += 1
    ids, pos = batch.token_ids[rows.mine], batch.positions[rows.mine]
    h = model.embed_streams(ids)
    for layer in model.layers:
        rope = model.rope_of(layer.layer_id)
        t, post, comb = layer.attn_in(h, pos, rope, ops)
        full = cp.gather_many({k: t[k] for k in STATE_KEYS if k in t}, rows)
        proj = {k: (full[f"{k}_kv"], full[f"{k}_score"]) for k in ("main", "index") if f"{k}_kv" in full}
        if ops.invariant_by_sequence:
            out = _attend_each(layer.attn, t, full, proj, rows.mine, pos, batch.chunks, offsets, cache, rope, ops)
        else:
            iq = (t["iq"], t["iw"]) if "iq" in t else None
            out = layer.attn._attend_batched(None, t["q"], full["kv"], iq, proj, batch.chunks, offsets, cache, rope,
                                             ops, sel=rows.mine)  # fmt: skip
        h = layer.ffn_out(out, t, h, post, comb, ids, ops)
    return cp.gather(h, rows)


def _attend_each(attn: nn.Module, t: dict, full: dict, proj: dict, mine: torch.Tensor, pos: torch.Tensor,
                 chunks: list, offsets: list[tuple[int, int]], cache: object, rope: object, ops: object
                 ) -> torch.Tensor:  # fmt: skip
    """The batch-invariant ops' attention (``Attention._attend_one``, sequence by sequence) of this rank's queries:
    each chunk's state advanced with every row of it, its queries those of ``mine`` in it. A row's result does not
    depend on the others computed with it, so it equals one process's bit for bit."""
    out = torch.empty_like(t["q"])
    for chunk, (a, b) in zip(chunks, offsets):
        li = torch.nonzero((mine >= a) & (mine < b)).flatten()
        part = {k: (v[0][a:b], v[1][a:b]) for k, v in proj.items()}
        res = attn._attend_one(t["x"][li], t["qr"][li], t["q"][li], full["kv"][a:b], pos[li], part, chunk, cache,
                               rope, ops)  # fmt: skip
        out[li] = res
    return out


__all__ = ["STATE_KEYS", "split_forward"]
