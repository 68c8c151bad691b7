"""The contract between the scheduler and the workers: what one step asks and what it returns.

The scheduler owns admission, batching, page allocation and stop conditions; a worker owns the
model, the KV data (pages and per-sequence state) and sampling. Both sides exchange only these
plain dataclasses, so the gRPC services can carry them as protobuf messages unchanged in meaning.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.sampling_params import SamplingParams

PLACEHOLDER = -1  # a chunk token: "the token this request sampled in its step before", resolved on the worker


@dataclass
class ChunkPlan:
    """Run ``token_ids`` of request ``request_id`` at positions ``start ..``; sample after the last one
    when ``sample`` is set. ``block_table`` lists the physical pages of the whole sequence so far.
    ``logprob_targets`` (prompt logprobs only) are the token ids each row is scored against. ``decoder_from``
    (DeepSeek-V4.1's bounded decoder replay): the first position of the chunk that runs the decoder layers — rows
    before it get no output, and it may lie past the chunk (no decoder rows at all); None: every row (exact). V4
    models ignore it."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    logprob_targets: list[int] | None = None
    trace_context: dict[str, str] | None = None  # W3C carrier of the request's trace (services only)
    resume_from: str | None = None  # start from this snapshot (a prefix-cache hit at ``start``)
    # structured output: the constraint (with a request's first chunk, again after a preemption) and the
    # tokens it already generated, which the worker's matcher accepts first
    constraint: Constraint | None = None
    constraint_history: list[int] | None = None
    decoder_from: int | None = None
    # the request's images (engine.multimodal), on a chunk that covers one of their spans (in process only so far)
    mm: MultiModalInput | None = None
    # speculative decoding: draft up to this many tokens after the chunk's one token (a decode row) and verify them
    # in this step; the worker's drafter proposes them, and may propose fewer (the pages cover all)
    num_drafts: int = 0


@dataclass
class SnapshotOrder:
    """Take snapshot ``snapshot_id`` of request ``request_id``'s state as it stands (at ``position``)."""

    request_id: str
    snapshot_id: str
    position: int


@dataclass
class OffloadOrder:
    """Write snapshot ``snapshot_id`` and the full ``pages`` to the kvstore as blob ``key``; then drop it. ``export``
    (a prefill replica's handoff): keep it, and report the put's completion in ``StepResult.exported``."""

    snapshot_id: str
    key: bytes
    pages: list[int]
    meta: dict[str, str]
    export: bool = False


@dataclass
class FetchOrder:
    """Fetch blob ``key`` from the kvstore and hold it as ``fetch_id`` (reported in ``StepResult.fetched``)."""

    fetch_id: str
    key: bytes


@dataclass
class FetchResult:
    fetch_id: str
    ok: bool
    reason: str = ""  # why not: "not_found", "data_loss", "unavailable", ...


@dataclass
class ExportResult:
    """An export's put completed (``ok``) or failed (``reason``)."""

    snapshot_id: str
    ok: bool
    reason: str = ""


@dataclass
class WorkerStepPlan:
    """What the scheduler asks a worker to do in one step (``Scheduler.schedule``; on the wire ``worker_pb2.StepPlan``):
    the chunks to run, then what to release, snapshot, offload and fetch."""

    step_id: int
    chunks: list[ChunkPlan] = field(default_factory=list)
    # requests whose worker-side state must be dropped before this step runs
    released: list[str] = field(default_factory=list)
    # before anything else: snapshots to take (prefix-cache resume points), then snapshots to drop
    snapshots: list[SnapshotOrder] = field(default_factory=list)
    dropped_snapshots: list[str] = field(default_factory=list)
    # resume points to move to the kvstore (pages read before this step's chunks), and to fetch from it
    offloads: list[OffloadOrder] = field(default_factory=list)
    fetches: list[FetchOrder] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class RankedPlan(WorkerStepPlan):
    """A step of a worker of several ranks (attention data parallel: ``engine.data_parallel``): ``ranks[r]`` is rank
    ``r``'s plan, each with its own page ids; the inherited lists are their union (for what looks at a step as a
    whole: is there anything to send?). On the wire: ``StepPlan.ranks``."""

    ranks: list[WorkerStepPlan] = field(default_factory=list)

    @classmethod
    def of(cls, plans: list[WorkerStepPlan]) -> RankedPlan:
        ids = {p.step_id for p in plans}
        if len(ids) != 1:
            raise RuntimeError(f"the ranks planned different steps: {sorted(ids)}")
        out = cls(step_id=plans[0].step_id, ranks=plans)
        for p in plans:
            out.chunks += p.chunks
            out.released += p.released
            out.snapshots += p.snapshots
            out.dropped_snapshots += p.dropped_snapshots
            out.offloads += p.offloads
            out.fetches += p.fetches
        return out


@dataclass
class SeqResult:
    request_id: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    # the worker cannot go on with this request (its structured-output grammar failed: ``constraints.failure``):
    # it ends with finish reason "error" and this message; its token, if any, is not part of the output
    error: str | None = None
    # speculative decoding: the drafts kept after ``token_id`` (each the target's own sample, as ``token_id``) and
    # their logprobs; ``num_drafts``: the drafts this step verified (kept: ``len(extra_token_ids)``)
    extra_token_ids: list[int] = field(default_factory=list)
    extra_logprobs: list[float] = field(default_factory=list)
    extra_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    num_drafts: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Every token this step emitted for the request, in order."""
        return [] if self.token_id is None else [self.token_id, *self.extra_token_ids]


@dataclass
class StepResult:
    step_id: int
    results: list[SeqResult] = field(default_factory=list)
    fetched: list[FetchResult] = field(default_factory=list)  # kvstore fetches completed since the last step
    exported: list[ExportResult] = field(default_factory=list)  # exports (``OffloadOrder.export``) put since then
    # graph buckets the worker captured since its last result (this step's launch or a later one's, queued while
    # this step ran): the interval up to this result holds one-time work, not a step's cost (``SpecPolicy``)
    graph_captures: int = 0


class StateTransport(Protocol):
    """How a worker moves resume points' bytes off the device tier and back (``ModelRunner.remote``): offloads, the
    exports of handoffs (prefill/decode disaggregation, drain) and fetches. The implementation today is the kvstore
    over gRPC (``kvstore.remote.RemoteResumeStore``: blobs streamed in 1 MiB chunks with CRC-32 checks, stored in
    host memory and on disk, so a fetch works after the writer is gone). A direct path (RDMA through NIXL or
    NVSHMEM, reading the writer's pinned host buffers or device pages in place) implements the same calls; the
    scheduler's orders and the step contract stay as they are (docs/routing.md, "The transfer")."""

    def put(self, key: bytes, data: bytes, meta: dict[str, str], export_id: str | None = None) -> object:
        """Store ``data`` as ``key`` in the background; an ``export_id``'s completion is reported by ``exported``."""

    def fetch(self, fetch_id: str, key: bytes) -> object:
        """Start fetching ``key``; its decoded resume point (or the reason it failed) comes from ``completed``."""

    def completed(self) -> list:
        """Fetches finished since the last call (``kvstore.remote.Fetched``: id, payload or None, reason)."""

    def exported(self) -> list[tuple[str, bool, str]]:
        """Exports put or failed since the last call: ``(export id, ok, reason)``."""

    def wait(self, timeout_s: float) -> None:
        """Block until a transfer completes or ``timeout_s`` passes (an idle step waiting for one)."""

    def wait_exported(self, export_ids: list[str], timeout_s: float) -> bool:
        """Block until these exports are put or failed, or ``timeout_s`` passes; whether they all were."""

    def close(self) -> None: ...


class Runner(Protocol):
    """What the engine loop (``engine.step_loop``) drives: it sends steps and receives their results in order.
    In process ``engine.worker.ModelRunner`` (plain calls); in the mesh the scheduler service's ``RemoteWorker``
    (the same methods, awaited, over the ``deepinfer.v1.Worker`` ``Step`` stream)."""

    def send(self, plan: WorkerStepPlan) -> None: ...

    def receive(self) -> StepResult: ...

    def waits_for_tokens(self, plan: WorkerStepPlan) -> bool: ...


class ImmediateRunner:
    """A :class:`Runner` that computes each step when it is sent (:meth:`execute`); :meth:`receive` returns the
    results in order."""

    def execute(self, plan: WorkerStepPlan) -> StepResult:
        raise NotImplementedError

    def send(self, plan: WorkerStepPlan) -> None:
        if not hasattr(self, "_results"):
            self._results: collections.deque[StepResult] = collections.deque()
        self._results.append(self.execute(plan))

    def receive(self) -> StepResult:
        return self._results.popleft()

    def waits_for_tokens(self, plan: WorkerStepPlan) -> bool:
        return False
