"""CUDA graphs for the decode steps of ``DeepseekV41Model`` (one new token per sequence).

The V4.1 counterpart of ``deepseek_v4.graphs`` over the same model-agnostic ``models.decode_graphs.SegmentGraphs``
(buckets, capture, shared memory pool, eager fallback). A layer is split at the attention's state bookkeeping
(``Block.attn_in`` / ``Attention.attend`` / ``Block.ffn_out``) and everything between two ``attend`` calls is captured
once per batch-size bucket and replayed:

* segment 0: the embedding, the streams, layer 0's ``initial_pre`` and its pre-attention part: the Engram update
  (Engram layers), the mHC mixes, collapse with the carried ``pre``, ``attn_norm``, ``Attention.project`` (queries,
  window KV, compressor projections, index queries);
* segment i (1 ≤ i < L): layer i-1's ``ffn_out`` (inverse RoPE, output projections, mHC expand, the lagged FFN
  sublayer: mixes, collapse, norm, router, MoE, shared expert, expand) and layer i's pre-attention part;
* segment L: layer L-1's ``ffn_out`` and the final collapse (the trunk output ``[B, hidden]``).

Between segments ``Attention.attend`` runs eagerly on the first ``B`` rows (window pool and ring update, the owners'
compressed rows and index keys published, owner pools, selection, list attention) with one ``StepContext`` for the
step, and its output is copied into the static input of the next segment. The step's token ids, positions and Engram
inputs are copied into static buffers. Engram rows are hashed on the host from the token ids and each sequence's
history (``DeepseekV41Model._engram_rows``, which advances it) before the replay; with the tables on the model's
device the static input is the row ids and the gather is captured, with the tables elsewhere
(``place_engram_tables("cpu")``) the lookup runs eagerly and the static input is the looked-up rows.

A batch of ``B`` sequences runs in the smallest bucket ``≥ B``; its padding rows (stale inputs) are computed and
dropped. With ``B`` equal to the bucket size the replay runs the kernels of the eager step on the same shapes, so its
results are the eager results bit for bit (``tests/kernels/test_graphs_v41.py``). Steps with image embeddings, with
a bounded decoder replay (``decoder_from``), or with DSpark feature capture run eagerly, as do prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.models.decode_graphs import SegmentGraphs
from deepinfer.models.deepseek_v4.state import ForwardBatch, PagedKVCache
from deepinfer.models.deepseek_v41.attention import StepContext
from deepinfer.models.deepseek_v41.mhc import Mix, embed_streams, final_collapse, initial_pre

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model


@dataclass
class _Carry:
    """What a segment hands to the bookkeeping and the next segment: the (post-Engram) streams entering the attention
    mHC, their mixes and ``Attention.project``'s tensors."""

    h: torch.Tensor
    mix: Mix
    t: dict[str, torch.Tensor]


@dataclass
class _Bucket:
    size: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    attn_out: list[torch.Tensor]  # static inputs: each layer's attention output
    engram: torch.Tensor | None  # row ids [size, engram layers, hashes], with the tables on the device
    engram_rows: dict[int, torch.Tensor]  # layer -> looked-up rows [size, hashes, dim], with the tables elsewhere
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # anything with replay() in tests
    carries: list[_Carry] = field(default_factory=list)  # outputs of segments 0 .. L-1
    y: torch.Tensor | None = None  # output of segment L


