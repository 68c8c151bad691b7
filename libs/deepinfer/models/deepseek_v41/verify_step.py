"""A speculative verify step of DeepSeek-V4.1 on the decode path: pooled state, fixed shapes, graphable.

The V4.1 port of ``deepseek_v4.verify_step`` (read it first): a step whose chunks are each a sequence's last token
and its drafts runs as ``K + 1`` decode sub-steps of the same ``S`` sequences inside one forward, rows laid out
sub-step after sub-step (``j·S + b``). Every per-row part of a layer (Engram, the mHC mixes, projections, MoE) runs
once over all rows; the attention is ``decode_step.attend`` once per sub-step, in order (``V41VerifyPlan``: one
``decode_step.V41DecodePlan`` per sub-step, with the decoder layers' window floor too). What differs from V4:

* Engram: the rows are hashed on the host in the batch's order (``DeepseekV41Model._engram_rows``, which advances
  each sequence's history over all its verified tokens), then laid out as the sub-steps are; the rollback sets the
  history to the kept tokens' (``PooledVerify.histories``);
* the ratio-2 compressors' rings hold 2 rows, fewer than the drafts: the step keeps their rows before it and every
  sub-step's projections, and the rollback writes each ring row from the latest kept one (``verify_rings``, "small
  ring"; ``Attention.ring_sources``), so only the window bounds ``K``;
* DSpark reads the target's features (the stream means entering ``dspark_target_layer_ids``) of every kept position:
  the step returns them with the trunk output, in the batch's row order (``capture``).

Steps with image embeddings or a bounded decoder replay take the ragged path (``deepseek_v4.speculative``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deepinfer.models.deepseek_v4 import verify_attention, verify_rings
from deepinfer.models.deepseek_v4 import verify_step as v4
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v4.verify_step import PooledVerify, VerifiedSeq, verify_rows
from deepinfer.models.deepseek_v41 import decode_step
from deepinfer.models.deepseek_v41.decode_step import V41DecodePlan
from deepinfer.models.deepseek_v41.mhc import embed_streams, final_collapse, initial_pre
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import to_device

Engram = Callable[[int, torch.nn.Module, torch.Tensor], torch.Tensor]  # (layer index, layer, streams) -> streams


class V41VerifyPlan(v4.V4VerifyPlan):
    """``deepseek_v4.verify_step.V4VerifyPlan`` with V4.1's decode plans: 8 meta rows per sub-step (the encoder
    layers' rows, then the decoder layers' with their window floor)."""

    META = 8

    @classmethod
    def host_meta(cls, chunks: list[SeqChunk], slots: list[int], scratch: int, size: int, drafts: int
                  ) -> tuple[np.ndarray, int]:  # fmt: skip
        host, top = v4.host_meta(chunks, slots, scratch, size, drafts)
        enc = host.reshape(drafts + 1, 4, size)
        dec = enc.copy()
        n = len(chunks)
        dec[:, 2, :n] = np.fromiter((max(c.state.window_start, c.state.decoder_start) for c in chunks), np.int64, n)
        return np.concatenate([enc, dec], axis=1).reshape(8 * (drafts + 1), size), top

    @classmethod
    def sub_plan(cls, pool: StatePool, cache: PagedKVCache | None, window: int, meta: torch.Tensor,
                 tables: torch.Tensor | None, host: np.ndarray | None, widths: dict) -> V41DecodePlan:  # fmt: skip
        wins = (
            (window, window)
            if host is None
            else (v4.window_width(host[:4], 2, window), v4.window_width(host[4:], 2, window))
        )
        return V41DecodePlan(pool, cache, window, meta, tables, wins, widths)

    @staticmethod
    def attend_sub(attn: object, t: dict[str, torch.Tensor], sub: object, rope: RotaryTable, ops: Ops) -> torch.Tensor:
        return decode_step.attend(attn, t, sub, rope, ops)

    @staticmethod
    def attend_all(attn: Any, t: dict[str, torch.Tensor], plan: V41VerifyPlan, rope: RotaryTable, ops: Ops
                   ) -> torch.Tensor:  # fmt: skip
        """Every sub-step's attention in one call (``deepseek_v4.verify_attention``): the window, a ratio-2 (or more)
        KV source's groups, then ``decode_step.read`` of the stacked rows."""
        whole, kv, pool, m = verify_attention.stacked(plan), t["kv"], plan.pool, attn.ratio
        ring = pool.rings[attn.layer_id]
        got = verify_attention.window(plan, ring.view(-1, ring.shape[-1]), kv, ops)
        if m and attn.compressor is not None:
            if m == 1:
                decode_step.publish(attn, t, whole, rope, ops, kv.dtype)
            else:

                def pooled(fk: torch.Tensor, fs: torch.Tensor, cur: torch.Tensor, prev: torch.Tensor) -> None:
                    decode_step.publish(attn, t, whole, rope, ops, kv.dtype, source=(fk, fs, cur))

                new = (t["ckv"], t["cgate"])
                verify_attention.with_ring(plan, pool.rbufs[(attn.layer_id, "main")], new, m, ops, pooled)
        return decode_step.read(attn, t, whole, got, ops)


