"""CUDA graphs for the decode steps of ``DeepseekV41Model`` (one new token per sequence): the whole step, one graph.

The V4.1 counterpart of ``deepseek_v4.graphs`` over the same model-agnostic ``runtime.decode_graphs.SegmentGraphs``
(buckets, capture, shared memory pool, eager fallback). ``decode_step`` makes a step's attention bookkeeping a
function of fixed-shape device tensors (a ``V41DecodePlan``: each row's pool slot, position, encoder and decoder window
floors, liveness and block table), so everything from the token ids to the trunk output is captured once per bucket
and replayed: the embedding and the streams, and per layer the Engram update (Engram layers), ``Block.attn_in`` (mHC
mixes, collapse with the carried ``pre``, ``attn_norm``, ``Attention.project``), ``decode_step.attend`` (window ring,
the KV sources' compressor rings and compressed rows and index keys written to the paged cache, the owners' pools,
indexer scores, candidate blocks, top-k, list attention) and ``Block.ffn_out`` (output projections, mHC expand, the
lagged FFN sublayer); then the final collapse (the trunk output ``[B, hidden]``).

A bucket is a batch size (``decode_graphs.BUCKETS``) and a span (``decode_step.span_for``: the positions its lists
cover, a few per doubling of the context). Before a replay the host loads the plan (``V41DecodePlan.fill``: one copy of
``[5, size]`` integers, the block tables), the token ids and the Engram inputs: Engram rows are hashed on the host
from the token ids and each sequence's history (``DeepseekV41Model._engram_rows``, which advances it); with the tables
on the model's device the static input is the row ids and the gather is captured, with the tables elsewhere
(``place_engram_tables("cpu")``) the lookup runs before the replay and the static input is the looked-up rows. A
batch of ``B`` sequences runs in the smallest bucket ``≥ B``; its padding rows (stale inputs) write only to the pool's
scratch slot and the cache's scratch page, and are dropped. The replay's results are the eager step's
(``decode_step`` with the bucket's widths; the CUDA kernels read only the listed rows, so at a bucket's size they are
the eager step's with exact widths bit for bit: ``tests/kernels/test_graphs_v41.py``). A bucket's capture runs the
step twice and captures it: the step's writes are idempotent, so the state advances once.

With DSpark stages the step also computes the drafter's target features (the stream means entering
``dspark_target_layer_ids``: a few small reductions), so the steps DSpark follows replay too (``features``).

A graph holds the pool's and the cache's tensors: the buckets are dropped when the pool reallocates
(``StatePool.generation``) or another cache comes. Steps with image embeddings or with a bounded (decoder) replay run
eagerly, as do prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v41 import decode_step
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.decode_step import V41DecodePlan, span_for
from deepinfer.models.deepseek_v41.engram import EngramHasher
from deepinfer.models.deepseek_v41.mhc import embed_streams, final_collapse, initial_pre
from deepinfer.ops import Ops
from deepinfer.runtime.decode_graphs import SegmentGraphs
from deepinfer.runtime.host_copy import StagedCopy


class GraphedModel(Protocol):
    """What the decode and piecewise prefill graphs read of a ``model.DeepseekV41Model``, which makes them."""

    text: DeepseekV41TextConfig
    ops: Ops
    embed: nn.Embedding
    layers: nn.ModuleList  # block.Block: engram, attn_in, attn, ffn_out
    hasher: EngramHasher | None
    state_pool: StatePool | None
    pooled_decode: bool

    def rope_of(self, layer: nn.Module) -> RotaryTable: ...

    def _engram_rows(self, batch: ForwardBatch, device: torch.device | None = None) -> torch.Tensor | None: ...


@dataclass
class _Bucket:
    size: int
    token_ids: torch.Tensor
    plan: V41DecodePlan  # its meta holds the step's positions
    engram: torch.Tensor | None  # row ids [size, engram layers, hashes], with the tables on the device
    engram_rows: dict[int, torch.Tensor]  # layer -> looked-up rows [size, hashes, dim], with the tables elsewhere
    graphs: list[Any] = field(default_factory=list)  # the platform's graphs (anything with replay() in tests)
    y: torch.Tensor | None = None  # the step's output
    engram_stage: StagedCopy | None = None  # the host copies into ``engram``
    features: torch.Tensor | None = None  # DSpark's target features of the step (a checkpoint with DSpark stages)


class TextGraphs:
    """What V4.1's decode and piecewise prefill graphs share (mixed in before a ``SegmentGraphs``): text steps only,
    and the Engram inputs, as row ids with the tables on the device or as looked-up rows with them elsewhere."""

    model: GraphedModel

    def tables_on_device(self, device: torch.device) -> bool:
        """Whether every Engram table lives on ``device`` (then the captured step gathers the rows)."""
        return all(layer.engram.embed.weight.device == device for layer in self.model.layers if layer.engram)

    def _key(self, size: int) -> tuple:
        return super()._key(size) + (self.tables_on_device(self.model.embed.weight.device),)  # type: ignore[misc]

    def graphable(self, batch: ForwardBatch) -> bool:
        """A step the base class graphs, of text tokens without a bounded decoder replay."""
        return (
            batch.input_embeds is None
            and batch.image_mask is None
            and all(c.decoder_from is None for c in batch.chunks)
            and super().graphable(batch)  # type: ignore[misc]
        )

    def load_engram(self, bk: object, rows: torch.Tensor | None) -> None:
        """Load a bucket's Engram inputs (``_engram_buffers``) with the host row ids ``rows`` of its first rows: the
        ids themselves (tables on the device), or the rows looked up (tables elsewhere)."""
        if rows is None:
            return
        if bk.engram is not None:
            bk.engram_stage.copy(rows)
        for i, static in bk.engram_rows.items():
            engram = self.model.layers[i].engram
            static[: rows.shape[0]].copy_(engram.embed.lookup(rows[:, engram.slot], static.device))

    def apply_engram(self, bk: object, i: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A captured step's Engram update of layer ``i`` (streams ``h``) from the bucket's static inputs."""
        if bk.engram is not None:
            return layer.engram(h, bk.engram[:, layer.engram.slot], None, self.model.ops)
        return layer.engram.update(h, bk.engram_rows[i], None, self.model.ops)

    def _engram_buffers(self, size: int, device: torch.device) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """A bucket's static Engram inputs (zeros): row ids ``[size, engram layers, hashes]`` with the tables on
        ``device``, else looked-up rows ``[size, hashes, dim]`` per Engram layer."""
        c, engram, engram_rows = self.model.text, None, {}
        if self.model.hasher is not None:
            if self.tables_on_device(device):
                shape = (size, len(c.engram_layer_ids), c.num_engram_hashes)
                engram = torch.zeros(shape, dtype=torch.long, device=device)
            else:
                for i, layer in enumerate(self.model.layers):
                    if layer.engram is not None:
                        w = layer.engram.embed.weight
                        engram_rows[i] = torch.zeros(
                            size, c.num_engram_hashes, w.shape[1], dtype=w.dtype, device=device
                        )
        return engram, engram_rows


