"""The worker runtime: runs a :class:`WorkerStepPlan` through the model, samples, computes logprobs.

It owns the device-side state: the paged cache and each running request's short-term state.
Seeded requests draw their sampling noise from a generator keyed by (seed, position) — a counter
scheme, so a token depends only on the seed, its position and its logits, never on batch-mates,
on earlier draws, or on a preemption in between.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.engine import pending_tokens
from deepinfer.engine.constraints import ConstraintSet
from deepinfer.engine.interfaces import (
    PLACEHOLDER,
    ExportResult,
    FetchResult,
    SeqResult,
    StateTransport,
    StepResult,
    WorkerStepPlan,
)
from deepinfer.engine.model_api import ModelFamily, PagedCache, SequenceState, ServedModel, Snapshot
from deepinfer.engine.sampler import Sampler, SamplerOutput, compute_logprobs
from deepinfer.engine.speculative.grammar import row_masks
from deepinfer.engine.speculative.steps import Speculator, propose, settle, spec_forward
from deepinfer.runtime.decode_graphs import captures_so_far
from deepinfer.runtime.host_copy import HostCopies, tensor, to_host
from deepinfer.runtime.platform import Event

_MASK64 = (1 << 64) - 1
# the longest a step that only exports handoffs' states waits for their puts, so that their requests are reported
# handed off with it (engine.handoff); a put still running then is reported with a later step
EXPORT_WAIT_S = 0.1


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
    def __init__(
        self, model: ServedModel, cache: PagedCache, device: torch.device | str = "cpu", *, family: ModelFamily
    ) -> None:
        # the model and the family that made it and ``cache`` (states, resume points, batches: ``model_api``)
        self.model, self.cache, self.device, self.family = model, cache, torch.device(device), family
        self.sampler = Sampler()  # (the factory's: Sampler(invariant=) with the batch-invariant ops)
        self.states: dict[str, SequenceState] = {}
        self.tables: dict[str, torch.Tensor] = {}  # each running request's last block table
        self.snapshots: dict[str, Snapshot] = {}  # prefix-cache resume points, in host memory
        self.remote: StateTransport | None = None  # the kvstore (``kvstore.remote.RemoteResumeStore``), if any
        self.fetched: dict[str, tuple[Snapshot, dict]] = {}  # resume points fetched from the kvstore
        self._lost_exports: list[ExportResult] = []  # exports that could not start (reported with the next result)
        self.compact_replay = 0  # > 0: compact snapshots, resumed by a bounded replay of this many tokens
        self.constraints: ConstraintSet | None = None  # structured-output matchers (set by the factory)
        # each request's last sampled token: its value, or (the device samples of a step in flight, row)
        self.sampled: dict[str, int | tuple[torch.Tensor, int]] = {}
        self.pending = pending_tokens.PendingTokens()  # constrained requests' tokens not accepted yet
        self.launched: collections.deque[InFlight] = collections.deque()  # sent, not received (``send``)
        # speculative decoding (``family.speculator``, ``engine.speculative.steps``): None: off
        self.spec: Speculator | None = None
        self._captures = captures_so_far()  # the process's graph captures at the last result returned
        self.forwards = 0  # steps that ran the model's trunk (a rank group keeps its ranks in step by them)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
            self.tables.pop(rid, None)
            self.sampled.pop(rid, None)
        self.pending.forget(request_ids)
        if self.spec is not None:
            self.spec.release(request_ids)
        if self.constraints is not None:
            self.constraints.release(request_ids)

    def _snapshots(self, plan: WorkerStepPlan) -> list[str]:
        """Take the ordered snapshots, start the offloads and fetches; the ids of the exports put."""
        exports = []
        for order in plan.snapshots:
            st = self.states.get(order.request_id)
            if st is None or st.num_tokens != order.position:
                held = None if st is None else st.num_tokens
                raise RuntimeError(f"snapshot {order.snapshot_id}: request {order.request_id} holds {held} tokens, "
                                   f"not {order.position}")  # fmt: skip
            self.snapshots[order.snapshot_id] = self.family.take_snapshot(
                st, self.cache, self.tables[order.request_id], self.compact_replay > 0
            )
        for o in plan.offloads:  # read the pages now (queued before this step's chunks, which may reuse them)
            snap = self.snapshots.get(o.snapshot_id) if o.export else self.snapshots.pop(o.snapshot_id, None)
            if snap is not None and self.remote is not None:
                export_id = o.snapshot_id if o.export else None
                self.remote.put(o.key, self._encoder(snap, o.pages), o.meta, export_id)
                if o.export:
                    exports.append(o.snapshot_id)
            elif o.export:  # nothing to export (no kvstore here, or the snapshot is gone): the handoff recomputes
                why = "no_snapshot" if self.remote is not None else "no_kvstore"
                self._lost_exports.append(ExportResult(o.snapshot_id, False, why))
        for f in plan.fetches:
            if self.remote is None:
                raise RuntimeError(f"fetch {f.fetch_id}: this worker has no kvstore")
            self.remote.fetch(f.fetch_id, f.key)
        return exports

    def _encoder(self, snap: Snapshot, page_ids: list[int]) -> Callable[[], bytes]:
        """The resume point's bytes, made later: its pages' copies to the host are queued now (no wait for the
        device), the encoding runs off the step's thread once they are complete (``RemoteResumeStore.put``)."""
        copy = HostCopies(self.device)
        pages = {key: copy(t) for key, t in self.cache.read_pages(tensor(page_ids, self.device, torch.long)).items()}
        ready, family = copy.done(), self.family

        def encode() -> bytes:
            if ready is not None:
                ready.synchronize()
            return family.encode_resume(snap, pages)

        return encode

    def execute(self, plan: WorkerStepPlan) -> StepResult:
        """Run a step and wait for its result: ``finish(launch(plan))``."""
        return self.finish(self.launch(plan))

    def send(self, plan: WorkerStepPlan) -> None:
        """The engine loop's runner contract (``interfaces.Runner``): ``launch``, results in order by ``receive``."""
        self.launched.append(self.launch(plan))

    def receive(self) -> StepResult:
        return self.finish(self.launched.popleft())

    @torch.no_grad()
    def launch(self, plan: WorkerStepPlan) -> InFlight:
        """Queue a step's device work; ``finish`` returns its result. Take the ordered snapshots, drop released
        states, run the chunks (resuming from snapshots where asked), then drop the snapshots the scheduler evicted
        (a chunk of this step may still start from one). A chunk token ``PLACEHOLDER`` is the token its request
        sampled last, taken on the device when that step is still in flight, so step N+1 can be queued before step
        N's tokens reach the host (steps launched in order, finished in order)."""
        exports = self._snapshots(plan)
        self.release(plan.released)
        try:
            step = self._run(plan)
            step.idle = not plan.chunks and not plan.fetches
            if step.idle and exports:  # a handoff's export step: its result waits for the puts (``InFlight.wait``)
                remote = self.remote
                step.puts = lambda: remote.wait_exported(exports, EXPORT_WAIT_S)
            return step
        finally:
            for sid in plan.dropped_snapshots:
                self.snapshots.pop(sid, None)
                self.fetched.pop(sid, None)

    def waits_for_tokens(self, plan: WorkerStepPlan) -> bool:
        """Whether ``plan`` must not be launched before the steps in flight are finished: a structured-output
        request's next mask needs its last token accepted on the host first, and only a plain decode row can have it
        accepted when its sampler asks for the mask (``engine.pending_tokens``)."""
        return pending_tokens.waits_for_tokens(self, plan)

    def finish(self, step: InFlight) -> StepResult:
        """Wait for a launched step's tokens (one host copy, queued at its launch) and return its result."""
        result = step.result
        if step.sample is not None:
            self._collect(step)
        if self.constraints is not None and self.constraints.matchers:  # (no constrained request: nothing to ask)
            for r in result.results:  # a request whose grammar failed ends with the reason (never a silent stop)
                r.error = self.constraints.failure(r.request_id)
        if self.remote is not None:
            if step.puts is not None:  # a handoff's export step: reported once put
                step.wait()
            elif step.idle:
                self.remote.wait(0.005)  # an idle step waiting for fetches: do not spin
            for f in self.remote.completed():
                if f.payload is not None:
                    self.fetched[f.fetch_id] = f.payload
                result.fetched.append(FetchResult(f.fetch_id, f.payload is not None, f.reason))
            result.exported += [ExportResult(*e) for e in self.remote.exported()]
        result.exported += self._lost_exports
        self._lost_exports = []
        now = captures_so_far()
        result.graph_captures, self._captures = now - self._captures, now
        return result

    def _run(self, plan: WorkerStepPlan) -> InFlight:
        result = StepResult(step_id=plan.step_id)
        if not plan.chunks:
            return InFlight(result)
        token_ids, at, sources = self._resolve(plan)
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
            st = self.states.get(c.request_id)
            if st is None:
                st = self.states[c.request_id] = self.family.new_state()
            if st.num_tokens != c.start:
                raise RuntimeError(f"request {c.request_id}: step starts at {c.start}, state holds {st.num_tokens}")
            if c.decoder_from is not None and (c.logprob_targets is not None or c.sample):
                scored = [j for j, t in enumerate(c.logprob_targets or []) if t >= 0]
                first = c.start + (scored[0] if scored else len(c.token_ids) - 1)
                if first < c.decoder_from:  # a bounded decoder replay gives those rows no output
                    raise RuntimeError(f"request {c.request_id}: logits asked at {first}, the decoder starts at "
                                       f"{c.decoder_from}")  # fmt: skip
            self.tables[c.request_id] = table
            chunks.append((st, c.start, len(c.token_ids), table, c.decoder_from))
        drafts, pre = propose(self.spec, plan, chunks, token_ids, self.constraints) if self.spec else (None, {})
        masks = pending_tokens.start_masks(self, plan, pre)  # filled on the CPU while the device runs the forward
        mm = [c.mm for c in plan.chunks]  # images: only chunks that cover part of a span carry them
        batch = self.family.batch(chunks, token_ids, self.device, *([mm] if any(m is not None for m in mm) else []))
        batch.substitute(at, sources)
        self.forwards += 1
        if drafts is None:
            hidden, pending = self.model(batch, self.cache), None
        else:
            hidden, pending = spec_forward(self.spec, batch, self.cache, plan, drafts)
        # rows whose logits we need: prompt-logprob rows, then the sampling rows (a verify chunk: all its rows)
        rows, owners = [], []
        for i, ((a, b), c) in enumerate(zip(batch.offsets(), plan.chunks)):
            if c.logprob_targets is not None:
                for j, t in enumerate(c.logprob_targets):
                    if t >= 0:
                        rows.append(a + j)
                        owners.append((i, t))
            if c.sample:
                first = b - 1 - (len(drafts[i]) if drafts is not None else 0)
                rows.extend(range(first, b))
                owners.extend((i, None) for _ in range(first, b))
        result.results = [SeqResult(c.request_id) for c in plan.chunks]
        step = InFlight(result)
        if rows:
            every = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))  # e.g. a decode step
            logits = self.model.logits(hidden if every else hidden[tensor(rows, self.device, torch.long)])
            self._prompt_logprobs(logits, owners, plan, result.results)
            self._sample(logits, owners, plan, step, masks)
        if drafts is not None:  # verify rows settle now (their tokens on the host); the drafter follows the step
            settle(self, step, plan, drafts, pending, hidden, batch)
        return step

    def _resolve(self, plan: WorkerStepPlan) -> tuple[list[list[int]], list[int], list[tuple[torch.Tensor, int]]]:
        """The chunks' token lists with each ``PLACEHOLDER`` resolved: to the request's last token where the host
        has it, else to 0 with (batch row, the in-flight samples and row) listed for the batch's ``substitute``."""
        token_ids, at, sources, offset = [], [], [], 0
        for c in plan.chunks:
            toks = c.token_ids
            if PLACEHOLDER in toks:
                last = self.sampled.get(c.request_id)
                if last is None:
                    raise ValueError(f"chunks.token_ids: request {c.request_id!r} has no sampled token yet")
                if isinstance(last, int):
                    toks = [last if t == PLACEHOLDER else t for t in toks]
                else:
                    where = [j for j, t in enumerate(toks) if t == PLACEHOLDER]
                    toks = [0 if t == PLACEHOLDER else t for t in toks]
                    at.extend(offset + j for j in where)
                    sources.extend([last] * len(where))
            token_ids.append(toks)
            offset += len(toks)
        return token_ids, at, sources

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

    def _prompt_logprobs(self, logits: torch.Tensor, owners: list, plan: WorkerStepPlan, out: list[SeqResult]) -> None:
        scored: dict[int, list[int]] = {}  # chunk -> its prompt-logprob rows (one pass: a step's cost, not B x rows)
        for k, (o, t) in enumerate(owners):
            if t is not None:
                scored.setdefault(o, []).append(k)
        for i, sel in scored.items():
            targets = tensor([owners[k][1] for k in sel], logits.device, torch.long)
            out[i].prompt_logprobs = compute_logprobs(logits[sel], targets, plan.chunks[i].params.prompt_logprobs or 0)

    def _constrain(self, masks: tuple | None, rids: list[str]) -> Callable | None:
        """The sampler's in-place masking of the constrained rows among the sampled rows ``rids`` (a verify chunk's
        request once per row; the masks are read when it runs)."""
        return None if masks is None else row_masks(self.constraints, masks, rids)

    def _sample(
        self, logits: torch.Tensor, owners: list, plan: WorkerStepPlan, step: InFlight, masks: tuple | None = None
    ) -> None:
        sel = [k for k, (_, t) in enumerate(owners) if t is None]
        if not sel:
            return
        seqs = [owners[k][0] for k in sel]
        params = [plan.chunks[i].params for i in seqs]
        seeds, prev, k = [], -1, 0
        for i, p in zip(seqs, params):
            seed = p.effective_seed
            k, prev = (k + 1 if i == prev else 0), i  # a verify chunk's rows (its token, its drafts) come in a row
            pos = plan.chunks[i].start + len(plan.chunks[i].token_ids) + k  # the position of the new token
            seeds.append(None if seed is None or p.greedy else position_seed(seed, pos))
        rids = [plan.chunks[i].request_id for i in seqs]
        # (``logits[list]`` would copy the list to the device synchronously: the host would wait for the forward)
        rows = logits if len(sel) == len(owners) else logits.index_select(0, tensor(sel, logits.device, torch.long))
        s = self.sampler(rows, params, seeds, self._constrain(masks, rids))
        for j, rid in enumerate(rids):
            self.sampled[rid] = (s.token_ids, j)  # a later step's placeholder reads it on the device
        step.sample, step.seqs, step.rids, step.constrained = s, seqs, rids, masks is not None
        if step.constrained and self.spec is None:  # (a verify step's tokens are accepted when it settles)
            self.pending.sampled(step, rids, self.constraints)
        # one device-to-host copy for the step's tokens, logprobs and top logprobs, queued now and waited for in
        # ``finish`` (an element read per row would wait for the device twice a row); all exact in float64
        parts = [s.token_ids.to(torch.float64), s.logprobs.to(torch.float64)]
        if s.top is not None:
            parts += [s.top[2].flatten().to(torch.float64), s.top[3].flatten().to(torch.float64)]
        step.host, step.event = to_host(torch.cat(parts))

    def _collect(self, step: InFlight) -> None:
        out = step.result.results
        ids, lps, top = step.host_rows()
        for j, (i, rid) in enumerate(zip(step.seqs, step.rids)):
            token = int(ids[j])
            last = self.sampled.get(rid)
            if isinstance(last, tuple) and last[0] is step.sample.token_ids:  # no later step sampled for it yet
                self.sampled[rid] = token
            out[i].token_id = token
            if step.constrained and self.pending.collected(step, rid):  # (not accepted early)
                self.constraints.accept(rid, token)
            out[i].logprob = lps[j]
            out[i].top_logprobs = top[j]


