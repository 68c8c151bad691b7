"""CUDA graphs of DeepSeek-V4's verify steps on the decode path (``verify_step``), one pair per bucket.

A bucket is a batch size (``decode_graphs.BUCKETS``), a draft count ``K`` (the step's most drafts: its sub-steps
are ``K + 1``) and a span (``decode_step.span_for``). Its two graphs:

* the step: from the token ids (``S·(K+1)`` of them, sub-step after sub-step) to the final streams, as
  ``graphs.DecodeGraphs`` captures a decode step, with each layer's attention ``verify_step.attend`` (the ring rows
  the drafts overwrite saved into the bucket's buffers, then the sub-steps);
* the restore: ``verify_rings.restore`` of the rejected rows, from the bucket's ``accepted [S]`` (loaded by the
  rollback).

Before a replay the host loads the plan and the ids (``V4VerifyPlan.fill``: one copy, and the block tables). The
capture's warm-up runs the pair twice with ``accepted`` zero (every draft rejected): the restore brings the rings
back to the state before the step, so each warm-up run, and the replay after the capture, starts from it (the step
is idempotent from there, as a decode step is). The state's counters are the caller's (``verify_step
.pooled_forward``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.models.deepseek_v4 import verify_rings, verify_step
from deepinfer.models.deepseek_v4.decode_step import span_for
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.graphs import GraphedModel
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.verify_step import V4VerifyPlan
from deepinfer.runtime.decode_graphs import SegmentGraphs


@dataclass
class VerifyBucket:
    size: int
    plan: V4VerifyPlan
    accepted: torch.Tensor  # [size]: the rollback's drafts kept per row (zero in the capture's warm-up)
    graphs: list[Any] = field(default_factory=list)  # the step's graph, the restore's
    h: torch.Tensor | None = None  # the step's output [(K+1)·size, hc, D]


class VerifyGraphs(SegmentGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV4Model``'s verify steps (module docstring)."""

    kind = "verify"
    model: GraphedModel

    def graphable(self, batch: ForwardBatch) -> bool:
        return bool(batch.chunks)

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None, pad: int = 0
            ) -> tuple[torch.Tensor, VerifyBucket] | None:  # fmt: skip
        """The final streams ``[S·(K+1), hc, D]`` of the verify step of ``batch``'s chunks (``verify_step.eligible``;
        ``K`` their most drafts, at least ``pad``), sub-step after sub-step, and its bucket (whose ``restore`` rolls
        it back); None: not graphed (the caller runs it eagerly). Advances the attention state as the eager step does
        (not ``num_tokens``)."""
        model, chunks = self.model, batch.chunks
        pool = model.state_pool
        if pool is None or not self.applies(batch):
            return None
        if cache is None and any(layer.attn.compressor is not None for layer in model.layers):
            return None
        slots = pool.adopt([c.state for c in chunks])
        self.own(pool, pool.generation, cache)
        drafts = max(max(c.length for c in chunks) - 1, pad)
        span = span_for(max(c.end for c in chunks), cache.page_size) if cache is not None else 0

        def load(bk: VerifyBucket) -> None:
            bk.plan.fill(chunks, slots, batch)
            bk.accepted.zero_()

        bk = self.bucket(batch, (drafts, span, cache), before=load)
        if bk is None:
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.h, bk

    def _rows(self, size: int, extra: tuple) -> int:
        return size * (extra[0] + 1)  # (each sequence its drafts and one more row)

    def restore(self, bk: VerifyBucket, accepted: torch.Tensor) -> None:
        """Roll the bucket's last step back to ``accepted [size]`` drafts kept per row."""
        bk.accepted.copy_(accepted)
        bk.graphs[1].replay()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: VerifyBucket) -> list[Callable[[], None]]:
        model, ops, layers, plan = self.model, self.model.ops, self.model.layers, bk.plan

        def step() -> None:
            plan.clear()
            pos = torch.cat([sub.meta[1] for sub in plan.subs])
            h = model.embed_streams(plan.ids)
            for i, layer in enumerate(layers):
                rope = model.rope_of(i)
                t, post, comb = layer.attn_in(h, pos, rope, ops)
                out = verify_step.attend(layer.attn, t, plan, rope, ops)
                h = layer.ffn_out(out, t, h, post, comb, plan.ids, ops)
            bk.h = h

        return [step, self.restore_segment(bk)]

    def restore_segment(self, bk: VerifyBucket) -> Callable[[], None]:
        """The restore graph's segment: ``verify_rings.restore`` of the bucket's plan from its ``accepted``."""

        def restore() -> None:
            bk.plan.clear()
            verify_rings.restore(self.model, bk.plan, bk.accepted)

        return restore

    def _bucket(self, size: int, device: torch.device, drafts: int = 0, span: int = 0,
                cache: PagedKVCache | None = None) -> VerifyBucket:  # fmt: skip
        pool, window = self.model.state_pool, self.model.config.sliding_window
        plan = V4VerifyPlan.empty(pool, cache, window, size, drafts, span)
        plan.fused = self.model.verify_fused
        verify_rings.allocate(self.model, plan)  # the saved rows' buffers, outside the graphs' pool
        return VerifyBucket(size, plan, torch.zeros(size, dtype=torch.long, device=device))


__all__ = ["VerifyBucket", "VerifyGraphs"]