class DecodeGraphs(TextGraphs, SegmentGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV41Model``'s decode steps (module docstring)."""

    model: GraphedModel
    features: torch.Tensor | None = None  # the last replay's DSpark target features [B, L·D] (a DSpark checkpoint)

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The trunk output ``[B, hidden]`` of a decode step, or None when the step is not graphed (the caller then
        runs it eagerly). Advances the sequences' state as the eager step does (not ``num_tokens``)."""
        model, chunks = self.model, batch.chunks
        pool = model.state_pool
        if pool is None or not model.pooled_decode or not self.applies(batch) or not decode_step.pooled_decode(chunks):
            return None
        if cache is None and any(layer.attn.ratio for layer in model.layers):
            return None  # the eager step says what is missing
        slots = pool.adopt([c.state for c in chunks])  # new states get slots now: the pool may grow (new tensors)
        self.own(pool, pool.generation, cache)
        span = span_for(max(c.start for c in chunks) + 1, cache.page_size) if cache is not None else 0
        n, history = len(chunks), [c.state.history for c in chunks]
        rows = model._engram_rows(batch, torch.device("cpu"))  # advances the histories

        def load(bk: _Bucket) -> None:
            bk.plan.fill(chunks, slots, batch)
            self.load_engram(bk, rows)

        bk = self.bucket(batch, (span, cache), before=load)
        if bk is None:
            for c, h in zip(chunks, history):  # the eager step hashes again
                c.state.history = h
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        self.features = None if bk.features is None else bk.features[:n]  # (the next replay overwrites it)
        return bk.y[:n].clone()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        """The whole step, one segment: it stores its output in ``bk.y``."""
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, plan, streams = bk.token_ids, bk.plan, model.text.hc_mult
        targets = set(model.text.dspark_target_layer_ids) if model.mtp is not None else set()

        def step() -> None:
            plan.derived.clear()  # what the layers share is recomputed (and captured) in every run
            pos = plan.meta[decode_step.POS]  # a new view each run: nothing keyed by the last one's skips a kernel
            h = embed_streams(model.embed(ids), streams)
            pre = initial_pre(bk.size, streams, ids.device)
            captured = []
            for i, layer in enumerate(layers):
                rope = model.rope_of(layer)
                if layer.engram is not None:
                    h = self.apply_engram(bk, i, layer, h)
                if layer.spec.index in targets:
                    captured.append(h)
                mix, t = layer.attn_in(h, pre, pos, rope, ops)
                out = decode_step.attend(layer.attn, t, plan, rope, ops)
                h, pre = layer.ffn_out(out, t, h, mix, None, ops)
            bk.y = final_collapse(h, pre, ops)
            bk.features = model.dspark.target_features(captured) if targets else None

        return [step]

    def _bucket(self, size: int, device: torch.device, span: int = 0, cache: PagedKVCache | None = None) -> _Bucket:
        """A bucket's static inputs (zeros) and no graphs yet."""
        engram, engram_rows = self._engram_buffers(size, device)
        plan = V41DecodePlan.empty(self.model.state_pool, cache, self.model.text.sliding_window, size, span)
        return _Bucket(
            size=size,
            token_ids=plan.ids,
            plan=plan,
            engram=engram,
            engram_rows=engram_rows,
            engram_stage=None if engram is None else StagedCopy(engram),
        )


__all__ = ["DecodeGraphs", "GraphedModel", "TextGraphs"]
