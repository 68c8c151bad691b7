"""Piecewise CUDA graphs for the prefill and mixed steps of ``DeepseekV41Model`` (``runtime.piecewise_graphs``).

The V4.1 counterpart of ``deepseek_v4.prefill_graphs``. A text step of ``T`` tokens runs in the smallest token
bucket ``≥ T``. The pieces of a bucket:

* piece 0: the embedding, the streams and the initial ``pre``, then layer 0's Engram update (an Engram layer) and
  ``Block.attn_in`` (mHC mixes, collapse, ``attn_norm``, ``Attention.project``) and an output buffer for its
  attention;
* piece ``j`` (``1 ≤ j < L``): layer ``j - 1``'s ``Block.ffn_out`` (output projections, mHC expand, the lagged FFN
  sublayer), then layer ``j``'s Engram update and ``attn_in``;
* piece ``L``: the last layer's ``ffn_out`` and the final collapse (the trunk output ``[T, hidden]``).

Between pieces ``j`` and ``j + 1`` layer ``j``'s ``Attention.attend`` runs eagerly on the first ``T`` rows with one
``StepContext`` for the step (what KV sources publish, the index sources' selections the Reuse layers read), writing
into the buffer, whose padding rows are zeroed. Engram rows are hashed on the host from the token ids and each
sequence's history (``DeepseekV41Model._engram_rows``, which advances it; restored when the step is not graphed), then
loaded as the decode graphs load them: row ids with the tables on the device (the gather is captured), looked-up rows
with the tables elsewhere. Steps with image embeddings, a bounded decoder replay (``decoder_from``) or DSpark feature
capture run eagerly. Results are those of an eager step of the bucket's size (bit for bit when ``T`` is the bucket's
size; ``tests/kernels/test_prefill_graphs_v41.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v41.graphs import GraphedModel, TextGraphs
from deepinfer.models.deepseek_v41.mhc import embed_streams, final_collapse, initial_pre
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.runtime.host_copy import to_device
from deepinfer.runtime.piecewise_graphs import PieceBucket, PiecewiseGraphs


@dataclass
class _Bucket(PieceBucket):
    engram: torch.Tensor | None = None  # row ids [size, engram layers, hashes], with the tables on the device
    engram_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> looked-up rows, tables elsewhere


class PrefillGraphs(TextGraphs, PiecewiseGraphs):
    """Per-token-bucket piecewise CUDA graphs of a ``DeepseekV41Model``'s text steps (module docstring)."""

    model: GraphedModel

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The trunk output ``[T, hidden]`` of ``batch``, or None when it is not graphed (the caller runs it
        eagerly). Advances the sequences' state as the eager step does (not ``num_tokens``)."""
        if not self.applies(batch):
            return None
        model, ops, n, chunks = self.model, self.model.ops, batch.num_tokens, batch.chunks
        history = [c.state.history for c in chunks]
        rows = model._engram_rows(batch, torch.device("cpu"))  # advances the histories
        bk = self.bucket(batch)
        if bk is None:
            for c, h in zip(chunks, history):  # the eager step hashes again
                c.state.history = h
            return None
        statics = [(bk.token_ids, batch.token_ids), (bk.positions, batch.positions)]
        if bk.engram is not None:
            statics.append((bk.engram, to_device(rows, bk.engram.device)))
        for i, static in bk.engram_rows.items():
            engram = model.layers[i].engram
            statics.append((static, engram.embed.lookup(rows[:, engram.slot], static.device)))
        self.load(bk, n, statics)
        ctx = StepContext(chunks, batch.offsets(), batch.positions, cache)
        layers = model.layers

        def attend(j: int, t: dict[str, torch.Tensor], out: torch.Tensor) -> None:
            layers[j].attn.attend(t, ctx, model.rope_of(layers[j]), ops, out=out)

        return self.replay(bk, n, attend)["y"][:n].clone()

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, streams = bk.token_ids, model.text.hc_mult

        def attn_in(j: int, h: torch.Tensor, pre: torch.Tensor) -> None:
            layer = layers[j]
            if layer.engram is not None:
                if bk.engram is not None:
                    h = layer.engram(h, bk.engram[:, layer.engram.slot], None, ops)
                else:
                    h = layer.engram.update(h, bk.engram_rows[j], None, ops)
            pos = bk.positions[:]  # a new view per piece: a rotary table's cached result never crosses pieces
            mix, t = layer.attn_in(h, pre, pos, model.rope_of(layer), ops)
            bk.carry[j] = {"h": h, "mix": mix, "t": t, "out": torch.empty_like(t["q"])}

        def ffn_out(j: int) -> tuple[torch.Tensor, torch.Tensor]:
            c = bk.carry[j]
            return layers[j].ffn_out(c["out"], c["t"], c["h"], c["mix"], None, ops)

        def piece(j: int) -> Callable[[], None]:
            def run() -> None:
                if j == 0:
                    attn_in(0, embed_streams(model.embed(ids), streams), initial_pre(bk.size, streams, ids.device))
                elif j < len(layers):
                    attn_in(j, *ffn_out(j - 1))
                else:
                    bk.carry[j] = {"y": final_collapse(*ffn_out(j - 1), ops)}

            return run

        return [piece(j) for j in range(len(layers) + 1)]

    def _bucket(self, size: int, device: torch.device) -> _Bucket:
        engram, engram_rows = self._engram_buffers(size, device)
        statics = self._statics(size, device, len(self.model.layers) + 1)
        return _Bucket(**statics, engram=engram, engram_rows=engram_rows)


__all__ = ["PrefillGraphs"]
