"""The scheduler service's engine loop (``SchedulerService`` runs it): the engine core's step loop over the worker's
``Worker.Step`` stream, delivering each step's tokens to the requests' streams; when the worker is lost, every open
request fails with UNAVAILABLE and the worker is dialled again until it is back."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

import grpc

from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.step_loop import StepLoop, Turn
from deepinfer.rpc.channel import Backoff
from deepinfer.serving.errors import RequestFailed, Unavailable
from deepinfer.serving.metrics import SchedulerMetrics
from deepinfer.serving.tracing import RequestTrace
from deepinfer.telemetry import get_logger
from deepinfer.v1 import common_pb2, worker_pb2
from services.scheduler.delivery import output_lengths, token_events
from services.scheduler.remote_worker import RemoteWorker, WorkerLost
from services.scheduler.session import Sink

log = get_logger(__name__)


class EngineLoop:
    """The engine loop of ``SchedulerService`` (whose constructor sets these)."""

    scheduler: Scheduler
    worker: RemoteWorker
    worker_info: worker_pb2.WorkerInfo | None
    metrics: SchedulerMetrics
    loop: StepLoop
    streams: dict[str, Sink]
    wakeup: asyncio.Event
    dead: str | None
    step_ms: float
    _traces: dict[str, RequestTrace]
    _preemptions_seen: int
    on_serving: list[Callable[[bool], Awaitable[None]]]
    on_fatal: list[Callable[[], Awaitable[None]]]

    async def run(self) -> None:
        """The engine loop, for good: steps while the worker answers; when its stream breaks, every open request
        fails with UNAVAILABLE (the balancer moves it to a replica that serves), health turns NOT_SERVING, and the
        worker is dialled again with backoff until it answers as the same worker (a restarted one included). Any other
        failure of the loop (a worker answering out of protocol, a fault of the loop's own) fails the open requests
        the same way, then ends the process (``on_fatal``), for its supervisor to start a fresh one: a replica whose
        loop is gone must not stay registered and serving."""
        backoff = Backoff()
        while True:
            try:
                await self._steps()
            except WorkerLost as e:
                await self._lose_worker(str(e))
                if not await self._reconnect(backoff):
                    return
            except Exception as e:  # noqa: BLE001 - whatever it was, the loop cannot go on
                log.exception("engine_loop_failed", error=repr(e))
                await self._lose_worker(f"the engine loop failed: {e!r}")
                for cb in self.on_fatal:
                    await cb()
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
        for q in list(self.streams.values()):  # (a session's request closes as it is told)
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
