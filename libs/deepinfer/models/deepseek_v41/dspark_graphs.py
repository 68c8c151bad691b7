"""CUDA graphs of DSpark's draft pass (``speculator.DSparkSpeculator.propose``), one per batch bucket, and of its
keep pass (the context of the positions a step kept: ``KeepGraphs``), one per row bucket.

A draft pass is three stages of a V4.1 block over ``N · B`` block rows, the heads and the Markov loop: a few hundred
small kernels, whose launches cost more than their work at serving batches. The graph takes, per sequence, its
context-ring slot, its anchor token and position (``inputs [3, size]``, one host copy), gathers each stage's
context window from ``context_rings.ContextRings`` on the device, drafts, and leaves the tokens and confidences in
one buffer (``out [size, 2·B]``, float64: token ids are exact there) that the host reads once. Padding rows read
slot 0 and are dropped. The graphs hold the rings' tensors: they are captured again when the rings grow.

The keep pass (``keep_pass``) projects the kept rows' target features and computes every stage's context KV of
them, written into the rings: a few dozen small kernels after every step that drafts or follows. Its graph takes,
per row, its feature row, position and ring slot (``inputs [3, size]``, one host copy), the features gathered into
the bucket's ``x`` before the replay (the step's features are a new tensor each step); padding rows repeat the last
row, so they write the bytes it writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v41.context_rings import ContextRings
from deepinfer.runtime.decode_graphs import SegmentGraphs, bucket_for
from deepinfer.runtime.host_copy import StagedCopy


def draft_pass(model: torch.nn.Module, rings: ContextRings, slots: torch.Tensor, anchors: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DSpark's drafts and confidences ``[N, 2·B]`` (float64) of the sequences in ring ``slots [N]`` whose last
    verified token ``anchors [N]`` sits at ``positions [N]``."""
    kv, mask = rings.gather(slots, positions)
    res = model.dspark.draft(anchors, positions, list(kv), mask, model.embed.weight, model.head.weight, model.ops)
    return torch.cat([res.tokens.to(torch.float64), res.confidence.to(torch.float64)], dim=1)


def keep_pass(model: torch.nn.Module, rings: ContextRings, x: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> None:  # fmt: skip
    """The context of kept rows into the rings: DSpark's projection of their target features ``x [n, L·D]`` and every
    stage's context KV at ``positions [n]``, written to ring ``slots [n]``."""
    main_x = model.dspark.project(x.to(model.embed.weight.dtype), model.ops)
    rings.put(slots, torch.stack(model.dspark.context_kv(main_x, positions, model.ops)), positions)


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


@dataclass
class KeepRows:
    """What ``SegmentGraphs.bucket`` reads of a keep pass: its row count and device."""

    rows: int
    device: torch.device


@dataclass
class KeepBucket:
    size: int
    inputs: torch.Tensor  # [3, size]: feature rows, positions, ring slots
    stage: StagedCopy
    x: torch.Tensor  # [size, L·D]: the rows' target features
    graphs: list[Any] = field(default_factory=list)


class KeepGraphs(SegmentGraphs):
    """Per-row-bucket CUDA graphs of ``keep_pass`` (module docstring): up to the decode bucket limit times DSpark's
    block size rows (a verify step's kept rows; a prompt's last window rows beyond that run eagerly)."""

    kind = "observe"
    rings: ContextRings | None = None
    collective = False  # (the drafter keeps every expert on each rank: no exchange)

    def graphable(self, batch: Any) -> bool:
        return batch.rows > 0

    def _size(self, batch: Any) -> int | None:
        return bucket_for(batch.rows, self.max_rows)

    @property
    def max_rows(self) -> int:
        """The most rows a graph keeps: the decode bucket limit's sequences, each DSpark's block size."""
        return self.max_batch * self.model.dspark.block_size

    def run(self, rings: ContextRings, features: torch.Tensor, rows: list[tuple[str, int, int, int]]) -> bool:
        """``keep_pass`` of ``rows`` (request, first feature row, end row, the first row's position) from a graph;
        False: not graphed (the caller keeps them eagerly)."""
        n = sum(b - a for _, a, b, _ in rows)
        probe = KeepRows(n, features.device)
        if not self.applies(probe):
            return False
        slots = rings.slots([rid for rid, *_ in rows])  # (may grow the rings: before ``own``)
        self.own(rings.rows, rings.pos)
        self.rings = rings
        host = np.empty((3, n), dtype=np.int64)
        host[0] = [r for _, a, b, _ in rows for r in range(a, b)]
        host[1] = [p + k for _, a, b, p in rows for k in range(b - a)]
        host[2] = [s for s, (_, a, b, _) in zip(slots, rows) for _ in range(b - a)]

        def load(bk: KeepBucket) -> None:
            full = np.repeat(host[:, -1:], bk.size, axis=1)  # padding: the last row again
            full[:, :n] = host
            bk.stage.copy(torch.from_numpy(full))
            bk.x.copy_(features.index_select(0, bk.inputs[0]))  # (in the model's dtype, as the eager pass casts)

        bk = self.bucket(probe, before=load)
        if bk is None:
            return False
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return True

    def _segments(self, bk: KeepBucket) -> list[Callable[[], None]]:
        rings = self.rings  # (its tensors at the capture: the buckets go when they change, ``own``)

        def keep() -> None:
            keep_pass(self.model, rings, bk.x, bk.inputs[1], bk.inputs[2])

        return [keep]

    def _bucket(self, size: int, device: torch.device) -> KeepBucket:
        inputs = torch.zeros(3, size, dtype=torch.long, device=device)
        x = torch.zeros(size, self.model.dspark.feature_dim, dtype=self.model.embed.weight.dtype, device=device)
        return KeepBucket(size, inputs, StagedCopy(inputs), x)


__all__ = ["DSparkBucket", "DSparkGraphs", "KeepBucket", "KeepGraphs", "KeepRows", "draft_pass", "keep_pass"]
