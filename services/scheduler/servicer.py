"""The scheduler service: one engine replica over gRPC.

``SchedulerService`` wraps the engine core's :class:`Scheduler` and drives a remote worker through
one ``Worker.Step`` stream (:class:`RemoteWorker`; the loop: ``engine_loop``). Callers ``Submit`` tokenized requests
and read their tokens as a stream, or hold one ``Session`` stream for many requests (the balancer does:
``session``), whose requests behave as their own ``Submit`` calls would. A caller that goes away (cancel,
deadline) aborts its request at once: its pages are freed before the next step and the worker drops its state with
that step. More waiting requests than ``max_queued`` → RESOURCE_EXHAUSTED immediately. If the worker fails, every
open stream ends with UNAVAILABLE (the balancer moves those requests elsewhere), health turns NOT_SERVING, and the
worker is dialled again until it is back (a restarted worker included); then the replica serves again. A request the
worker cannot go on with (``SeqResult.error``: its grammar failed) ends with INTERNAL and the worker's reason.

A request with images is prepared by the worker first (``Worker.PrepareImages``: the features stay there); it is
queued with the expanded prompt, and when it ends the worker drops its features with the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from deepinfer import envs
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.step_loop import StepLoop
from deepinfer.rpc.convert import constraint_from_proto, sampling_from_proto
from deepinfer.serving.errors import Overloaded, Precondition, RequestFailed, Unavailable
from deepinfer.serving.metrics import SchedulerMetrics
from deepinfer.serving.server import status_for
from deepinfer.serving.tracing import Context, RequestTrace, extract_metadata
from deepinfer.telemetry import get_logger, request_context
from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.remote_worker import RemoteWorker
from services.scheduler.session import SchedulerSession, Sink

log = get_logger(__name__)


class SchedulerService(EngineLoop, scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        worker: RemoteWorker,
        vocab_size: int,
        max_queued: int = 1024,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.scheduler, self.worker, self.vocab_size, self.max_queued = scheduler, worker, vocab_size, max_queued
        self.metrics = metrics if metrics is not None else SchedulerMetrics("")
        self.worker_info: worker_pb2.WorkerInfo | None = None  # set once the worker answered GetWorkerInfo
        self.role = "mixed"  # what the balancer routes here: mixed, prefill or decode (docs/routing.md)
        s = scheduler
        self.metrics.bind(
            running=lambda: len(s.running),
            waiting=lambda: len(s.waiting),
            kv_usage=lambda: 1.0 - s.num_available_pages / s.num_total_pages if s.num_total_pages else 0.0,
        )
        self.metrics.bind_scheduler(scheduler)
        self._preemptions_seen = 0
        self._traces: dict[str, RequestTrace] = {}
        self.sessions: set[SchedulerSession] = set()  # the open Session streams
        self.streams: dict[str, Sink] = {}  # each open request's events: its Submit call's queue, or its session
        self.wakeup = asyncio.Event()
        self.draining = False
        self.dead: str | None = None  # why the replica cannot serve now (its worker is lost), or None
        self.step_ms = 0.0
        self.on_serving: list[Callable[[bool], Awaitable[None]]] = []  # health follows the worker
        self.on_fatal: list[Callable[[], Awaitable[None]]] = []  # the replica cannot go on: stop the process
        self.loop = StepLoop(scheduler, depth=envs.DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT)  # plan ahead of the worker

    # -- RPCs ----------------------------------------------------------------------------------
    async def _prepare_images(self, request: scheduler_pb2.SubmitRequest) -> tuple[list[int], MultiModalInput | None]:
        """The prompt ids to queue and, for a request with images, what the worker prepared for them (the features
        stay on the worker; the scheduler plans with the expanded ids, the spans and the digests)."""
        ids = list(request.prompt_token_ids)
        if not request.images:
            return ids, None
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids: ids outside the vocabulary [0, {self.vocab_size})")
        if self.dead is not None or self.draining:
            raise Unavailable("the replica is not serving now")
        try:
            return await self.worker.prepare_images(request.request_id, ids, list(request.images))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the worker's image-feature budget is spent
                raise Overloaded(e.details()) from None
            raise Unavailable(f"the worker could not prepare the images ({e.code().name}: {e.details()})") from None

    def _admit(self, request: scheduler_pb2.SubmitRequest, ids: list[int], mm: MultiModalInput | None) -> None:
        if self.dead is not None or self.draining:
            why = f"the replica lost its worker ({self.dead})" if self.dead else "the scheduler is draining"
            raise Unavailable(why)
        # the balancer checked the request against the model (``engine.request.validate_request``); the ids are checked
        # again because an id past the vocabulary would fault the worker's device, whoever sent it
        params = sampling_from_proto(request.sampling)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {len(bad)} ids outside the vocabulary [0, {self.vocab_size})")
        if not request.request_id:
            raise ValueError("request_id: required")
        if request.request_id in self.streams:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise Overloaded(f"{len(self.scheduler.waiting)} requests are waiting (max_queued={self.max_queued})")
        constraint = constraint_from_proto(request.constraint) if request.HasField("constraint") else None
        if params.so_args and (constraint is None or constraint.grammar is None):
            raise ValueError("constraint: so_args needs the compiled grammar (the balancer compiles it)")
        salt = request.cache_salt if request.HasField("cache_salt") else None
        out = list(request.output_token_ids)
        if any(not 0 <= t < self.vocab_size for t in out):
            raise ValueError(f"output_token_ids: ids outside the vocabulary [0, {self.vocab_size})")
        hints = list(request.resume_hints)  # positions of the prompt as sent: past an image, moved by its span
        hints = hints if mm is None else mm.expand_positions(hints)
        if (request.hand_off or request.resume_position) and self.scheduler.remote is None:
            what = "hand_off" if request.hand_off else "resume_position"
            raise Precondition(f"{what}: this replica has no kvstore (DEEPINFER_KVSTORE_URL) or no prefix cache")
        self.scheduler.add(request.request_id, ids, params, salt, hints, constraint, out, mm=mm,
                           hand_off=request.hand_off, resume_position=request.resume_position)  # fmt: skip

    async def Submit(  # noqa: N802
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        q: asyncio.Queue[scheduler_pb2.TokenEvent | BaseException] = asyncio.Queue()
        try:
            trace_, mm = await self.open(request, extract_metadata(context.invocation_metadata()), q)
        except Exception as e:  # noqa: BLE001
            await context.abort(*status_for(e))
            return
        finished, outcome = False, "aborted"
        try:
            while True:
                ev = await q.get()
                last = self.last(ev, trace_)
                if last is not None:
                    finished, outcome = last
                if isinstance(ev, BaseException):
                    await context.abort(*status_for(ev))
                    return
                yield ev
                if last is not None:
                    return
        finally:
            self.close(request.request_id, len(request.prompt_token_ids), trace_, mm, finished, outcome)

    async def Session(  # noqa: N802
        self, requests: AsyncIterator[scheduler_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SessionEvents]:
        session = SchedulerSession(self)
        if self.draining:  # its submits would be refused: the caller sends them elsewhere
            session.end()
        self.sessions.add(session)
        reader = asyncio.ensure_future(session.read(requests))
        self.metrics.session_stream(+1)
        try:
            async for msg in session.batches():
                yield msg
            if session.refused is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, session.refused)
        finally:
            self.metrics.session_stream(-1)
            self.sessions.discard(session)
            reader.cancel()
            session.close()

    # -- a request's stream, either way (a Submit call, or one request of a Session) --------------
    async def open(
        self, request: scheduler_pb2.SubmitRequest, parent: Context, sink: Sink
    ) -> tuple[RequestTrace, MultiModalInput | None]:
        """Admit ``request``, its events to go to ``sink``; raises what refused it (its status: ``status_for``)."""
        rid = request.request_id
        try:
            if request.images and rid in self.streams:
                raise ValueError(f"request_id: {rid!r} is already running")
            ids, mm = await self._prepare_images(request)
        except Exception:
            self.metrics.outcome("rejected")
            raise
        try:
            self._admit(request, ids, mm)
        except Exception:
            if mm is not None:
                self.worker.drop_images(rid)
                self.wakeup.set()
            self.metrics.outcome("rejected")
            raise
        self.streams[rid] = sink
        trace_ = self._traces[rid] = RequestTrace(parent, time.time_ns())
        self.wakeup.set()
        return trace_, mm

    def last(self, ev: scheduler_pb2.TokenEvent | BaseException, trace_: RequestTrace) -> tuple[bool, str] | None:
        """None while more of the request's stream follows ``ev``; else whether it finished (a finish reason, a
        handoff or a failed request, counted here; an error status otherwise) and its outcome."""
        if isinstance(ev, BaseException):
            if not isinstance(ev, RequestFailed):
                return False, "aborted"
            outcome = "failed"
        elif ev.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not ev.HasField("handoff"):
            return None
        elif ev.HasField("handoff"):
            outcome = "handed_off"
        else:
            outcome = "aborted" if ev.finish_reason == common_pb2.FINISH_REASON_ABORT else "finished"
        trace_.finished = time.time_ns()
        self.metrics.outcome(outcome)
        return True, outcome

    def close(
        self, rid: str, prompt_len: int, trace_: RequestTrace, mm: MultiModalInput | None, finished: bool, outcome: str
    ) -> None:
        """The request's stream is over; one that did not finish (caller gone, deadline, an error status) is aborted
        and its pages freed before the next step."""
        self.streams.pop(rid, None)
        self._traces.pop(rid, None)
        if mm is not None:  # the worker drops the request's image features with the next step (an empty one
            self.worker.drop_images(rid)  # when nothing else runs)
            self.wakeup.set()
        trace_.record(rid, prompt_len, outcome)
        if not finished:
            self.metrics.outcome("aborted")
            with request_context(rid):
                log.info("request_cancelled")
            self.scheduler.abort([rid])
            if rid in self.scheduler.requests and self.scheduler.requests[rid].finished:
                self.scheduler.pop_finished(rid)
            self.wakeup.set()

    async def Abort(  # noqa: N802
        self, request: scheduler_pb2.SchedulerAbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerAbortResponse:
        aborted = [r for r in request.request_ids if r in self.scheduler.requests]
        self.scheduler.abort(aborted)
        for rid in aborted:
            self.scheduler.pop_finished(rid)
            q = self.streams.get(rid)
            if q is not None:
                q.put_nowait(scheduler_pb2.TokenEvent(request_id=rid, finish_reason=common_pb2.FINISH_REASON_ABORT))
        self.wakeup.set()
        return scheduler_pb2.SchedulerAbortResponse(aborted=aborted)

    async def Drain(  # noqa: N802
        self, request: scheduler_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DrainResponse:
        await self.drain(request.grace_period_s or 30.0)
        return scheduler_pb2.DrainResponse(remaining_requests=len(self.streams))

    async def HandOff(  # noqa: N802
        self, request: scheduler_pb2.HandOffRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HandOffResponse:
        if self.scheduler.remote is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "request_ids: this replica has no kvstore "
                                "(DEEPINFER_KVSTORE_URL) to hand state off through")  # fmt: skip
        ids = self.scheduler.hand_off([r for r in request.request_ids if r in self.streams])
        self.wakeup.set()
        return scheduler_pb2.HandOffResponse(request_ids=ids)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let running requests finish for up to ``grace_s``, minus its last seconds (at most 5, at
        most half), in which the rest hand off: each ends its stream with a handoff, its state exported to the
        kvstore where there is one, and the balancer continues it on another replica from there (else recomputed:
        ``engine.handoff``). Whatever is left when ``grace_s`` is over is aborted."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        move_at, moved = deadline - min(5.0, grace_s / 2), False
        while self.scheduler.has_unfinished() and loop.time() < deadline and self.dead is None:
            if not moved and loop.time() >= move_at:
                moved = True
                self.scheduler.hand_off_all()
                self.wakeup.set()
            await asyncio.sleep(0.05)
        self.scheduler.abort(list(self.scheduler.requests))
        for rid, q in list(self.streams.items()):
            q.put_nowait(scheduler_pb2.TokenEvent(request_id=rid, finish_reason=common_pb2.FINISH_REASON_ABORT))
        for session in list(self.sessions):  # each ends once it sent those: the server stops with no stream open
            session.end()

    def load_report(self) -> dict:
        """This replica's load as published on the event bus."""
        s = self.scheduler
        return {
            "waiting_requests": len(s.waiting),
            "running_requests": len(s.running),
            "queued_prefill_tokens": sum(r.num_tokens - r.num_computed for r in s.waiting),
            "free_kv_pages": s.num_available_pages,  # pages only the prefix cache holds count as free
            "total_kv_pages": s.num_total_pages,
            "step_time_ms": self.step_ms,
            "draining": self.draining or self.dead is not None,  # not taking requests, either way
            "max_queued": self.max_queued,  # admission limits: the balancer refuses beyond their sum at once
            "max_running": self.scheduler.config.max_num_seqs,
        }

    async def GetLoad(  # noqa: N802
        self, request: scheduler_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReplicaLoad:
        return common_pb2.ReplicaLoad(**self.load_report())

    async def GetReplicaInfo(  # noqa: N802
        self, request: scheduler_pb2.GetReplicaInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReplicaInfo:
        w = self.worker_info
        if w is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's worker has not reported yet")
        return scheduler_pb2.ReplicaInfo(
            model=w.model, accelerator=w.accelerator, dtype=w.dtype, world_size=w.world_size,
            determinism=w.determinism, role=self.role, sessions=True,
        )  # fmt: skip
