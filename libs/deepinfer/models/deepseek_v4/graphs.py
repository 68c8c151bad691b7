"""CUDA graphs for the decode steps of ``DeepseekV4Model`` (one new token per sequence).

An eager decode step is bound by host launch time: a layer is hundreds of small kernels. Everything of a layer except
the attention's state bookkeeping is a pure function of fixed-shape tensors, so it is captured once per batch-size
bucket and replayed:

* segment 0: the embedding and layer 0's ``Block.attn_in`` (mHC collapse, norm, q / kv projections, RoPE, compressor
  projections, indexer queries);
* segment i (1 ≤ i < L): layer i-1's ``Block.ffn_out`` (inverse RoPE, output projections, mHC expand, the MoE
  sublayer) and layer i's ``attn_in``;
* segment L: layer L-1's ``ffn_out``.

Between segments ``Attention.attend`` runs eagerly on the first ``B`` rows (window ring, compressor buffers, paged
cache, indexer top-k, sparse attention: per-sequence state of changing shapes) and its output is copied into the
static input of the next segment. The step's token ids and positions are copied into static buffers; a batch of
``B`` sequences runs in the smallest bucket ``≥ B`` and its padding rows (stale ids and positions) are computed and
dropped. With ``B`` equal to the bucket size the replay runs the kernels of the eager step on the same shapes, so its
results are the eager results bit for bit (``tests/kernels/test_graphs.py`` checks this on a GPU).

Buckets, capture, the shared memory pool and the eager fallback of a bucket whose capture fails are the model-agnostic
``models.decode_graphs.SegmentGraphs``. ``reset`` drops every graph (after replacing weights' storage, say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.models.decode_graphs import BUCKETS, SegmentGraphs, bucket_for
from deepinfer.models.deepseek_v4.state import ForwardBatch, PagedKVCache

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model


@dataclass
class _Carry:
    """What one segment hands to the next: the streams and the layer's ``attn_in`` results."""

    h: torch.Tensor
    t: dict[str, torch.Tensor]
    post: torch.Tensor
    comb: torch.Tensor


@dataclass
class _Bucket:
    size: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    attn_out: list[torch.Tensor]  # static inputs: each layer's attention output
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # anything with replay() in tests
    carries: list[_Carry] = field(default_factory=list)  # outputs of segments 0 .. L-1
    h: torch.Tensor | None = None  # output of segment L


class DecodeGraphs(SegmentGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV4Model``'s decode steps (module docstring)."""

    model: DeepseekV4Model

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The final streams ``[B, hc_mult, D]`` of a decode step, or None when the step is not graphed (the caller
        then runs it eagerly). Advances the attention state as the eager step does (not ``num_tokens``)."""
        if not self.applies(batch):
            return None
        bk = self.bucket(batch)
        if bk is None:
            return None
        n, size = len(batch.chunks), bk.size
        model, ops = self.model, self.model.ops
        bk.token_ids[:n].copy_(batch.token_ids)
        bk.positions[:n].copy_(batch.positions)
        offsets = batch.offsets()
        for i, layer in enumerate(model.layers):
            bk.graphs[i].replay()
            c = bk.carries[i]
            t = c.t if n == size else {k: v[:n] for k, v in c.t.items()}
            out = layer.attn.attend(t, batch.chunks, offsets, batch.positions, cache, model.rope_of(i), ops)
            bk.attn_out[i][:n].copy_(out)
        bk.graphs[-1].replay()
        self.replays += 1
        return bk.h[:n].clone()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        """The segment functions of a bucket; each stores its outputs in ``bk``."""
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, pos = bk.token_ids, bk.positions

        def first() -> None:
            h = model.embed_streams(ids)
            bk.carries[0] = _Carry(h, *layers[0].attn_in(h, pos, model.rope_of(0), ops))

        def middle(i: int) -> Callable[[], None]:
            def seg() -> None:
                p = bk.carries[i - 1]
                h = layers[i - 1].ffn_out(bk.attn_out[i - 1], p.t, p.h, p.post, p.comb, ids, ops)
                bk.carries[i] = _Carry(h, *layers[i].attn_in(h, pos, model.rope_of(i), ops))

            return seg

        def last() -> None:
            p = bk.carries[-1]
            bk.h = layers[-1].ffn_out(bk.attn_out[-1], p.t, p.h, p.post, p.comb, ids, ops)

        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def _bucket(self, size: int, device: torch.device) -> _Bucket:
        """A bucket's static inputs (zeros) and no graphs yet."""
        c, layers = self.model.config, self.model.layers
        dtype = self.model.embed.weight.dtype
        bk = _Bucket(
            size=size,
            token_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            attn_out=[torch.zeros(size, c.num_attention_heads, c.head_dim, dtype=dtype, device=device) for _ in layers],
        )
        bk.carries = [None] * len(layers)  # type: ignore[list-item]
        return bk


__all__ = ["BUCKETS", "DecodeGraphs", "bucket_for"]
