"""DeepSeek-V4's MTP drafter on the decode path: its observe pass and its drafting loop on the device, each one
CUDA graph per bucket.

``mtp_drafter.MTPDrafter.draft`` runs the MTP block ``K - 1`` times past each sequence's consumed positions, one
row per sequence, each step on the block's own previous streams and its previous draft (argmax), then puts back the
block's window rows those steps overwrote. Step by step from the host that is a few hundred eager kernels and a
device-to-host copy per step. Here (``draft_loop``) the whole loop runs from device tensors: the first drafts (the
heads' argmax), ``K - 1`` block steps as decode steps on the ``StatePool`` (``decode_step.attend`` with one
``V4DecodePlan`` per step: the block is a sliding-window layer, nothing paged), the window rows saved first and put
back last; the host reads the ``[S, K]`` drafts once. The state is left as it was, so the loop is idempotent: a
bucket (batch size, steps) is captured whole (``DraftGraphs``) and replayed.

``MTPDrafter.observe`` (the block consumes the positions a step kept, with the trunk's streams and the tokens after
them: ``n_b`` rows per sequence, at most ``OBSERVE_ROWS``) runs the same way (``observe_loop``): the block's rows
laid out sub-step after sub-step (``verify_step``'s layout, a sequence's rows past its ``n_b`` dead), every per-row
part once over all of them, the attention as ``n`` decode sub-steps in order (``verify_step.attend``, nothing to
put back: every live row is kept), the head on each sequence's last row. ``ObserveGraphs`` graphs it per bucket
(batch size and rows, rounded up to a power of two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.models.deepseek_v4 import decode_step, verify_step
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.graphs import GraphedModel
from deepinfer.models.deepseek_v4.verify_step import V4VerifyPlan, host_meta, verify_rows
from deepinfer.runtime.decode_graphs import SegmentGraphs
from deepinfer.runtime.host_copy import StagedCopy


def draft_plan(pool: Any, window: int, size: int, steps: int) -> V4VerifyPlan:
    """A graphed bucket's plan: ``steps`` sub-steps of ``size`` rows (nothing paged), loaded by ``load_plan``."""
    buf = torch.zeros(4 * steps + 1, size, dtype=torch.long, device=pool.device)
    subs = [decode_step.V4DecodePlan(pool, None, window, buf[4 * j : 4 * j + 4], None, window, {})
            for j in range(steps)]  # fmt: skip
    return V4VerifyPlan(pool, subs, buf[0], buf[4 * steps], stage=StagedCopy(buf))


def load_plan(plan: V4VerifyPlan, states: list, slots: list[int]) -> None:
    """Load ``plan`` with the sequences ``states`` (slots ``slots``): step ``j`` at position ``mtp_tokens + j``."""
    k = len(plan.subs)
    chunks = [SeqChunk(st, st.mtp_tokens, k, None) for st in states]
    host, _ = host_meta(chunks, slots, plan.pool.scratch, plan.size, k - 1)
    full = torch.zeros(plan.stage.dst.shape, dtype=torch.long)
    full[: 4 * k] = torch.from_numpy(host)
    full[4 * k, : len(states)] = torch.tensor([st.mtp_tokens for st in states])
    plan.stage.copy(full)


def eager_plan(pool: Any, window: int, states: list, steps: int) -> V4VerifyPlan:
    """An eager loop's plan."""
    slots = pool.adopt(states)
    plan = draft_plan(pool, window, len(states), steps)
    load_plan(plan, states, slots)
    return plan


