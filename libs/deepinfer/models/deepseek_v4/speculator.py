"""DeepSeek-V4's speculative decoding as the engine's runner drives it (``engine.speculative.steps``): the MTP block
drafts, the verify forward saves what rejected rows destroy, and the rollback brings each sequence to its kept
tokens (``speculative.py``, ``mtp_drafter.py``; docs/speculative_decoding.md).

The MTP block must have consumed every position the trunk has before it drafts (``mtp_drafter``): it reads the
trunk's streams at a position and the token after it. A step's last position of each sequence waits for its next
token (sampled by that step, maybe still on the device): its streams are kept as the sequence's ``carry`` and
consumed by the next step, with that token. A verify step knows its tokens on the host when it ends, so it
consumes all its kept positions at once and keeps the block's last row (``heads``): the next verify step drafts
from it without another block pass.

A sequence whose block lags (resumed from a resume point: its carry is gone) skips the missing positions: its drafts
are worse until its window refills, never its output (speculation emits the target's samples whatever the drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer import envs
from deepinfer.models.deepseek_v4.draft_graphs import OBSERVE_ROWS
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.mtp_drafter import EarlyDrafts, MTPDrafter, MTPHead
from deepinfer.models.deepseek_v4.speculative import VerifyStep, capturing_forward, save_states
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.verify_step import PooledVerify
from deepinfer.runtime.host_copy import tensor


@dataclass
class PendingVerify:
    """A verify forward's rollback: the model's ``VerifyStep`` of the verified sequences."""

    step: VerifyStep | PooledVerify
    chunks: list[int]  # the verified chunks of the step
    rids: list[str]


class MTPSpeculator:
    """Drafts with the model's first MTP block; ``max_drafts`` per sequence and step at most."""

    def __init__(self, model: torch.nn.Module, max_drafts: int, proposer: object | None = None) -> None:
        """``proposer``: drafts from elsewhere in place of the MTP block (``engine.speculative.oracle``; the block
        then never runs)."""
        if max_drafts <= 0:
            raise ValueError(f"max_drafts must be > 0, got {max_drafts}")
        self.proposer = proposer
        if proposer is None and not len(getattr(model, "mtp", ())):
            raise ValueError("the checkpoint has no MTP block (num_nextn_predict_layers = 0): nothing drafts")
        window = model.config.sliding_window
        if max_drafts + 1 > window:
            raise ValueError(f"{max_drafts} drafts need {max_drafts + 1} window rows; the window holds {window}")
        self.model, self.max_drafts = model, max_drafts
        self.drafter = MTPDrafter(model, pad=max_drafts) if proposer is None else None
        self.carry: dict[str, torch.Tensor] = {}  # rid -> the trunk's streams at its last consumed position
        self.heads: dict[str, MTPHead] = {}  # rid -> the block's last row (its block holds every position)
        # rid -> (its num_tokens then, drafts queued right after its verify step settled, its row in them)
        self.early: dict[str, tuple[int, EarlyDrafts, int]] = {}
        self.draft_early = envs.DEEPINFER_SPEC_EARLY_DRAFTS
        self.early_used = 0  # sequences whose drafts came from ``early`` (tests, benchmarks)

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.carry.pop(rid, None)
            self.heads.pop(rid, None)
            self.early.pop(rid, None)

    def warm_graphs(self, states: list[SequenceState]) -> None:
        """Capture the drafter's graphs at this batch before serving (the worker's warm-up, on its own sequences,
        released afterwards: their MTP state is left arbitrary): the observe pass for every row count a verify step
        may keep (1 .. ``max_drafts + 1``, by the graphs' powers of two) and the drafting loop (eagerly where the
        model has no graphs). Nothing where the drafter runs off the decode path."""
        d, m = self.drafter, self.model
        if d is None or not d._on_pool() or self.max_drafts + 1 > OBSERVE_ROWS:
            return
        c, dev, n = m.config, m.embed.weight.device, len(states)
        rows, heads = 1, []
        while rows < 2 * (self.max_drafts + 1):
            k = min(rows, self.max_drafts + 1)
            if any(st.num_tokens < k for st in states):
                return
            for st in states:
                st.mtp_tokens = st.num_tokens - k
            h = torch.zeros(k * n, c.hc_mult, c.hidden_size, dtype=m.embed.weight.dtype, device=dev)
            heads = d.observe_rows(h, torch.zeros(k * n, dtype=torch.long, device=dev), [k] * n, states, [None] * n)
            rows *= 2
        d.draft(heads, [self.max_drafts] * n, states, [None] * n)

    # -- drafting ---------------------------------------------------------------------------------
    def propose(
        self, rids: list[str], states: list[SequenceState], tables: list[torch.Tensor], last: list[int],
        counts: list[int],
    ) -> list[list[int]]:  # fmt: skip
        """Up to ``counts[b]`` drafts for sequence ``b``, whose next token is ``last[b]`` (fewer, maybe none, where
        its block cannot catch up)."""
        if self.proposer is not None:
            return self.proposer.propose(rids, [st.num_tokens for st in states], counts)
        out: list[list[int]] = [[] for _ in rids]
        done = set()
        for b, rid in enumerate(rids):  # drafted while the host planned this step: valid where nothing moved since
            at, got, row = self.early.pop(rid, (-1, None, 0))
            if got is not None and counts[b] > 0 and at == states[b].num_tokens and rid in self.heads:
                out[b] = got.rows()[row][: counts[b]]
                done.add(b)
        self.early_used += len(done)
        need = [b for b, rid in enumerate(rids) if rid not in self.heads and counts[b] > 0]
        ready = [b for b in need if self._catch_up(rids[b], states[b]) == states[b].num_tokens - 1]
        if ready:
            h = torch.stack([self.carry.pop(rids[b]) for b in ready])
            heads = self.drafter.observe(h, [(i, i + 1) for i in range(len(ready))], [[last[b]] for b in ready],
                                         [states[b] for b in ready], [tables[b] for b in ready])  # fmt: skip
            for b, hd in zip(ready, heads):
                self.heads[rids[b]] = hd
        live = [b for b, rid in enumerate(rids) if counts[b] > 0 and rid in self.heads and b not in done]
        if live:
            drafts = self.drafter.draft([self.heads[rids[b]] for b in live], [counts[b] for b in live],
                                        [states[b] for b in live], [tables[b] for b in live])  # fmt: skip
            for b, d in zip(live, drafts):
                out[b] = d
        return out

    def _catch_up(self, rid: str, st: SequenceState) -> int:
        """Where the block stands for a sequence without a head: ``num_tokens - 1`` with a carry; otherwise it skips
        to ``num_tokens`` (no carry: the position before cannot be consumed) and gets no drafts this step."""
        if st.mtp_tokens == st.num_tokens - 1 and rid in self.carry:
            return st.mtp_tokens
        st.mtp_tokens = st.num_tokens
        self.carry.pop(rid, None)
        return st.mtp_tokens

    # -- the verify forward -------------------------------------------------------------------------
    def forward(
        self, batch: ForwardBatch, cache: object, verified: list[int], rids: list[str], drafts: list[int],
        follow: bool = True,
    ) -> tuple[torch.Tensor, PendingVerify | None]:  # fmt: skip
        """The step's forward; chunks ``verified`` (with ``drafts[i]`` drafts each, their requests ``rids``) are
        verify rows: their state is saved first and the step keeps the compressors' projections (no decode graphs).
        (``follow``: the block follows a plain step from its output, which needs nothing more of the forward.)"""
        if not verified:
            return self.model(batch, cache), None
        got = self.model.verify_forward(batch, cache, verified, self.max_drafts)
        if got is not None:  # on the decode path
            h, _, pooled = got
            return h, PendingVerify(pooled, verified, rids)
        saves = save_states(self.model, [batch.chunks[i].state for i in verified], drafts)
        h, captured = capturing_forward(self.model, batch, cache)
        offsets = batch.offsets()
        step = VerifyStep(self.model, batch, h, h[:0], [offsets[i] for i in verified], saves, captured)
        return h, PendingVerify(step, verified, rids)

    def settle(
        self, pending: PendingVerify | None, accepted: list[int], emitted: list[list[int]], hidden: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:  # fmt: skip
        """Roll the verified sequences back to their kept tokens; their blocks consume the kept positions."""
        if pending is None:
            return
        pending.step.rollback(accepted)
        if self.drafter is None:
            return
        states = [s.state for s in pending.step.saves]
        for rid in pending.rids:
            self.heads.pop(rid, None)
            self.carry.pop(rid, None)
            self.early.pop(rid, None)
        # each block stands at p (it drafted from there): it consumes p .. p + a, whose next tokens are the emitted
        heads = self.drafter.observe(hidden, pending.step.offsets, emitted, states,
                                     [batch.chunks[i].block_table for i in pending.chunks])  # fmt: skip
        for rid, hd in zip(pending.rids, heads):
            self.heads[rid] = hd
        # their next drafts now, so that the device drafts while the host plans the next step (a sequence that
        # verifies next, the common case, then reads them; one that does not leaves them unread)
        got = self.drafter.draft_early(heads, self.max_drafts, states) if self.draft_early else None
        if got is not None:
            for row, (rid, st) in enumerate(zip(pending.rids, states)):
                self.early[rid] = (st.num_tokens, got, row)

    # -- the block after a plain step ---------------------------------------------------------------
    def follow(self, batch: ForwardBatch, hidden: torch.Tensor, chunks: list[int], rids: list[str]) -> None:
        """After a step that is no verify step for chunks ``chunks`` (requests ``rids``): each block consumes the
        chunk's positions whose next token is in the chunk (and the carried position before it); the chunk's last
        position becomes the carry. Token ids are read on the device (a placeholder's value may not be on the host)."""
        if not chunks or self.drafter is None:
            return
        offsets, ids = batch.offsets(), batch.token_ids
        # the carries copied at once (a graphed step's output is overwritten by the next replay)
        ends = tensor([offsets[i][1] - 1 for i in chunks], hidden.device, torch.long)
        lasts = hidden.index_select(0, ends)
        rows, nxt, states, tables, counts = [], [], [], [], []
        for k, (i, rid) in enumerate(zip(chunks, rids)):
            c = batch.chunks[i]
            a, b = offsets[i]
            st = c.state
            self.heads.pop(rid, None)
            self.early.pop(rid, None)
            carry = self.carry.pop(rid, None)
            with_carry = carry is not None and st.mtp_tokens == c.start - 1
            if not with_carry:
                st.mtp_tokens = c.start  # (a first chunk: nothing before it; else the block lags: skip)
            parts = ([carry.unsqueeze(0)] if with_carry else []) + [hidden[a : b - 1]]
            h = torch.cat(parts)
            nid = ids[a:b] if with_carry else ids[a + 1 : b]
            self.carry[rid] = lasts[k]
            if h.shape[0]:
                rows.append(h)
                nxt.append(nid)
                states.append(st)
                tables.append(c.block_table)
                counts.append(h.shape[0])
        if rows:
            self.drafter.observe_rows(torch.cat(rows), torch.cat(nxt), counts, states, tables)


__all__ = ["MTPSpeculator", "PendingVerify"]