@dataclass
class InFlight:
    """A launched step: its result (prompt logprobs filled), and its samples still on the device with the queued
    copy of them to the host (``host``, complete once ``event`` has; None on a CPU device)."""

    result: StepResult
    sample: SamplerOutput | None = None
    seqs: list[int] = field(default_factory=list)  # the chunk of each sampled row
    rids: list[str] = field(default_factory=list)
    constrained: bool = False
    early: set[str] = field(default_factory=set)  # requests whose token was accepted before collection
    idle: bool = False  # no chunks and no fetches
    host: torch.Tensor | None = None
    event: Event | None = None  # the platform's (deepinfer.runtime.platform)
    # a handoff's export step (engine.handoff): waits for its puts, up to ``EXPORT_WAIT_S``, where a step waits for
    # the device (``wait``: the worker's pipeline calls it without the device lock, so launches go on meanwhile)
    puts: Callable[[], object] | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        if self.puts is not None:
            self.puts()
            self.puts = None

    def host_rows(self) -> tuple[list[float], list[float], list[list[tuple[int, float]] | None]]:
        """The sampled rows on the host (waits for the copy): token ids, logprobs, top logprobs (None: not asked)."""
        s = self.sample
        self.wait()
        flat, b = self.host.tolist(), len(self.rids)
        ids, lps = flat[:b], flat[b : 2 * b]
        top: list = [None] * b
        if s.top is not None:
            r, k = s.top[2].shape
            rows = [flat[2 * b + i * k : 2 * b + (i + 1) * k] for i in range(2 * r)]  # r rows of values, r of ids
            top = s.top_lists(rows[:r], rows[r:])
        return ids, lps, top