def eligible(model: torch.nn.Module, batch: ForwardBatch) -> bool:
    """Whether a verify step of ``batch`` runs on this path: ``deepseek_v4.verify_step.eligible``, text only, no
    bounded decoder replay."""
    if batch.input_embeds is not None or batch.image_mask is not None:
        return False
    return all(c.decoder_from is None for c in batch.chunks) and v4.eligible(model, batch.chunks)


def layers_forward(model: torch.nn.Module, plan: V41VerifyPlan, ids: torch.Tensor, engram: Engram | None,
                   capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The trunk output ``[(K+1)·S, hidden]`` of the step ``plan`` on ``ids`` (its layout) and, with ``capture``,
    DSpark's target features ``[(K+1)·S, L·hidden]``; ``engram`` adds a layer's Engram rows to the streams. What the
    eager step runs and the verify graphs capture."""
    ops, c = model.ops, model.text
    pos = torch.cat([sub.meta[decode_step.POS] for sub in plan.subs])
    h = embed_streams(model.embed(ids), c.hc_mult)
    pre = initial_pre(ids.shape[0], c.hc_mult, ids.device)
    targets = set(c.dspark_target_layer_ids) if capture else set()
    captured = []
    for i, layer in enumerate(model.layers):
        rope = model.rope_of(layer)
        if layer.engram is not None:
            h = engram(i, layer, h)
        if layer.spec.index in targets:
            captured.append(h)
        mix, t = layer.attn_in(h, pre, pos, rope, ops)
        out = v4.attend(layer.attn, t, plan, rope, ops)
        h, pre = layer.ffn_out(out, t, h, mix, None, ops)
    return final_collapse(h, pre, ops), model.dspark.target_features(captured) if capture else None


@torch.no_grad()
def pooled_forward(model: torch.nn.Module, batch: ForwardBatch, cache: PagedKVCache | None, verified: list[int],
                   pad: int = 0, capture: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, PooledVerify]:  # fmt: skip
    """The model's forward on ``batch`` (``eligible``; chunks ``verified`` carry drafts) on this path: the trunk
    output and, with ``capture``, DSpark's features, in ``batch``'s row order, and the rollback (``pad``:
    ``deepseek_v4.verify_step.pooled_forward``'s)."""
    chunks, offsets = batch.chunks, batch.offsets()
    model._use_pool(True)
    pool = model.state_pool
    saves = [VerifiedSeq(chunks[i].state, chunks[i].start, chunks[i].length - 1) for i in verified]
    histories = [chunks[i].state.history for i in verified]
    host_ids = None
    if model.hasher is not None:
        host_ids = (batch.host_token_ids if batch.host_token_ids is not None else batch.token_ids.cpu()).tolist()

    def pending(plan: V41VerifyPlan, restore: Callable[[torch.Tensor], None]) -> PooledVerify:
        return PooledVerify(model, plan, [offsets[i] for i in verified], saves, verified, restore=restore,
                            steps=[c.length - 1 for c in chunks],
                            histories=histories, ids=host_ids)  # fmt: skip

    graphs = model.step_graphs.of(model, "verify") if model.step_graphs is not None else None
    got = None if graphs is None else graphs.run(batch, cache, pad if pad < verify_rings.ring_rows(model) else 0)
    if got is not None:  # replayed: the bucket's rows, its restore
        y, f, bk = got
        at = to_device(torch.from_numpy(verify_rows(chunks, bk.size)), batch.device)
        for c in chunks:
            c.state.num_tokens = c.end
        feats = f.index_select(0, at) if capture and f is not None else None
        return y.index_select(0, at), feats, pending(bk.plan, lambda acc: graphs.restore(bk, acc))
    plan = V41VerifyPlan.of(pool, cache, model.text.sliding_window, chunks)
    plan.fused = model.verify_fused
    size, k1 = len(chunks), plan.drafts + 1
    at = to_device(torch.from_numpy(verify_rows(chunks, size)), batch.device)
    ids = batch.token_ids.new_zeros(k1 * size).index_copy_(0, at, batch.token_ids)
    rows = model._engram_rows(batch)  # the batch's order; advances the histories over every verified token
    if rows is not None:
        rows = rows.new_zeros(k1 * size, *rows.shape[1:]).index_copy_(0, at, rows)

    def engram(i: int, layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return layer.engram(h, rows[:, layer.engram.slot], None, model.ops)

    y, f = layers_forward(model, plan, ids, engram, capture)
    for c in chunks:
        c.state.num_tokens = c.end
    feats = None if f is None else f.index_select(0, at)
    return y.index_select(0, at), feats, pending(plan, lambda acc: verify_rings.restore(model, plan, acc))


__all__ = ["V41VerifyPlan", "eligible", "layers_forward", "pooled_forward"]
