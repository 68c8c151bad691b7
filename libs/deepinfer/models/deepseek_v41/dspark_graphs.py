"""CUDA graphs of DSpark's draft pass (``speculator.DSparkSpeculator.propose``), one per batch bucket.

A draft pass is three stages of a V4.1 block over ``N · B`` block rows, the heads and the Markov loop: a few hundred
small kernels, whose launches cost more than their work at serving batches. The graph takes, per sequence, its
context-ring slot, its anchor token and position (``inputs [3, size]``, one host copy), gathers each stage's
context window from ``context_rings.ContextRings`` on the device, drafts, and leaves the tokens and confidences in
one buffer (``out [size, 2·B]``, float64: token ids are exact there) that the host reads once. Padding rows read
slot 0 and are dropped. The graphs hold the rings' tensors: they are captured again when the rings grow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v41.context_rings import ContextRings
from deepinfer.runtime.decode_graphs import SegmentGraphs
from deepinfer.runtime.host_copy import StagedCopy


def draft_pass(model: torch.nn.Module, rings: ContextRings, slots: torch.Tensor, anchors: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DSpark's drafts and confidences ``[N, 2·B]`` (float64) of the sequences in ring ``slots [N]`` whose last
    verified token ``anchors [N]`` sits at ``positions [N]``."""
    kv, mask = rings.gather(slots, positions)
    res = model.dspark.draft(anchors, positions, list(kv), mask, model.embed.weight, model.head.weight, model.ops)
    return torch.cat([res.tokens.to(torch.float64), res.confidence.to(torch.float64)], dim=1)


@dataclass
class DSparkBucket:
    size: int
    inputs: torch.Tensor  # [3, size]: ring slots, anchors, positions
    stage: StagedCopy
    graphs: list[Any] = field(default_factory=list)
    out: torch.Tensor | None = None  # [size, 2·B]


class DSparkGraphs(SegmentGraphs):
    """Per-bucket CUDA graphs of ``draft_pass`` (module docstring)."""

    kind = "draft"
    rings: ContextRings | None = None
    collective = False  # (the drafter keeps every expert on each rank: no exchange)

    def graphable(self, batch: ForwardBatch) -> bool:
        return bool(batch.chunks)

    def run(self, rings: ContextRings, rids: list[str], states: list, anchors: list[int]) -> torch.Tensor | None:
        """``draft_pass``'s ``[n, 2·B]`` for requests ``rids`` (``states``: theirs; each drafts after its last
        consumed position), or None: not graphed (the caller drafts eagerly)."""
        n = len(rids)
        slots = rings.slots(rids)  # (may grow the rings: before ``own``)
        ids = rings.pos[:n, 0]  # (any n device integers: what ``applies`` reads)
        probe = ForwardBatch(ids, ids, [SeqChunk(st, st.num_tokens, 1, None) for st in states])
        if not self.applies(probe):
            return None
        self.own(rings.rows, rings.pos)
        self.rings = rings
        host = np.zeros((3, n), dtype=np.int64)
        host[0], host[1] = slots, anchors
        host[2] = [st.num_tokens for st in states]

        def load(bk: DSparkBucket) -> None:
            full = np.zeros((3, bk.size), dtype=np.int64)
            full[:, :n] = host
            bk.stage.copy(torch.from_numpy(full))

        bk = self.bucket(probe, (), before=load)
        if bk is None:
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.out[:n]

    def _segments(self, bk: DSparkBucket) -> list[Callable[[], None]]:
        rings = self.rings  # (its tensors at the capture: the buckets go when they change, ``own``)

        def draft() -> None:
            bk.out = draft_pass(self.model, rings, bk.inputs[0], bk.inputs[1], bk.inputs[2])

        return [draft]

    def _bucket(self, size: int, device: torch.device) -> DSparkBucket:
        inputs = torch.zeros(3, size, dtype=torch.long, device=device)
        return DSparkBucket(size, inputs, StagedCopy(inputs))


__all__ = ["DSparkBucket", "DSparkGraphs", "draft_pass"]