def draft_loop(model: torch.nn.Module, depth: int, plan: V4VerifyPlan, streams: torch.Tensor,
               first: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The drafts ``[S, steps + 1]``: ``first`` (the heads' argmax) then one per block step (module docstring); the
    block's window rows are left as they were."""
    blk, ops, rope = model.mtp[depth], model.ops, model.rope_main
    layer = model.config.num_hidden_layers + depth
    ring = model.state_pool.rings[layer]
    flat, cap = ring.view(-1, ring.shape[-1]), ring.shape[1]
    steps = torch.arange(len(plan.subs), device=first.device)
    rows = (plan.slots.unsqueeze(1) * cap + (plan.base.unsqueeze(1) + steps) % cap).reshape(-1)
    saved = flat.index_select(0, rows)
    h, ids, out = streams, first, [first]
    for sub in plan.subs:
        e = blk.enorm(model.embed(ids), ops)
        x = blk.e_proj(e, ops).unsqueeze(1) + blk.h_proj(blk.hnorm(h, ops), ops)
        t, post, comb = blk.attn_in(x, sub.meta[1], rope, ops)
        att = decode_step.attend(blk.attn, t, sub, rope, ops)
        h = blk.ffn_out(att, t, x, post, comb, ids, ops)
        ids = model._head(h, blk, blk.norm).argmax(-1)
        out.append(ids)
    put_back(flat, rows, saved)
    return torch.stack(out, 1)


def put_back(flat: torch.Tensor, rows: torch.Tensor, saved: torch.Tensor) -> None:
    """The window rows the loop overwrote, as they were."""
    flat.index_copy_(0, rows, saved)


@dataclass
class DraftBucket:
    size: int
    plan: V4VerifyPlan
    streams: torch.Tensor  # [size, hc, D]
    first: torch.Tensor  # [size]
    graphs: list[Any] = field(default_factory=list)
    drafts: torch.Tensor | None = None  # [size, steps + 1]


class BlockGraphs(SegmentGraphs):
    """Graphs of MTP block ``depth``'s passes (``DraftGraphs``, ``ObserveGraphs``): any non-empty batch of
    sequences."""

    model: GraphedModel
    collective = False  # (the drafter keeps every expert on each rank: no exchange)

    def __init__(self, model: torch.nn.Module, depth: int = 0, max_batch: int | None = None) -> None:
        super().__init__(model, max_batch)
        self.depth = depth

    def graphable(self, batch: ForwardBatch) -> bool:
        return bool(batch.chunks)


class DraftGraphs(BlockGraphs):
    """Per-bucket CUDA graphs of ``draft_loop`` (a bucket: batch size and block steps)."""

    kind = "draft"

    def run(self, states: list, streams: torch.Tensor, first: torch.Tensor, steps: int) -> torch.Tensor | None:
        """The drafts ``[n, steps + 1]`` of ``states`` (``streams``, ``first``: their heads'), or None: not graphed."""
        pool = self.model.state_pool
        probe = ForwardBatch(first, first, [SeqChunk(st, st.mtp_tokens, 1, None) for st in states])
        if pool is None or not self.applies(probe):
            return None
        slots = pool.adopt(states)
        self.own(pool, pool.generation)
        n = len(states)

        def load(bk: DraftBucket) -> None:
            load_plan(bk.plan, states, slots)
            bk.streams[:n].copy_(streams)
            bk.first[:n].copy_(first)

        bk = self.bucket(probe, (steps,), before=load)
        if bk is None:
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.drafts[:n]

    def _segments(self, bk: DraftBucket) -> list[Callable[[], None]]:
        def loop() -> None:
            bk.plan.clear()
            bk.drafts = draft_loop(self.model, self.depth, bk.plan, bk.streams, bk.first)

        return [loop]

    def _bucket(self, size: int, device: torch.device, steps: int = 1) -> DraftBucket:
        model = self.model
        plan = draft_plan(model.state_pool, model.config.sliding_window, size, steps)
        hc, dim = model.config.hc_mult, model.config.hidden_size
        streams = torch.zeros(size, hc, dim, dtype=model.embed.weight.dtype, device=device)
        return DraftBucket(size, plan, streams, torch.zeros(size, dtype=torch.long, device=device))


OBSERVE_ROWS = 8  # the most rows per sequence an observe pass takes on the decode path (more: the ragged path)


def observe_loop(model: torch.nn.Module, depth: int, plan: V4VerifyPlan, h: torch.Tensor, ids: torch.Tensor,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The block over ``plan``'s rows (``h``, ``ids``: the trunk streams and next tokens, sub-step after sub-step):
    the streams and fp32 logits of rows ``last [S]`` (each sequence's last)."""
    blk, ops, rope = model.mtp[depth], model.ops, model.rope_main
    e = blk.enorm(model.embed(ids), ops)
    x = blk.e_proj(e, ops).unsqueeze(1) + blk.h_proj(blk.hnorm(h, ops), ops)
    t, post, comb = blk.attn_in(x, torch.cat([sub.meta[1] for sub in plan.subs]), rope, ops)
    att = verify_step.attend(blk.attn, t, plan, rope, ops, keep=False)
    y = blk.ffn_out(att, t, x, post, comb, ids, ops).index_select(0, last)
    return y, model._head(y, blk, blk.norm)


def observe_rows_of(counts: list[int], size: int) -> tuple[list[SeqChunk], torch.Tensor, torch.Tensor]:
    """For ``counts[b]`` rows per sequence (flat, sequence after sequence): where each sits in the layout of ``size``
    rows per sub-step, and each sequence's last row there."""
    chunks = [SeqChunk(None, 0, n, None) for n in counts]  # (lengths only)
    last = torch.tensor([(n - 1) * size + b for b, n in enumerate(counts)], dtype=torch.long)
    return chunks, torch.from_numpy(verify_rows(chunks, size)), last


@dataclass
class ObserveBucket:
    size: int
    plan: V4VerifyPlan
    h: torch.Tensor  # [rows·size, hc, D]
    ids: torch.Tensor  # [rows·size]
    last: torch.Tensor  # [size]
    graphs: list[Any] = field(default_factory=list)
    out: tuple[torch.Tensor, torch.Tensor] | None = None


class ObserveGraphs(BlockGraphs):
    """Per-bucket CUDA graphs of ``observe_loop`` (a bucket: batch size and rows per sequence)."""

    kind = "observe"

    def run(self, states: list, h: torch.Tensor, ids: torch.Tensor, counts: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The streams and logits of each sequence's last row after the block consumed ``counts[b]`` rows of
        ``h`` / ``ids`` (flat, sequence after sequence), or None: not graphed."""
        pool = self.model.state_pool
        chunks = [SeqChunk(st, st.mtp_tokens, n, None) for st, n in zip(states, counts)]
        probe = ForwardBatch(ids, ids, chunks)
        if pool is None or not self.applies(probe):
            return None
        slots = pool.adopt(states)
        self.own(pool, pool.generation)
        rows = 1 << (max(counts) - 1).bit_length()
        n = len(states)

        def load(bk: ObserveBucket) -> None:
            host, _ = host_meta(chunks, slots, pool.scratch, bk.size, rows - 1)
            full = torch.zeros(bk.plan.stage.dst.shape, dtype=torch.long)
            full[: 4 * rows] = torch.from_numpy(host)
            bk.plan.stage.copy(full)
            _, at, last = observe_rows_of(counts, bk.size)
            idx = torch.cat([at, last]).to(h.device, non_blocking=True)
            bk.h.zero_().index_copy_(0, idx[: at.numel()], h)
            bk.ids.zero_().index_copy_(0, idx[: at.numel()], ids)
            bk.last.zero_()[:n].copy_(idx[at.numel() :])

        bk = self.bucket(probe, (rows,), before=load)
        if bk is None:
            return None
        load(bk)
        bk.graphs[0].replay()
        self.replays += 1
        return bk.out[0][:n].clone(), bk.out[1][:n].clone()

    def _segments(self, bk: ObserveBucket) -> list[Callable[[], None]]:
        def observe() -> None:
            bk.plan.clear()
            bk.out = observe_loop(self.model, self.depth, bk.plan, bk.h, bk.ids, bk.last)

        return [observe]

    def _bucket(self, size: int, device: torch.device, rows: int = 1) -> ObserveBucket:
        model = self.model
        plan = draft_plan(model.state_pool, model.config.sliding_window, size, rows)
        plan.fused = model.verify_fused
        hc, dim = model.config.hc_mult, model.config.hidden_size
        h = torch.zeros(rows * size, hc, dim, dtype=model.embed.weight.dtype, device=device)
        z = torch.zeros(rows * size, dtype=torch.long, device=device)
        return ObserveBucket(size, plan, h, z, torch.zeros(size, dtype=torch.long, device=device))


__all__ = [
    "OBSERVE_ROWS",
    "BlockGraphs",
    "ObserveBucket",
    "ObserveGraphs",
    "observe_loop",
    "observe_rows_of",
    "DraftBucket",
    "DraftGraphs",
    "draft_loop",
    "draft_plan",
    "eager_plan",
    "load_plan",
    "put_back",
]