class DecodeGraphs(SegmentGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV41Model``'s decode steps (module docstring)."""

    model: DeepseekV41Model

    def tables_on_device(self, device: torch.device) -> bool:
        """Whether every Engram table lives on ``device`` (then the captured segments gather the rows)."""
        return all(layer.engram.embed.weight.device == device for layer in self.model.layers if layer.engram)

    def _key(self, size: int) -> tuple:
        return super()._key(size) + (self.tables_on_device(self.model.embed.weight.device),)

    def graphable(self, batch: ForwardBatch) -> bool:
        """A decode step (``SegmentGraphs.graphable``) of text tokens without a bounded decoder replay."""
        return (
            batch.input_embeds is None
            and batch.image_mask is None
            and all(c.decoder_from is None for c in batch.chunks)
            and super().graphable(batch)
        )

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The trunk output ``[B, hidden]`` of a decode step, or None when the step is not graphed (the caller then
        runs it eagerly). Advances the sequences' state as the eager step does (not ``num_tokens``)."""
        if not self.applies(batch):
            return None
        bk = self.bucket(batch)
        if bk is None:
            return None
        model, ops, n = self.model, self.model.ops, len(batch.chunks)
        bk.token_ids[:n].copy_(batch.token_ids)
        bk.positions[:n].copy_(batch.positions)
        rows = model._engram_rows(batch, torch.device("cpu"))  # advances the histories
        if bk.engram is not None:
            bk.engram[:n].copy_(rows, non_blocking=True)
        for i, static in bk.engram_rows.items():
            engram = model.layers[i].engram
            static[:n].copy_(engram.embed.lookup(rows[:, engram.slot], static.device))
        ctx = StepContext(batch.chunks, batch.offsets(), batch.positions, cache)
        for i, layer in enumerate(model.layers):
            bk.graphs[i].replay()
            t = bk.carries[i].t
            if n != bk.size:
                t = {k: v[:n] for k, v in t.items()}
            bk.attn_out[i][:n].copy_(layer.attn.attend(t, ctx, model.rope_of(layer), ops))
        bk.graphs[-1].replay()
        self.replays += 1
        return bk.y[:n].clone()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        """The segment functions of a bucket; each stores its outputs in ``bk``."""
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, pos, streams = bk.token_ids, bk.positions, model.text.hc_mult

        def attn_in(i: int, h: torch.Tensor, pre: torch.Tensor) -> None:
            layer = layers[i]
            if layer.engram is not None:
                if bk.engram is not None:
                    h = layer.engram(h, bk.engram[:, layer.engram.slot], None, ops)
                else:
                    h = layer.engram.update(h, bk.engram_rows[i], None, ops)
            bk.carries[i] = _Carry(h, *layer.attn_in(h, pre, pos, model.rope_of(layer), ops))

        def ffn_out(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            p = bk.carries[i]
            return layers[i].ffn_out(bk.attn_out[i], p.t, p.h, p.mix, None, ops)

        def first() -> None:
            h = embed_streams(model.embed(ids), streams)
            attn_in(0, h, initial_pre(bk.size, streams, ids.device))

        def middle(i: int) -> Callable[[], None]:
            def seg() -> None:
                attn_in(i, *ffn_out(i - 1))

            return seg

        def last() -> None:
            bk.y = final_collapse(*ffn_out(len(layers) - 1), ops)

        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def _bucket(self, size: int, device: torch.device) -> _Bucket:
        """A bucket's static inputs (zeros) and no graphs yet."""
        c, layers = self.model.text, self.model.layers
        dtype = self.model.embed.weight.dtype
        engram, engram_rows = None, {}
        if self.model.hasher is not None:
            if self.tables_on_device(device):
                shape = (size, len(c.engram_layer_ids), c.num_engram_hashes)
                engram = torch.zeros(shape, dtype=torch.long, device=device)
            else:
                for i, layer in enumerate(layers):
                    if layer.engram is not None:
                        w = layer.engram.embed.weight
                        engram_rows[i] = torch.zeros(
                            size, c.num_engram_hashes, w.shape[1], dtype=w.dtype, device=device
                        )
        bk = _Bucket(
            size=size,
            token_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            attn_out=[torch.zeros(size, c.num_attention_heads, c.head_dim, dtype=dtype, device=device) for _ in layers],
            engram=engram,
            engram_rows=engram_rows,
        )
        bk.carries = [None] * len(layers)  # type: ignore[list-item]
        return bk


__all__ = ["DecodeGraphs"]
