"""DeepSeek-V4.1's speculative decoding as the engine's runner drives it (``engine.speculative.steps``): DSpark drafts
a block per sequence, the verify forward saves what rejected rows destroy, and the rollback brings each sequence to
its kept tokens (docs/speculative_decoding.md, "DSpark").

DSpark (``dspark.py``) drafts the ``B`` positions after a sequence's last verified token in one pass, reading the
target's features of the ``W`` positions before it (each stage's context KV). Every step the target runs with its
features captured (``DeepseekV41Model.forward(capture=True)``: a decode step on its graphs, which compute them; a
verify step on the decode path, ``verify_step``, returns them); the context KV of every position it keeps is
computed once and kept in a per-sequence ring (``context_rings.ContextRings``: one device tensor for all sequences,
slot ``position % W``, tagged with its position, so a gap, e.g. steps run without the drafter, is masked rather than
misread). A step planned without drafts for its decode rows (the scheduler's batch limit or cost policy) runs
without the capture.

Variable length (``DEEPINFER_ENABLE_MTP_VARLEN``): a sequence verifies the leading drafts whose survival
``S_k = conf_0 ... conf_k`` (the confidence head's estimate that ``d_0 .. d_k`` are all kept) is at least
``DEEPINFER_SPEC_DECODE_MIN_SURVIVAL``, one at least; off, every drafted position is verified. Which drafts are
verified never changes the output: each verify row emits the target's own sample, and a draft is kept only where it
equals it.

Early drafts (``DEEPINFER_SPEC_EARLY_DRAFTS``): as a verify step settles, the verified sequences' next draft pass is
queued on the device with its copy to the host, so that the device drafts while the host applies the step and plans
the next; the next verify step reads it where the sequence has not moved (the same pass on the same rings, anchor
and position: the same drafts and confidences).

Rollback: on the decode path ``verify_step``'s; otherwise V4's (``deepseek_v4.speculative``: window rings, the
ratio-2 compressors' pending pair, the Engram history; paged rows past the count are rewritten later).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer import envs
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.mtp_drafter import EarlyDrafts
from deepinfer.models.deepseek_v4.speculative import VerifyStep, capturing_forward, save_states
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.verify_step import PooledVerify
from deepinfer.models.deepseek_v41.context_rings import ContextRings
from deepinfer.models.deepseek_v41.dspark_graphs import draft_pass, keep_pass
from deepinfer.runtime.decode_graphs import bucket_for
from deepinfer.runtime.host_copy import tensor, to_host


@dataclass
class PendingVerify:
    """A verify forward's rollback: V4's ``VerifyStep`` of the verified sequences."""

    step: VerifyStep | PooledVerify
    chunks: list[int]  # the verified chunks of the step
    rids: list[str]


def survival_lengths(confidence: torch.Tensor, counts: list[int], threshold: float) -> list[int]:
    """Per row of ``confidence [N, B]``: how many leading drafts have survival ``prod(conf[:k+1]) >= threshold``,
    between 1 and ``counts[n]``."""
    keep = (torch.cumprod(confidence.float(), dim=1) >= threshold).sum(1).tolist()
    return [max(1, min(int(k), n)) for k, n in zip(keep, counts)]


class DSparkSpeculator:
    """Drafts with the model's DSpark stages, ``max_drafts`` per sequence and step at most (the block size)."""

    def __init__(
        self, model: torch.nn.Module, max_drafts: int, proposer: object | None = None, varlen: bool = True,
        min_survival: float = 0.0,
    ) -> None:  # fmt: skip
        """``proposer``: drafts from elsewhere in place of DSpark (``engine.speculative.oracle``; the stages then never
        run). ``varlen``: verify each sequence's drafts as far as their survival reaches ``min_survival``."""
        if max_drafts <= 0:
            raise ValueError(f"max_drafts must be > 0, got {max_drafts}")
        c = model.text
        if proposer is None and model.mtp is None:
            raise ValueError("the checkpoint has no DSpark stages (num_nextn_predict_layers = 0): nothing drafts")
        if proposer is None and max_drafts > c.dspark_block_size:
            raise ValueError(f"{max_drafts} drafts per step: DSpark drafts a block of {c.dspark_block_size}")
        if max_drafts + 1 > c.sliding_window:
            w = c.sliding_window
            raise ValueError(f"{max_drafts} drafts need {max_drafts + 1} window rows; the window holds {w}")
        if not 0.0 <= min_survival <= 1.0:
            raise ValueError(f"min_survival must lie in [0, 1], got {min_survival}")
        self.model, self.max_drafts, self.proposer = model, max_drafts, proposer
        self.varlen, self.min_survival = varlen, min_survival
        c = model.text
        self.rings = ContextRings(len(model.mtp) if model.mtp is not None else 0, c.sliding_window, c.head_dim,
                                  model.embed.weight.dtype, model.embed.weight.device)  # fmt: skip
        self.features: torch.Tensor | None = None  # the last forward's captured target features [T, L·D]
        self.last_confidence: dict[str, list[float]] = {}  # rid -> the confidences its last draft lengths came from
        # rid -> (its num_tokens then, the draft pass queued right after its verify step settled, its row in it)
        self.early: dict[str, tuple[int, EarlyDrafts, int]] = {}
        self.draft_early = envs.DEEPINFER_SPEC_EARLY_DRAFTS
        self.early_used = 0  # sequences whose drafts came from ``early`` (tests, benchmarks)

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.rings.release(rid)
            self.last_confidence.pop(rid, None)
            self.early.pop(rid, None)

    def warm_graphs(self, states: list[SequenceState]) -> None:
        """Capture the draft pass's graph at this batch before serving, and the keep pass's for every row count a step
        of this batch may keep (one row a sequence up to ``max_drafts + 1``; the worker's warm-up, on its own
        sequences; their rings are released afterwards)."""
        m = self.model
        graphs = m.step_graphs.of(m, "draft") if self.proposer is None and m.step_graphs is not None else None
        if graphs is None:
            return
        n = len(states)
        rids = [f"warm-up {i}" for i in range(n)]
        try:
            graphs.run(self.rings, rids, states, [0] * n)
            keep = m.step_graphs.of(m, "observe")
            if keep is None:
                return
            most = n * (self.max_drafts + 1)
            features = torch.zeros(most, m.dspark.feature_dim, device=m.embed.weight.device)
            sizes = {bucket_for(r, keep.max_rows): r for r in range(most, n - 1, -1)}  # (each bucket's fewest rows)
            for size, r in sizes.items():
                if size is not None:  # r rows, spread over the sequences
                    counts = [r // n + (i < r % n) for i in range(n)]
                    ends = np.cumsum(counts).tolist()
                    keep.run(self.rings, features, [(rid, e - c, e, 0) for rid, c, e in zip(rids, counts, ends)])
        finally:
            self.release(rids)

    # -- drafting ---------------------------------------------------------------------------------
    def propose(
        self, rids: list[str], states: list[SequenceState], tables: list[torch.Tensor], last: list[int],
        counts: list[int],
    ) -> list[list[int]]:  # fmt: skip
        """Up to ``counts[b]`` drafts for sequence ``b`` at position ``num_tokens`` whose token is ``last[b]``."""
        if self.proposer is not None:
            return self.proposer.propose(rids, [st.num_tokens for st in states], counts)
        live = [b for b in range(len(rids)) if counts[b] > 0]
        out: list[list[int]] = [[] for _ in rids]
        if not live:
            return out
        rows: dict[int, list[float]] = {}  # b -> its draft pass's row: drafts, then confidences
        for b in live:  # drafted while the host planned this step: valid where nothing moved since
            at, got, row = self.early.pop(rids[b], (-1, None, 0))
            if got is not None and at == states[b].num_tokens:
                rows[b] = got.rows()[row]
        self.early_used += len(rows)
        rest = [b for b in live if b not in rows]
        if rest:
            host = self._draft_pass([rids[b] for b in rest], [states[b] for b in rest], [last[b] for b in rest])
            rows.update(zip(rest, host.tolist()))  # drafts and confidences, one read
        block = len(rows[live[0]]) // 2
        toks = [[int(x) for x in rows[b][:block]] for b in live]
        conf = torch.tensor([rows[b][block:] for b in live], dtype=torch.float64).float()
        want = [counts[b] for b in live]
        lengths = survival_lengths(conf, want, self.min_survival) if self.varlen else want
        conf = conf.tolist()
        for k, b in enumerate(live):
            out[b] = toks[k][: lengths[k]]
            self.last_confidence[rids[b]] = conf[k]
        return out

    def _draft_pass(self, rids: list[str], states: list[SequenceState], anchors: list[int]) -> torch.Tensor:
        """The draft pass of these sequences (each after its last consumed position, whose token is ``anchors[k]``),
        queued on the device: ``[n, 2·B]`` drafts and confidences (graphed where the model graphs it)."""
        m = self.model
        graphs = m.step_graphs.of(m, "draft") if m.step_graphs is not None else None
        got = None if graphs is None else graphs.run(self.rings, rids, states, anchors)
        if got is None:  # eagerly
            dev = m.embed.weight.device
            pos = tensor([st.num_tokens for st in states], dev, torch.long)
            slots = tensor(self.rings.slots(rids), dev, torch.long)
            got = draft_pass(m, self.rings, slots, tensor(anchors, dev, torch.long), pos)
        return got

    # -- the step's forward ---------------------------------------------------------------------------
    def forward(
        self, batch: ForwardBatch, cache: object, verified: list[int], rids: list[str], drafts: list[int],
        follow: bool = True,
    ) -> tuple[torch.Tensor, PendingVerify | None]:  # fmt: skip
        """The step's forward, with the target features captured where the drafter follows the step (``follow``) or
        chunks ``verified`` verify ``drafts[i]`` drafts (their state saved first)."""
        self.features = None
        capture = (follow or bool(verified)) and self.proposer is None
        if not verified:
            h = self.model(batch, cache, capture=capture)
            self.features = self.model.dspark_features if capture else None
            return h, None
        got = self.model.verify_forward(batch, cache, verified, self.max_drafts, capture)
        if got is not None:  # on the decode path
            h, self.features, pooled = got
            return h, PendingVerify(pooled, verified, rids)
        saves = save_states(self.model, [batch.chunks[i].state for i in verified], drafts)
        h, captured = capturing_forward(self.model, batch, cache, capture=capture)
        self.features = self.model.dspark_features if capture else None
        offsets = batch.offsets()
        step = VerifyStep(self.model, batch, h, h[:0], [offsets[i] for i in verified], saves, captured)
        return h, PendingVerify(step, verified, rids)

    def settle(
        self, pending: PendingVerify | None, accepted: list[int], emitted: list[list[int]], hidden: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:  # fmt: skip
        """Roll the verified sequences back to their kept tokens (Engram history too); keep their kept positions'
        context."""
        if pending is None:
            return
        pending.step.rollback(accepted)
        self._keep([
            (rid, lo, lo + a + 1, batch.chunks[i].start)
            for i, rid, a, (lo, _) in zip(pending.chunks, pending.rids, accepted, pending.step.offsets)
        ])  # fmt: skip
        for rid in pending.rids:
            self.early.pop(rid, None)
        if not self.draft_early or self.proposer is not None or not pending.rids:
            return
        # their next draft pass now, so that the device drafts while the host applies this step and plans the next
        # (a sequence that verifies next, the common case, then reads it; one that does not leaves it unread)
        states = [sv.state for sv in pending.step.saves]
        got = EarlyDrafts(*to_host(self._draft_pass(pending.rids, states, [e[-1] for e in emitted])))
        for row, (rid, st) in enumerate(zip(pending.rids, states)):
            self.early[rid] = (st.num_tokens, got, row)

    def follow(self, batch: ForwardBatch, hidden: torch.Tensor, chunks: list[int], rids: list[str]) -> None:
        """After the step: each chunk of ``chunks`` (no verify chunk) keeps the context of its positions (the last
        ``W``; a bounded decoder replay's rows before ``decoder_from`` have none)."""
        for rid in rids:
            self.early.pop(rid, None)  # (moved: its early drafts are stale)
        if not chunks or self.features is None:
            return
        w, offsets, rows = self.model.text.sliding_window, batch.offsets(), []
        for i, rid in zip(chunks, rids):
            c, (a, b) = batch.chunks[i], offsets[i]
            first = max(a, b - w, a + (c.decoder_from - c.start if c.decoder_from is not None else 0))
            if first < b:
                rows.append((rid, first, b, c.start + first - a))
        self._keep(rows)

    def _keep(self, rows: list[tuple[str, int, int, int]]) -> None:
        """``rows``: (request, first batch row, end row, the first row's position): their context KV into the rings,
        computed for all of them at once (``dspark_graphs.keep_pass``), from a graph where the model graphs its steps
        (``dspark_graphs.KeepGraphs``)."""
        if not rows or self.features is None:
            return
        m = self.model
        graphs = m.step_graphs.of(m, "observe") if m.step_graphs is not None else None
        if graphs is not None and graphs.run(self.rings, self.features, rows):
            return
        dev = self.features.device
        idx = tensor([r for _, a, b, _ in rows for r in range(a, b)], dev, torch.long)
        pos = tensor([p + k for _, a, b, p in rows for k in range(b - a)], dev, torch.long)
        slots = [s for s, (_, a, b, _) in zip(self.rings.slots([rid for rid, *_ in rows]), rows) for _ in range(b - a)]
        keep_pass(m, self.rings, self.features.index_select(0, idx), pos, tensor(slots, dev, torch.long))


__all__ = ["DSparkSpeculator", "PendingVerify", "survival_lengths"]
