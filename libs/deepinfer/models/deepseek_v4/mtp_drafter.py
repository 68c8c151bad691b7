"""DeepSeek-V4's MTP (NextN) drafter for speculative decoding (docs/speculative_decoding.md, "Drafters").

The MTP block at position ``t`` reads the trunk's streams at ``t`` and the embedding of token ``t + 1`` and predicts
token ``t + 2``; it keeps its own window ring (layer ``num_hidden_layers + depth``) and counts the positions it has
consumed in ``SequenceState.mtp_tokens``. A run without speculation feeds it every consumed position once the next
token is known, so its state at ``c`` consumed tokens covers positions ``0 .. c`` (``mtp_tokens == c``).

* ``observe``: after a step consumed positions ``p .. c`` (a prefill, a decode step, a verify step rolled back to
  its kept rows) and the next token is sampled, the block consumes those positions with the trunk's streams and the
  tokens that follow them, as a run without speculation does; its last row's logits give the first draft.
* ``draft``: the other drafts, autoregressively: the block runs at ``c, c + 1, ..`` on its *own* previous streams
  (the trunk's are not known there) and its previous draft, taking the argmax. Those rows are not a plain run's, so
  the drafter saves the ring rows they overwrite and puts them back afterwards, with ``mtp_tokens`` (exact, no
  second pass); the next ``observe`` writes those positions with the trunk's streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4 import draft_graphs
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.speculative import restore_windows, save_windows
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.verify_step import V4VerifyPlan
from deepinfer.runtime.host_copy import to_host
from deepinfer.runtime.platform import Event


@dataclass
class MTPHead:
    """Per sequence, the MTP block's last row after ``observe``: its streams ``[hc, D]`` and its logits ``[V]``
    (the first draft's)."""

    streams: torch.Tensor
    logits: torch.Tensor


class MTPDrafter:
    """Drafts with MTP block ``depth`` of ``model`` (argmax), keeping its state a plain run's (module docstring)."""

    def __init__(self, model: torch.nn.Module, depth: int = 0, pad: int = 0) -> None:
        """``pad``: a graphed drafting loop runs at least this many drafts (the speculator's most; fewer drafts, near
        a request's ``max_tokens``, replay the full count's graph and drop the rest instead of capturing their
        own)."""
        if depth >= len(model.mtp):
            raise ValueError(f"the model has {len(model.mtp)} MTP blocks, not {depth + 1}")
        self.model, self.depth, self.pad = model, depth, pad
        self.layer = model.config.num_hidden_layers + depth

    def _run(
        self, h: torch.Tensor, ids: torch.Tensor, counts: list[int], states: list[SequenceState],
        tables: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:  # fmt: skip
        chunks = [SeqChunk(st, st.mtp_tokens, n, tb) for st, n, tb in zip(states, counts, tables)]
        pos = torch.cat([torch.arange(c.start, c.end) for c in chunks]).to(h.device)
        batch = ForwardBatch(ids, pos, chunks)
        x, logits = self.model.mtp_forward(h, ids, batch, self.depth)
        return x, logits, batch.offsets()

    @torch.no_grad()
    def observe_rows(
        self, h: torch.Tensor, next_ids: torch.Tensor, counts: list[int], states: list[SequenceState],
        tables: list[torch.Tensor],
    ) -> list[MTPHead]:  # fmt: skip
        """The block consumes ``counts[b]`` positions of sequence ``b`` from ``mtp_tokens`` on: the trunk streams
        ``h`` and the ids after them ``next_ids`` (flat, sequence after sequence, on the device); never past the
        trunk. Returns each sequence's last row."""
        for st, n in zip(states, counts):
            if n <= 0 or st.mtp_tokens + n > st.num_tokens:
                raise ValueError(
                    f"the MTP block holds {st.mtp_tokens} positions and gets {n}; the trunk holds {st.num_tokens}"
                )
        if self._on_pool() and max(counts) <= draft_graphs.OBSERVE_ROWS:
            return self._observe_on_device(h, next_ids, counts, states)
        x, logits, offs = self._run(h, next_ids, counts, states, tables)
        return [MTPHead(x[b - 1], logits[i]) for i, (_, b) in enumerate(offs)]

    def _on_pool(self) -> bool:
        """Whether the block runs on the model's ``StatePool`` (its decode path: not the batch-invariant ops)."""
        m = self.model
        return m.state_pool is not None and m.pooled_decode and not m.ops.batch_invariant

    def _graphs(self, kind: str) -> object | None:
        m = self.model
        return m.step_graphs.of(m, kind) if m.step_graphs is not None else None

    def _observe_on_device(self, h: torch.Tensor, next_ids: torch.Tensor, counts: list[int],
                           states: list[SequenceState]) -> list[MTPHead]:  # fmt: skip
        """``observe_rows`` on the decode path (``draft_graphs.observe_loop``), graphed where the model graphs its
        steps."""
        graphs = self._graphs("observe")
        got = None if graphs is None else graphs.run(states, h, next_ids, counts)
        if got is None:
            pool, dev = self.model.state_pool, h.device
            chunks = [SeqChunk(st, st.mtp_tokens, n, None) for st, n in zip(states, counts)]
            rows = 1 << (max(counts) - 1).bit_length()  # as the graphs' buckets: the same numbers
            plan = V4VerifyPlan.of(pool, None, self.model.config.sliding_window, chunks, rows - 1)
            plan.fused = self.model.verify_fused
            _, at, last = draft_graphs.observe_rows_of(counts, len(states))
            at = at.to(dev)
            n_rows = len(plan.subs) * len(states)
            hp = h.new_zeros(n_rows, *h.shape[1:]).index_copy_(0, at, h)
            ids = next_ids.new_zeros(n_rows).index_copy_(0, at, next_ids)
            got = draft_graphs.observe_loop(self.model, self.depth, plan, hp, ids, last.to(dev))
        for st, n in zip(states, counts):
            st.mtp_tokens += n
        return [MTPHead(got[0][b], got[1][b]) for b in range(len(states))]

    @torch.no_grad()
    def observe(
        self, hidden: torch.Tensor, offsets: list[tuple[int, int]], next_ids: list[list[int]],
        states: list[SequenceState], tables: list[torch.Tensor],
    ) -> list[MTPHead]:  # fmt: skip
        """The block consumes, per sequence, the trunk streams ``hidden[offsets[b][0] : + len(next_ids[b])]`` (its
        positions ``mtp_tokens ..``) with the tokens after them, ``next_ids[b]`` (each at least one)."""
        if any(not t for t in next_ids):
            raise ValueError("observe needs at least one position per sequence")
        rows = torch.cat([torch.arange(a, a + len(t)) for (a, _), t in zip(offsets, next_ids)]).to(hidden.device)
        ids = torch.tensor([x for t in next_ids for x in t], dtype=torch.long, device=hidden.device)
        return self.observe_rows(hidden.index_select(0, rows), ids, [len(t) for t in next_ids], states, tables)

    @torch.no_grad()
    def draft(
        self, heads: list[MTPHead], counts: list[int], states: list[SequenceState], tables: list[torch.Tensor]
    ) -> list[list[int]]:
        """``counts[b]`` drafts per sequence (0 allowed) from ``observe``'s heads; the state is left as it was. Where
        the model decodes on its ``StatePool``, the loop runs on the device (``draft_graphs``: graphed where the model
        graphs its steps)."""
        if self._on_pool():
            return self._draft_on_device(heads, counts, states)
        return self._draft_on_host(heads, counts, states, tables)

    def _draft_on_host(
        self, heads: list[MTPHead], counts: list[int], states: list[SequenceState], tables: list[torch.Tensor]
    ) -> list[list[int]]:
        """``draft`` step by step from the host (the batch-invariant ops: per-sequence state)."""
        window = self.model.config.sliding_window
        drafts = [[int(hd.logits.argmax())] if n > 0 else [] for hd, n in zip(heads, counts)]
        extra = [max(n - 1, 0) for n in counts]  # block rows each sequence runs past its consumed positions
        saves = []
        for st, k in zip(states, extra):
            if st.mtp_tokens != st.num_tokens:
                raise ValueError(f"the MTP block holds {st.mtp_tokens} positions, the trunk {st.num_tokens}: observe")
            if k > window:
                raise ValueError(f"{k} drafting rows overrun the MTP window of {window}")
            saves.append(save_windows(st, [self.layer], st.mtp_tokens, k))
        streams = [hd.streams for hd in heads]
        try:
            for step in range(max(extra, default=0)):
                live = [b for b, k in enumerate(extra) if k > step]
                h = torch.stack([streams[b] for b in live])
                ids = torch.tensor([drafts[b][-1] for b in live], dtype=torch.long, device=h.device)
                x, logits, _ = self._run(h, ids, [1] * len(live), [states[b] for b in live], [tables[b] for b in live])
                nxt = logits.argmax(-1).tolist()
                for i, b in enumerate(live):
                    streams[b] = x[i]
                    drafts[b].append(nxt[i])
        finally:
            for st, k, saved in zip(states, extra, saves):  # back to the consumed positions
                st.mtp_tokens = st.num_tokens
                restore_windows(st, saved, st.num_tokens, k, 0)
        return drafts

    def _draft_on_device(self, heads: list[MTPHead], counts: list[int], states: list[SequenceState]
                         ) -> list[list[int]]:  # fmt: skip
        """``draft`` by ``draft_graphs.draft_loop``: one host read of every draft."""
        out: list[list[int]] = [[] for _ in counts]
        live, got = self._launch(heads, counts, states)
        if got is None:
            return out
        rows = got.tolist()
        for i, b in enumerate(live):
            out[b] = rows[i][: counts[b]]
        return out

    @torch.no_grad()
    def draft_early(self, heads: list[MTPHead], k: int, states: list[SequenceState]) -> EarlyDrafts | None:
        """``k`` drafts for every sequence, queued on the device with their copy to the host, read later
        (``EarlyDrafts.rows``): a verify step's host work that follows (the scheduler's update and next plan) runs
        while the device drafts. The same drafts as ``draft`` from the same heads and states; None off the decode
        path (the host's drafting loop reads each draft as it goes)."""
        if not self._on_pool() or k <= 0 or not heads:
            return None
        _, got = self._launch(heads, [k] * len(heads), states)
        return EarlyDrafts(*to_host(got))

    def _launch(self, heads: list[MTPHead], counts: list[int], states: list[SequenceState]
                ) -> tuple[list[int], torch.Tensor | None]:  # fmt: skip
        """The drafting loop of the sequences with ``counts[b] > 0`` queued on the device: (those, their drafts
        ``[live, max(counts)]`` on the device, or None without any)."""
        live = [b for b, n in enumerate(counts) if n > 0]
        if not live:
            return live, None
        k, window = max(counts), self.model.config.sliding_window
        if k - 1 > window:
            raise ValueError(f"{k - 1} drafting rows overrun the MTP window of {window}")
        sts = [states[b] for b in live]
        for st in sts:
            if st.mtp_tokens != st.num_tokens:
                raise ValueError(f"the MTP block holds {st.mtp_tokens} positions, the trunk {st.num_tokens}: observe")
        first = torch.stack([heads[b].logits for b in live]).argmax(-1)
        got = first.unsqueeze(1)
        if k > 1:
            streams = torch.stack([heads[b].streams for b in live])
            graphs = self._graphs("draft")
            steps = max(k, min(self.pad, window + 1)) - 1  # (the drafts past k are dropped)
            got = None if graphs is None else graphs.run(sts, streams, first, steps)
            got = None if got is None else got[:, :k]
            if got is None:
                plan = draft_graphs.eager_plan(self.model.state_pool, window, sts, k - 1)
                got = draft_graphs.draft_loop(self.model, self.depth, plan, streams, first)
        return live, got


@dataclass
class EarlyDrafts:
    """Drafts queued on the device (``MTPDrafter.draft_early``): ``host`` their copy in host memory, complete once
    ``event`` has passed (None: no asynchronous copy, ``host`` is the drafts)."""

    host: torch.Tensor
    event: Event | None
    _rows: list[list[int]] | None = None

    def rows(self) -> list[list[int]]:
        """Every sequence's drafts (waits for the device's copy the first time)."""
        if self._rows is None:
            if self.event is not None:
                self.event.synchronize()
            self._rows = self.host.tolist()
        return self._rows


__all__ = ["EarlyDrafts", "MTPDrafter", "MTPHead"]
