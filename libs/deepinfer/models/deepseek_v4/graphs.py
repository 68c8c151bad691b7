"""CUDA graphs for the decode steps of ``DeepseekV4Model`` (one new token per sequence): the whole step, one graph.

An eager decode step is bound by host launch time: a layer is hundreds of small kernels. ``decode_step`` makes a
step's attention a function of fixed-shape device tensors (a ``V4DecodePlan``: each row's pool slot, position, window
start, liveness and block table), so everything from the token ids to the final streams is captured once per
bucket and replayed: the embedding, and per layer ``Block.attn_in`` (mHC collapse, norm, projections, RoPE,
compressor projections, indexer queries), ``decode_step.attend`` (window ring, compressor rings, completed rows
written to the paged cache, indexer top-k, sparse attention) and ``Block.ffn_out`` (output projections, mHC
expand, the MoE sublayer).

A bucket is a batch size (``decode_graphs.BUCKETS``) and a span (``decode_step.span_for``: the positions its lists
cover, a few per doubling of the context). Before a replay the host loads the plan and the token ids
(``V4DecodePlan.fill``: one copy of ``[5, size]`` integers from pinned memory, and the block tables); a batch of ``B``
sequences runs in the smallest bucket ``≥ B`` and its padding rows write to the pool's scratch slot and the cache's
scratch page. The replay's results are the eager step's (``decode_step`` with the bucket's widths: the kernels read
only the listed rows), bit for bit at a bucket's size (``tests/kernels/test_graphs.py`` checks this on a GPU). A
bucket's capture runs the step twice and captures it: the step's writes are idempotent, so the state advances once.

A graph holds the pool's and the cache's tensors: the buckets are dropped when the pool reallocates
(``StatePool.generation``) or another cache comes. Buckets, capture, the shared memory pool and the eager fallback of a
bucket whose capture fails are the model-agnostic ``runtime.decode_graphs.SegmentGraphs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from deepinfer.models.deepseek_v4 import decode_step
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.decode_step import V4DecodePlan, span_for
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.ops import Ops
from deepinfer.runtime.decode_graphs import BUCKETS, SegmentGraphs, bucket_for


class GraphedModel(Protocol):
    """What the decode and piecewise prefill graphs read of a ``model.DeepseekV4Model``, which makes them."""

    config: DeepseekV4Config
    ops: Ops
    layers: nn.ModuleList  # model.Block: attn_in, attn, ffn_out
    state_pool: StatePool | None
    pooled_decode: bool

    def embed_streams(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def rope_of(self, layer_id: int) -> RotaryTable: ...


@dataclass
class _Bucket:
    size: int
    token_ids: torch.Tensor
    plan: V4DecodePlan  # its meta[1] is the step's positions
    graphs: list[Any] = field(default_factory=list)  # the platform's graphs (anything with replay() in tests)
    h: torch.Tensor | None = None  # the step's output


class DecodeGraphs(SegmentGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV4Model``'s whole decode steps (module docstring)."""

    model: GraphedModel

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The final streams ``[B, hc_mult, D]`` of a decode step, or None when the step is not graphed (the caller
        then runs it eagerly). Advances the attention state as the eager step does (not ``num_tokens``)."""
        model, chunks = self.model, batch.chunks
        pool = model.state_pool
        if pool is None or not model.pooled_decode or not self.applies(batch):
            return None  # the pool stays once made: pooled_decode turned off runs eagerly
        if not all(c.state.replay_until <= c.start for c in chunks):
            return None
        if cache is None and any(layer.attn.compressor is not None for layer in model.layers):
            return None  # the eager step says what is missing
        slots = pool.adopt([c.state for c in chunks])  # new states get slots now: the pool may grow (new tensors)
        self.own(pool, pool.generation, cache)
        span = span_for(max(c.start for c in chunks) + 1, cache.page_size) if cache is not None else 0
        n = len(chunks)

        def load(bk: _Bucket) -> None:
            bk.plan.fill(chunks, slots, batch)

        bk = self.bucket(batch, (span, cache), before=load)
        if bk is None:
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.h[:n].clone()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        """The whole step, one segment: it stores its output in ``bk.h``."""
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, plan = bk.token_ids, bk.plan

        def step() -> None:
            plan.derived.clear()  # what the layers share is recomputed (and captured) in every run
            pos = plan.meta[1]  # a new view each run: the rotary tables' cache (RotaryTable) starts afresh in each
            h = model.embed_streams(ids)
            for i, layer in enumerate(layers):
                rope = model.rope_of(i)
                t, post, comb = layer.attn_in(h, pos, rope, ops)
                out = decode_step.attend(layer.attn, t, plan, rope, ops)
                h = layer.ffn_out(out, t, h, post, comb, ids, ops)
            bk.h = h

        return [step]

    def _bucket(self, size: int, device: torch.device, span: int = 0, cache: PagedKVCache | None = None) -> _Bucket:
        """A bucket's static inputs (zeros) and no graphs yet."""
        pool, window = self.model.state_pool, self.model.config.sliding_window
        plan = V4DecodePlan.empty(pool, cache, window, size, span)
        return _Bucket(size=size, token_ids=plan.ids, plan=plan)


__all__ = ["BUCKETS", "DecodeGraphs", "GraphedModel", "bucket_for"]
