"""Piecewise CUDA graphs for the prefill and mixed steps of ``DeepseekV4Model`` (``runtime.piecewise_graphs``).

A step of ``T`` tokens runs in the smallest token bucket ``≥ T`` (``prefill_bucket``). The pieces of a bucket:

* piece 0: the embedding, then layer 0's ``Block.attn_in`` (mHC collapse, norm, projections, RoPE, compressor
  projections, indexer queries) and an output buffer for its attention;
* piece ``j`` (``1 ≤ j < L``): layer ``j - 1``'s ``Block.ffn_out`` (output projections, mHC expand, the MoE
  sublayer) on that buffer, then layer ``j``'s ``attn_in``;
* piece ``L``: the last layer's ``ffn_out``.

Between pieces ``j`` and ``j + 1`` layer ``j``'s ``Attention.attend`` runs eagerly on the first ``T`` rows of piece
``j``'s tensors (it reads and advances the sequences' state, as in an eager step) and writes its output into the
buffer; the buffer's padding rows are zeroed, so the padding tokens (id 0 at position 0) carry finite values through
the MoE. Neither ``attn_in`` nor ``ffn_out`` touches state: the graphs hold no pool or cache, and one capture serves
every batch of the bucket. The results are those of an eager step of the bucket's size (bit for bit when ``T`` is
the bucket's size; ``tests/kernels/test_prefill_graphs.py`` checks both on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.graphs import GraphedModel
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.runtime.piecewise_graphs import PREFILL_BUCKETS, PieceBucket, PiecewiseGraphs, prefill_bucket


class PrefillGraphs(PiecewiseGraphs):
    """Per-token-bucket piecewise CUDA graphs of a ``DeepseekV4Model``'s steps (module docstring)."""

    model: GraphedModel

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The final streams ``[T, hc_mult, D]`` of ``batch``, or None when it is not graphed (the caller runs it
        eagerly). Advances the attention state as the eager step does (not ``num_tokens``)."""
        if not self.applies(batch):
            return None
        bk = self.bucket(batch)
        if bk is None:
            return None
        model, ops, n = self.model, self.model.ops, batch.num_tokens
        self.load(bk, n, [(bk.token_ids, batch.token_ids), (bk.positions, batch.positions)])
        offsets, layers = batch.offsets(), model.layers

        def attend(j: int, t: dict[str, torch.Tensor], out: torch.Tensor) -> None:
            rope = model.rope_of(layers[j].layer_id)
            layers[j].attn.attend(t, batch.chunks, offsets, batch.positions, cache, rope, ops, out=out)

        return self.replay(bk, n, attend)["h"][:n].clone()

    def _segments(self, bk: PieceBucket) -> list[Callable[[], None]]:
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids = bk.token_ids

        def attn_in(j: int, h: torch.Tensor) -> None:
            layer = layers[j]
            pos = bk.positions[:]  # a new view per piece: a rotary table's cached result never crosses pieces
            t, post, comb = layer.attn_in(h, pos, model.rope_of(layer.layer_id), ops)
            bk.carry[j] = {"h": h, "t": t, "post": post, "comb": comb, "out": torch.empty_like(t["q"])}

        def ffn_out(j: int) -> torch.Tensor:
            c = bk.carry[j]
            return layers[j].ffn_out(c["out"], c["t"], c["h"], c["post"], c["comb"], ids, ops)

        def piece(j: int) -> Callable[[], None]:
            def run() -> None:
                if j == 0:
                    attn_in(0, model.embed_streams(ids))
                elif j < len(layers):
                    attn_in(j, ffn_out(j - 1))
                else:
                    bk.carry[j] = {"h": ffn_out(j - 1)}

            return run

        return [piece(j) for j in range(len(layers) + 1)]

    def _bucket(self, size: int, device: torch.device) -> PieceBucket:
        return PieceBucket(**self._statics(size, device, len(self.model.layers) + 1))


__all__ = ["PREFILL_BUCKETS", "PrefillGraphs", "prefill_bucket"]
