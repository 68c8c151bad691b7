"""CUDA graphs of DeepSeek-V4.1's verify steps on the decode path (``verify_step``), one pair per bucket.

``deepseek_v4.verify_graphs`` for V4.1 (read it first): a bucket is a batch size, a draft count ``K`` and a span;
its graphs are the step (``verify_step.layers_forward`` from the token ids, ``S·(K+1)`` of them sub-step after
sub-step, to the trunk output and, where the checkpoint has DSpark stages, the drafter's target features) and the
restore (``verify_rings.restore`` from the bucket's ``accepted``). The Engram inputs are ``graphs.DecodeGraphs``':
hashed on the host in the batch's order (advancing the histories), laid out as the rows are, and loaded as row ids
(tables on the device) or as looked-up rows (tables elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from deepinfer.models.deepseek_v4 import verify_graphs as v4
from deepinfer.models.deepseek_v4 import verify_rings
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.verify_step import verify_rows
from deepinfer.models.deepseek_v41.decode_step import span_for
from deepinfer.models.deepseek_v41.graphs import TextGraphs
from deepinfer.models.deepseek_v41.verify_step import V41VerifyPlan, layers_forward
from deepinfer.runtime.host_copy import StagedCopy


@dataclass
class VerifyBucket(v4.VerifyBucket):
    engram: torch.Tensor | None = None  # row ids [(K+1)·size, engram layers, hashes], tables on the device
    engram_rows: dict[int, torch.Tensor] | None = None  # layer -> looked-up rows, tables elsewhere
    engram_stage: StagedCopy | None = None
    features: torch.Tensor | None = None  # DSpark's target features [(K+1)·size, L·D] (a DSpark checkpoint)


class VerifyGraphs(TextGraphs, v4.VerifyGraphs):
    """Per-bucket CUDA graphs of a ``DeepseekV41Model``'s verify steps (module docstring)."""

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None, pad: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None, VerifyBucket] | None:  # fmt: skip
        """The trunk output and the DSpark features (None without stages) of the verify step of ``batch``
        (``verify_step.eligible``), sub-step after sub-step, and its bucket; None: not graphed (the caller runs it
        eagerly; the histories are as before)."""
        model, chunks = self.model, batch.chunks
        pool = model.state_pool
        if pool is None or not self.applies(batch):
            return None
        if cache is None and any(layer.attn.ratio for layer in model.layers):
            return None
        slots = pool.adopt([c.state for c in chunks])
        self.own(pool, pool.generation, cache)
        drafts = max(max(c.length for c in chunks) - 1, pad)
        span = span_for(max(c.end for c in chunks), cache.page_size) if cache is not None else 0
        history = [c.state.history for c in chunks]
        rows = model._engram_rows(batch, torch.device("cpu"))  # the batch's order; advances the histories

        def load(bk: VerifyBucket) -> None:
            bk.plan.fill(chunks, slots, batch)
            bk.accepted.zero_()
            if rows is not None:  # laid out as the bucket's rows are
                laid = np.zeros((bk.plan.ids.shape[0], *rows.shape[1:]), dtype=np.int64)
                laid[verify_rows(chunks, bk.size)] = rows.numpy()
                self.load_engram(bk, torch.from_numpy(laid))

        bk = self.bucket(batch, (drafts, span, cache), before=load)
        if bk is None:
            for c, h in zip(chunks, history):  # the eager step hashes again
                c.state.history = h
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.h, bk.features, bk

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: VerifyBucket) -> list[Callable[[], None]]:
        model, plan = self.model, bk.plan
        engram, capture = partial(self.apply_engram, bk), model.mtp is not None

        def step() -> None:
            plan.clear()
            bk.h, bk.features = layers_forward(model, plan, plan.ids, engram, capture)

        return [step, self.restore_segment(bk)]

    def _bucket(self, size: int, device: torch.device, drafts: int = 0, span: int = 0,
                cache: PagedKVCache | None = None) -> VerifyBucket:  # fmt: skip
        pool, window = self.model.state_pool, self.model.text.sliding_window
        plan = V41VerifyPlan.empty(pool, cache, window, size, drafts, span)
        plan.fused = self.model.verify_fused
        verify_rings.allocate(self.model, plan)  # the saved rows' buffers, outside the graphs' pool
        engram, engram_rows = self._engram_buffers(size * (drafts + 1), device)
        stage = None if engram is None else StagedCopy(engram)
        accepted = torch.zeros(size, dtype=torch.long, device=device)
        return VerifyBucket(size, plan, accepted, engram=engram, engram_rows=engram_rows, engram_stage=stage)


__all__ = ["VerifyBucket", "VerifyGraphs"]
