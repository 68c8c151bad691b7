"""The scheduler service: one engine replica over gRPC.

``SchedulerService`` wraps the engine core's :class:`Scheduler` and drives a remote worker through
one ``Worker.Step`` stream (:class:`RemoteWorker`). Callers ``Submit`` tokenized requests and read
their tokens as a stream. A caller that goes away (cancel, deadline) aborts its request at once:
its pages are freed before the next step and the worker drops its state with that step. More
waiting requests than ``max_queued`` → RESOURCE_EXHAUSTED immediately. If the worker fails, every
open stream ends with UNAVAILABLE (the balancer moves those requests elsewhere), health turns NOT_SERVING, and the
worker is dialled again until it is back (a restarted worker included); then the replica serves again. A request the
worker cannot go on with (``SeqResult.error``: its grammar failed) ends with INTERNAL and the worker's reason.

A request with images is prepared by the worker first (``Worker.PrepareImages``: the features stay there); it is
queued with the expanded prompt, and when it ends the worker drops its features with the next step.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from deepinfer import envs
from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.step_loop import StepLoop, Turn
from deepinfer.rpc.channel import Backoff
from deepinfer.rpc.convert import constraint_from_proto, sampling_from_proto
from deepinfer.serving.errors import Overloaded, Precondition, RequestFailed, Unavailable
from deepinfer.serving.metrics import SchedulerMetrics
from deepinfer.serving.server import status_for
from deepinfer.serving.tracing import RequestTrace, extract_metadata
from deepinfer.telemetry import get_logger, request_context
from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.scheduler.delivery import output_lengths, token_events
from services.scheduler.remote_worker import RemoteWorker, WorkerLost

log = get_logger(__name__)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
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
        self.streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent | BaseException]] = {}
        self.wakeup = asyncio.Event()
        self.draining = False
        self.dead: str | None = None  # why the replica cannot serve now (its worker is lost), or None
        self.step_ms = 0.0
        self.on_serving: list[Callable[[bool], Awaitable[None]]] = []  # health follows the worker
        self.on_fatal: list[Callable[[], Awaitable[None]]] = []  # the replica cannot go on: stop the process
        self.loop = StepLoop(scheduler, depth=envs.DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT)  # plan ahead of the worker

    # -- the engine loop -----------------------------------------------------------------------
    async def run(self) -> None:
        """The engine loop, for good: steps while the worker answers; when its stream breaks, every open request
        fails with UNAVAILABLE (the balancer moves it to a replica that serves), health turns NOT_SERVING, and the
        worker is dialled again with backoff until it answers as the same worker (a restarted one included)."""
        backoff = Backoff()
        while True:
            try:
                await self._steps()
            except WorkerLost as e:
                await self._lose_worker(str(e))
                if not await self._reconnect(backoff):
                    return

    async def _steps(self) -> None:
        """The engine loop (``engine.step_loop``, the offline engine's too) over the worker's step stream: while
        the worker runs step N, step N+1 is planned and sent; then step N's result is applied and delivered.
        Raises :class:`WorkerLost` when the step stream breaks."""
        clock = asyncio.get_running_loop().time
        sent: collections.deque[tuple[int, float]] = collections.deque()  # each step in flight: tokens, sent at
        while True:
            t_plan = time.perf_counter()
            turn = self.loop.turn(self.worker.waits_for_tokens)
            if turn is Turn.IDLE and self.worker.has_image_drops:  # an empty step frees the features on the worker
                turn = self.loop.idle_step()
            if turn is Turn.SEND:
                plan = self.loop.plan
                self._attach_trace_context(plan)
                await self.worker.send(plan)
                self.metrics.phase("plan", time.perf_counter() - t_plan)
                sent.append((plan.num_tokens, clock()))
                if self._traces:
                    self._mark_scheduled(plan)
            elif turn is Turn.RECEIVE:
                result = await self.worker.receive()
                t_deliver = time.perf_counter()
                tokens, t0 = sent.popleft()
                elapsed = clock() - t0
                self.step_ms = elapsed * 1e3
                preemptions = self.scheduler.num_preemptions
                self.metrics.step(elapsed, tokens, preemptions - self._preemptions_seen)
                self._preemptions_seen = preemptions
                before = output_lengths(self.scheduler, result)
                self._deliver(result, before, self.loop.received(result))
                self.metrics.phase("deliver", time.perf_counter() - t_deliver)
            elif turn is Turn.WAIT:
                await asyncio.sleep(0.001)  # a kvstore fetch outstanding: idle steps collect it
            else:
                self.wakeup.clear()
                await self._idle()

    async def _idle(self) -> None:
        """Wait for work, or for the idle step stream to break (a worker that died while idle is noticed now)."""
        waits = [asyncio.ensure_future(self.wakeup.wait()), asyncio.ensure_future(self.worker.lost.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.worker.lost.is_set():
            raise WorkerLost(f"worker {self.worker.address}: the step stream ended")

    async def _lose_worker(self, reason: str) -> None:
        self.dead = reason
        self.loop.forget()
        log.error("worker_lost", error=reason)
        self.metrics.worker_lost()
        for rid in self.scheduler.worker_lost():
            self._traces.pop(rid, None)
        for q in self.streams.values():
            q.put_nowait(Unavailable(f"the replica lost its worker ({reason})"))
        await self._serving(False)

    async def _reconnect(self, backoff: Backoff) -> bool:
        """Dial the worker until it answers; False (and the replica stays down) if it is another model now."""
        self.worker.reset()
        want = self.worker_info
        while True:
            try:
                info = await self.worker.info(timeout=max(1.0, backoff.max_s))
                break
            except grpc.aio.AioRpcError as e:
                log.info("worker_reconnecting", error=e.code().name)
                await backoff.wait()
        backoff.reset()
        same = want is None or (info.fingerprint, info.num_pages, info.page_size) == (
            want.fingerprint, want.num_pages, want.page_size)  # fmt: skip
        if not same:
            self.dead = f"worker {self.worker.address} came back with another model or cache geometry"
            log.error("worker_changed", model=info.model, num_pages=info.num_pages)
            for cb in self.on_fatal:
                await cb()
            return False
        self.dead = None
        log.info("worker_reconnected", address=self.worker.address)
        await self._serving(True)
        return True

    async def _serving(self, serving: bool) -> None:
        for cb in self.on_serving:
            await cb(serving)

    def _attach_trace_context(self, plan: WorkerStepPlan) -> None:
        """Give each chunk its request's trace carrier (the wire sends it with the first chunk only)."""
        for c in plan.chunks:
            t = self._traces.get(c.request_id)
            if t is not None:
                c.trace_context = t.carrier

    def _mark_scheduled(self, plan: WorkerStepPlan) -> None:
        now = time.time_ns()
        for c in plan.chunks:
            t = self._traces.get(c.request_id)
            if t is not None and t.scheduled is None:
                t.scheduled = now

    def _deliver(self, result: StepResult, before: dict[str, int], finished: list[Request]) -> None:
        """Hand each request its event: the tokens the scheduler kept (``delivery.token_events``)."""
        events, done = token_events(self.scheduler, result, before, finished, self._traces)
        for rid, ev in events.items():
            q, failed = self.streams.get(rid), done.get(rid)
            if q is not None and failed is not None and failed.finish_reason == "error":  # tokens, then the failure
                log.warning("request_failed", request_id=rid, error=failed.error)
                ev.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
                if ev.token_ids or ev.prompt_logprobs:
                    q.put_nowait(ev)
                q.put_nowait(RequestFailed(failed.error or "the engine failed the request"))
            elif q is not None:
                q.put_nowait(ev)

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
        rid = request.request_id
        try:
            if request.images and rid in self.streams:
                raise ValueError(f"request_id: {rid!r} is already running")
            ids, mm = await self._prepare_images(request)
        except Exception as e:  # noqa: BLE001
            self.metrics.outcome("rejected")
            await context.abort(*status_for(e))
            return
        try:
            self._admit(request, ids, mm)
        except Exception as e:  # noqa: BLE001
            if mm is not None:
                self.worker.drop_images(rid)
                self.wakeup.set()
            self.metrics.outcome("rejected")
            await context.abort(*status_for(e))
            return
        q: asyncio.Queue[scheduler_pb2.TokenEvent | BaseException] = asyncio.Queue()
        self.streams[rid] = q
        trace_ = self._traces[rid] = RequestTrace(extract_metadata(context.invocation_metadata()), time.time_ns())
        self.wakeup.set()
        done, outcome = False, "aborted"
        try:
            while not done:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    if isinstance(ev, RequestFailed):  # finished, with an error: counted, nothing to abort
                        done, outcome = True, "failed"
                        trace_.finished = time.time_ns()
                        self.metrics.outcome(outcome)
                    await context.abort(*status_for(ev))
                    return
                done = ev.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED or ev.HasField("handoff")
                if done:
                    outcome = "aborted" if ev.finish_reason == common_pb2.FINISH_REASON_ABORT else "finished"
                    outcome = "handed_off" if ev.HasField("handoff") else outcome
                    trace_.finished = time.time_ns()
                    self.metrics.outcome(outcome)
                yield ev
        finally:
            self.streams.pop(rid, None)
            self._traces.pop(rid, None)
            if mm is not None:  # the worker drops the request's image features with the next step (an empty one
                self.worker.drop_images(rid)  # when nothing else runs)
                self.wakeup.set()
            trace_.record(rid, len(request.prompt_token_ids), outcome)
            if not done:  # client gone, deadline or server abort: free the pages now
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
            determinism=w.determinism, role=self.role,
        )  # fmt: skip
