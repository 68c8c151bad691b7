"""One ``Worker.Step`` stream's steps on the runner: a launcher thread and a finisher thread.

The event loop only moves messages: it converts each arriving plan and hands it to the launcher (:meth:`submit`),
and sends each result the finisher hands back (:meth:`results`). The launcher launches a plan on the device as soon
as it arrives (up to ``max_in_flight`` steps whose results are not collected), so the next step is queued on the
device while the previous one runs (on the host, whose launch runs the step, one: a step is collected before the
next launch takes the runner, or a long next step, a prefill, would hold back tokens the step already has); the
finisher waits for the oldest step's tokens (no lock held while it waits),
collects them and converts the result. A step thus crosses two thread hand-offs (plan in, result out) instead of a
hop to a pool thread and back for each of its launch, wait and collection, and neither thread waits for the event
loop to be scheduled before touching the device.

Both threads take ``device_lock`` around the runner (the service's other users of the runner take it too), so a
launch and a collection never interleave. A structured-output plan whose rows need the previous step's tokens on
the host (``Runner.waits_for_tokens``) is launched once the steps before it are collected.

Phase timings (``WorkerMetrics.phase``): ``launch`` (the host's time to launch a step), ``finish`` (to collect it
and build its result message, after its tokens are on the host), ``starved`` (the time with no step on the device
and no plan to launch: the pipeline ran dry, waiting for the scheduler; a second or more counts as ``idle``).
``profiler``: the worker's ``serving.step_profiler.StepProfiler`` (``DEEPINFER_TORCH_PROFILER_DIR``), told of each
launch in the launcher thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.interfaces import WorkerStepPlan
from deepinfer.engine.worker import InFlight
from deepinfer.rpc.convert import result_to_proto
from deepinfer.runtime.platform import platform_of
from deepinfer.serving.metrics import WorkerMetrics
from deepinfer.serving.step_profiler import StepProfiler
from deepinfer.serving.tracing import StepSpans, StepTraces
from deepinfer.v1 import worker_pb2

_END = None  # the stream ended: no more plans
IDLE_S = 1.0  # a pipeline dry this long was idle (no work), not starved by a slow scheduler


@dataclass
class _Launched:
    step: InFlight
    num_tokens: int
    spans: StepSpans
    t0: float


class StepPipeline:
    def __init__(
        self, runner: Any, device_lock: threading.Lock, metrics: WorkerMetrics, traces: StepTraces,
        max_in_flight: int = 3, profiler: StepProfiler | None = None,
    ) -> None:  # fmt: skip
        self.runner, self.device_lock, self.metrics, self.traces = runner, device_lock, metrics, traces
        self.profiler = profiler if profiler is not None else StepProfiler(None, 0, 0, "")
        self.max_in_flight = max_in_flight if platform_of(runner.device).queues_steps else 1
        self._loop = asyncio.get_running_loop()
        self._plans: queue.SimpleQueue[WorkerStepPlan | BaseException | None] = queue.SimpleQueue()
        self._launched: queue.SimpleQueue[_Launched | BaseException | None] = queue.SimpleQueue()
        self._out: asyncio.Queue[worker_pb2.StepResult | BaseException | None] = asyncio.Queue()
        self._room = threading.Condition()
        self._in_flight = 0  # launched, not collected
        self._dry_since: float | None = time.perf_counter()  # no step on the device since then (None: one is)
        self._threads = [
            threading.Thread(target=self._launcher, name="step-launch", daemon=True),
            threading.Thread(target=self._finisher, name="step-finish", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- the event loop's side --------------------------------------------------------------------
    def submit(self, plan: WorkerStepPlan | BaseException | None) -> None:
        """A plan to launch after those before it; an exception: the stream broke (reported after the steps
        launched before it); None: the stream ended."""
        self._plans.put(plan)

    async def results(self) -> AsyncIterator[worker_pb2.StepResult]:
        """The steps' results in order, until the stream ends; raises the error that ended it, if one did."""
        while True:
            item = await self._out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        """Stop taking plans and wait until the steps launched are collected (the runner is then free)."""
        self._plans.put(_END)
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for t in self._threads:
            t.join()

    # -- the threads --------------------------------------------------------------------------------
    def _post(self, item: worker_pb2.StepResult | BaseException | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody reads the results any more
            pass

    def _launcher(self) -> None:
        while True:
            plan = self._plans.get()
            if plan is _END or isinstance(plan, BaseException):
                self.profiler.stop()  # (a record this stream began: what it has, from the thread that began it)
                self._launched.put(plan)
                return
            with self._room:
                while self._in_flight >= self.max_in_flight or (self._in_flight and self.runner.waits_for_tokens(plan)):
                    self._room.wait()
                if self._dry_since is not None:  # (a second or more without a plan: idle, not starved)
                    dry = time.perf_counter() - self._dry_since
                    self.metrics.phase("starved" if dry < IDLE_S else "idle", dry)
                    self._dry_since = None
                self._in_flight += 1
            self.traces.note(plan)
            spans = self.traces.start(plan)  # the batch's step span and, when exported, one per traced request
            t0 = time.perf_counter()
            self.profiler.before(plan.num_tokens)
            try:
                with self.device_lock:
                    step = self.runner.launch(plan)
            except Exception as e:  # noqa: BLE001 - a bad plan: the steps launched before it still report
                spans.end()
                self.profiler.stop()
                self._launched.put(e)
                return
            self.metrics.phase("launch", time.perf_counter() - t0)
            self.profiler.after(plan.num_tokens)
            self._launched.put(_Launched(step, plan.num_tokens, spans, t0))

    def _finisher(self) -> None:
        while True:
            item = self._launched.get()
            if item is _END or isinstance(item, BaseException):
                self._post(item)
                return
            try:
                item.step.wait()  # the step's tokens on the host; the launcher may launch meanwhile
                t1 = time.perf_counter()
                with self.device_lock:
                    result = self.runner.finish(item.step)
                out = result_to_proto(result)
            except Exception as e:  # noqa: BLE001 - ends the stream with its status (``Step`` maps it)
                self._post(e)
                self._drain()
                return
            finally:
                item.spans.end()
                with self._room:
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self._dry_since = time.perf_counter()
                    self._room.notify_all()
            elapsed = time.perf_counter() - item.t0
            self.metrics.step(elapsed, item.num_tokens, result.graph_captures)
            self.metrics.phase("finish", time.perf_counter() - t1)
            out.forward_ms = elapsed * 1e3
            self._post(out)

    def _drain(self) -> None:
        """After a failed collection: let the launcher run out (it stops at the stream's end or an error)."""
        while True:
            item = self._launched.get()
            if item is _END or isinstance(item, BaseException):
                return
            item.spans.end()
            with self._room:
                self._in_flight -= 1
                self._room.notify_all()


__all__ = ["StepPipeline"]
