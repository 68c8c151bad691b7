"""The worker runtime: runs a :class:`StepPlan` through the model, samples, computes logprobs.

It owns the device-side state: the paged cache and each running request's short-term state.
Seeded requests draw their sampling noise from a generator keyed by (seed, position) — a counter
scheme, so a token depends only on the seed, its position and its logits, never on batch-mates,
on earlier draws, or on a preemption in between.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from deepinfer.engine import resume_format
from deepinfer.engine.constraints import ConstraintSet
from deepinfer.engine.interfaces import FetchResult, SeqResult, StepPlan, StepResult
from deepinfer.engine.models import Model
from deepinfer.engine.sampler import Sampler, compute_logprobs
from deepinfer.host_copy import tensor
from deepinfer.models.deepseek_v4.state import ForwardBatch, PagedKVCache, SeqChunk, SequenceState, StateSnapshot

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the per-token seed of a seeded request."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def min_replay(config: object) -> int:
    """The shortest bounded replay that rebuilds every compressor's pending tokens (the model config says)."""
    return config.min_replay()


class ModelRunner:
    def __init__(self, model: Model, cache: PagedKVCache, device: torch.device | str = "cpu") -> None:
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.sampler = Sampler()
        self.states: dict[str, SequenceState] = {}
        self.tables: dict[str, torch.Tensor] = {}  # each running request's last block table
        self.snapshots: dict[str, StateSnapshot] = {}  # prefix-cache resume points, in host memory
        self.remote = None  # a kvstore.remote.RemoteResumeStore when resume points move to a kvstore
        self.fetched: dict[str, tuple[StateSnapshot, dict]] = {}  # resume points fetched from the kvstore
        self.compact_replay = 0  # > 0: compact snapshots, resumed by a bounded replay of this many tokens
        self.constraints: ConstraintSet | None = None  # structured-output matchers (set by the factory)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            self.tables.pop(rid, None)
        if self.constraints is not None:
            self.constraints.release(request_ids)

    def _snapshots(self, plan: StepPlan) -> None:
        for order in plan.snapshots:
            st = self.states.get(order.request_id)
            if st is None or st.num_tokens != order.position:
                held = None if st is None else st.num_tokens
                raise RuntimeError(f"snapshot {order.snapshot_id}: request {order.request_id} holds {held} tokens, "
                                   f"not {order.position}")  # fmt: skip
            self.snapshots[order.snapshot_id] = StateSnapshot.take(
                st, self.cache, self.tables[order.request_id], compact=self.compact_replay > 0
            )
        for o in plan.offloads:  # read the pages now: this step's chunks may reuse them
            snap = self.snapshots.pop(o.snapshot_id, None)
            if snap is not None and self.remote is not None:
                pages = self.cache.read_pages(tensor(o.pages, self.device, torch.long))
                self.remote.put(o.key, resume_format.encode(snap, pages), o.meta)
        for f in plan.fetches:
            if self.remote is None:
                raise RuntimeError(f"fetch {f.fetch_id}: this worker has no kvstore")
            self.remote.fetch(f.fetch_id, f.key)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        """Take the ordered snapshots, drop released states, run the chunks (resuming from snapshots where
        asked), then drop the snapshots the scheduler evicted (a chunk of this step may still start from one)."""
        self._snapshots(plan)
        self.release(plan.released)
        try:
            result = self._run(plan)
        finally:
            for sid in plan.dropped_snapshots:
                self.snapshots.pop(sid, None)
                self.fetched.pop(sid, None)
        if self.remote is not None:
            if not plan.chunks and not plan.fetches:
                self.remote.wait(0.005)  # an idle step waiting for fetches: do not spin
            for f in self.remote.completed():
                if f.payload is not None:
                    self.fetched[f.fetch_id] = f.payload
                result.fetched.append(FetchResult(f.fetch_id, f.payload is not None, f.reason))
        return result

    def _run(self, plan: StepPlan) -> StepResult:
        result = StepResult(step_id=plan.step_id)
        if not plan.chunks:
            return result
        chunks = []
        # one copy of the step's tables as a zero-padded [B, P] matrix: each chunk's table is a leading slice of its
        # row, and the model's pooled decode takes the matrix as is (state_pool.stacked_rows)
        width = max(len(c.block_table) for c in plan.chunks)
        padded = tensor([[*c.block_table, *[0] * (width - len(c.block_table))] for c in plan.chunks], self.device,
                        torch.long)  # fmt: skip
        tables = [row[: len(c.block_table)] for row, c in zip(padded, plan.chunks)]
        for c, table in zip(plan.chunks, tables):
            if c.resume_from is not None:
                self.states[c.request_id] = self._resume(c.request_id, c.resume_from, c.start, table)
            st = self.states.setdefault(c.request_id, SequenceState())
            if st.num_tokens != c.start:
                raise RuntimeError(f"request {c.request_id}: step starts at {c.start}, state holds {st.num_tokens}")
            if c.decoder_from is not None and (c.logprob_targets is not None or c.sample):
                scored = [j for j, t in enumerate(c.logprob_targets or []) if t >= 0]
                first = c.start + (scored[0] if scored else len(c.token_ids) - 1)
                if first < c.decoder_from:  # a bounded decoder replay gives those rows no output
                    raise RuntimeError(f"request {c.request_id}: logits asked at {first}, the decoder starts at "
                                       f"{c.decoder_from}")  # fmt: skip
            self.tables[c.request_id] = table
            chunks.append(SeqChunk(st, c.start, len(c.token_ids), table, c.decoder_from))
        masks = self._start_masks(plan)  # filled on the CPU while the device runs the forward
        batch = ForwardBatch.build(chunks, [c.token_ids for c in plan.chunks], device=self.device)
        hidden = self.model(batch, self.cache)
        # rows whose logits we need: prompt-logprob rows, then the sampling rows
        rows, owners = [], []
        for i, ((a, b), c) in enumerate(zip(batch.offsets(), plan.chunks)):
            if c.logprob_targets is not None:
                for j, t in enumerate(c.logprob_targets):
                    if t >= 0:
                        rows.append(a + j)
                        owners.append((i, t))
            if c.sample:
                rows.append(b - 1)
                owners.append((i, None))
        per_seq = [SeqResult(c.request_id) for c in plan.chunks]
        if rows:
            logits = self.model.logits(hidden[tensor(rows, self.device, torch.long)])
            self._prompt_logprobs(logits, owners, plan, per_seq)
            self._sample(logits, owners, plan, per_seq, masks)
        result.results = per_seq
        return result

    def _resume(self, rid: str, source: str, start: int, table: torch.Tensor) -> SequenceState:
        """The state a resumed request starts from: a device snapshot, or a fetched one (its pages too)."""
        if source in self.fetched:
            snap, pages = self.fetched.pop(source)
            self.cache.write_pages(table[: snap.position // self.cache.page_size], pages)
        elif source in self.snapshots:
            snap = self.snapshots[source]
        else:
            raise RuntimeError(f"request {rid}: no snapshot {source}")
        if snap.compact:
            if not (start == 0 or snap.position - start >= min_replay(self.model.config)) or start > snap.position:
                raise RuntimeError(f"request {rid}: a replay from {start} to {snap.position} is too short")
            return snap.restore_replay(self.cache, table, self.device, start)
        if snap.position != start:
            raise RuntimeError(f"request {rid}: snapshot {source} is at {snap.position}, the step starts at {start}")
        return snap.restore(self.cache, table, self.device)

    def _prompt_logprobs(self, logits: torch.Tensor, owners: list, plan: StepPlan, out: list[SeqResult]) -> None:
        for i, c in enumerate(plan.chunks):
            sel = [k for k, (o, t) in enumerate(owners) if o == i and t is not None]
            if not sel:
                continue
            targets = tensor([owners[k][1] for k in sel], logits.device, torch.long)
            out[i].prompt_logprobs = compute_logprobs(logits[sel], targets, c.params.prompt_logprobs or 0)

    def _start_masks(self, plan: StepPlan) -> tuple[list[str], Future] | None:
        """Install the constraints that arrive with this step; start filling the masks of its constrained rows."""
        cs = self.constraints
        for c in plan.chunks:
            if c.constraint is not None:
                if cs is None:
                    raise RuntimeError(f"request {c.request_id}: this worker applies no structured-output constraints")
                cs.install(c.request_id, c.constraint, c.constraint_history or ())
        rids = [c.request_id for c in plan.chunks if c.sample and cs is not None and c.request_id in cs]
        return (rids, cs.fill_async(rids)) if rids else None

    def _constrain(self, masks: tuple[list[str], Future] | None, rids: list[str]) -> Callable | None:
        """The sampler's in-place masking of the constrained rows (their masks are read when it runs)."""
        if masks is None:
            return None
        constrained, future = masks
        at = {rid: i for i, rid in enumerate(rids)}
        rows = [at[rid] for rid in constrained]
        return lambda logits: self.constraints.apply(logits, future.result(), rows)

    def _sample(
        self, logits: torch.Tensor, owners: list, plan: StepPlan, out: list[SeqResult], masks: tuple | None = None
    ) -> None:
        sel = [k for k, (_, t) in enumerate(owners) if t is None]
        if not sel:
            return
        seqs = [owners[k][0] for k in sel]
        params = [plan.chunks[i].params for i in seqs]
        seeds = []
        for i, p in zip(seqs, params):
            seed = p.effective_seed
            pos = plan.chunks[i].start + len(plan.chunks[i].token_ids)  # position of the new token
            seeds.append(None if seed is None or p.greedy else position_seed(seed, pos))
        rids = [plan.chunks[i].request_id for i in seqs]
        s = self.sampler(logits[sel], params, seeds, self._constrain(masks, rids))
        # one device-to-host copy for the step's tokens and logprobs (an element read per row would wait for the
        # device twice a row); both are exact in float64 (token ids < 2^53, logprobs float32)
        ids, lps = torch.stack((s.token_ids.to(torch.float64), s.logprobs.to(torch.float64))).tolist()
        for j, i in enumerate(seqs):
            out[i].token_id = int(ids[j])
            if masks is not None:
                self.constraints.accept(rids[j], out[i].token_id)
            out[i].logprob = lps[j]
            out[i].top_logprobs = s.top_logprobs[j]
