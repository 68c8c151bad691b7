"""One ``Worker.Step`` stream's steps on the runner: one thread runs them, another waits for the device.

The event loop only moves messages: it converts each arriving plan and hands it to the step thread (:meth:`submit`),
and sends each result the step thread hands back (:meth:`results`). The step thread does all of the runner's host
work, in order, as the in-process engine's loop does: it launches a plan as soon as one is there (up to
``max_in_flight`` steps whose results are not collected), so the next step is queued on the device while the
previous one runs, and collects the oldest step once the waiter thread says its tokens are on the host (the waiter
only waits for the device, holding no lock and running no Python meanwhile). A step whose tokens arrived is
collected before the plans that are there are launched while a later step still runs on the device: the device
stays busy, and the tokens do not wait behind launches (with launches slower than the device, as at batch 1, plans
first sent results out in pairs, a launch or two late). With the device idle the plans launch first. On the host
(whose launch runs the step) one step is in flight: a step is collected before the next launch, or a long next
step, a prefill, would hold back tokens the step already has.

Why one thread for the runner: a launcher and a finisher thread working it at once (as before) took turns at the
device lock and at the interpreter's lock, which every torch call gives up and takes back. On one H100, the same
lease, the mesh's TPOT at concurrency 64 went from 11.6 to 9.8 ms with one thread, at 1 from 3.00 to 2.87 ms
(``bench/results/serving/2026-12-06-mesh-step-thread-h100.md``); a batch-1 launch still takes about 2 ms of host
time against a device step of about 1 ms, which is what holds the mesh's TPOT there.

The step thread takes ``device_lock`` around the runner (the service's other users of the runner take it too). A
plan whose rows need the previous step's tokens on the host before it is launched (``Runner.waits_for_tokens``: one
that installs a request's grammar, or drafts speculatively under one) is launched once the steps before it are
collected; a plain structured-output decode row is not held (``engine.pending_tokens``).

Phase timings (``WorkerMetrics.phase``): ``launch`` (the host's time to launch a step), ``finish`` (to collect it
and build its result message, after its tokens are on the host), ``starved`` (the time with no step on the device
and no plan to launch: the pipeline ran dry, waiting for the scheduler; a second or more counts as ``idle``).
``profiler``: the worker's ``serving.step_profiler.StepProfiler`` (``DEEPINFER_TORCH_PROFILER_DIR``), told of each
launch in the step thread.
"""

from __future__ import annotations

import asyncio
import collections
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
    ready: bool = False  # its tokens are on the host (the waiter said so)
    error: Exception | None = None  # waiting for them failed


class StepPipeline:
    def __init__(
        self, runner: Any, device_lock: threading.Lock, metrics: WorkerMetrics, traces: StepTraces,
        max_in_flight: int = 3, profiler: StepProfiler | None = None,
    ) -> None:  # fmt: skip
        self.runner, self.device_lock, self.metrics, self.traces = runner, device_lock, metrics, traces
        self.profiler = profiler if profiler is not None else StepProfiler(None, 0, 0, "")
        self.max_in_flight = max_in_flight if platform_of(runner.device).queues_steps else 1
        self._loop = asyncio.get_running_loop()
        # the step thread's one inbox: plans (and the stream's end or error) from the event loop, the waiter's news
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[_Launched | None] = queue.SimpleQueue()  # launched steps, for the waiter
        self._out: asyncio.Queue[worker_pb2.StepResult | BaseException | None] = asyncio.Queue()
        self._threads = [
            threading.Thread(target=self._run, name="step-run", daemon=True),
            threading.Thread(target=self._waiter, name="step-wait", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- the event loop's side --------------------------------------------------------------------
    def submit(self, plan: WorkerStepPlan | BaseException | None) -> None:
        """A plan to launch after those before it; an exception: the stream broke (reported after the steps
        launched before it); None: the stream ended."""
        self._inbox.put(plan)

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
        self._inbox.put(_END)
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

    def _waiter(self) -> None:
        """Wait for each launched step's tokens in order (no lock held) and hand it back to the step thread."""
        while (item := self._waits.get()) is not None:
            try:
                item.step.wait()
            except Exception as e:  # noqa: BLE001 - the step thread reports it as the step's failure
                item.error = e
            self._inbox.put(item)

    def _run(self) -> None:
        plans: collections.deque[WorkerStepPlan] = collections.deque()  # arrived, not launched
        launched: collections.deque[_Launched] = collections.deque()  # in flight, oldest first
        end: BaseException | bool = False  # the stream's end (True) or the error that ends it
        broken = False  # a collection failed and was posted: the steps after it are not collected
        dry_since: float | None = time.perf_counter()  # no step on the device since then (None: one is)
        try:
            while True:
                item = self._inbox.get()
                while True:  # take everything there is
                    if isinstance(item, _Launched):
                        item.ready = True
                    elif item is _END or isinstance(item, BaseException):
                        end = end or (True if item is _END else item)
                    elif not end:
                        plans.append(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                while True:  # launches and collections, in the order that keeps the device busy soonest
                    # a ready step goes out before more launches while a later step still runs on the device (it
                    # stays busy meanwhile, and the tokens leave a launch sooner); with the device idle, plans first
                    collect_first = len(launched) > 1 and launched[0].ready and not launched[-1].ready
                    while not collect_first and plans and len(launched) < self.max_in_flight:  # (before the end, too)
                        if launched and self.runner.waits_for_tokens(plans[0]):
                            break  # (launched once the steps before it are collected)
                        if dry_since is not None:  # (a second or more without a plan: idle, not starved)
                            dry = time.perf_counter() - dry_since
                            self.metrics.phase("starved" if dry < IDLE_S else "idle", dry)
                            dry_since = None
                        step = self._launch(plans.popleft())
                        if isinstance(step, BaseException):  # a bad plan: reported after the steps before it
                            end = step
                            plans.clear()
                            break
                        launched.append(step)
                        self._waits.put(step)
                    if not launched or not launched[0].ready:
                        break
                    item = launched.popleft()
                    if broken:  # (the device is done with it; its result is not wanted any more)
                        item.spans.end()
                    elif (failed := self._finish(item)) is not None:
                        self._post(failed)
                        end, broken = failed, True
                        plans.clear()
                if not launched:
                    dry_since = dry_since or time.perf_counter()
                    if end:
                        if not broken:
                            self._post(_END if end is True else end)
                        return
        except Exception as e:  # noqa: BLE001 - a fault of the loop itself: the stream ends with it, never hangs
            self._post(e)
        finally:
            self._waits.put(None)
            self.profiler.stop()  # (a record this stream began: what it has, from the thread that began it)

    def _launch(self, plan: WorkerStepPlan) -> _Launched | BaseException:
        self.traces.note(plan)
        spans = self.traces.start(plan)  # the batch's step span and, when exported, one per traced request
        t0 = time.perf_counter()
        self.profiler.before(plan.num_tokens)
        try:
            with self.device_lock:
                step = self.runner.launch(plan)
        except Exception as e:  # noqa: BLE001 - a bad plan: the steps launched before it still report
            spans.end()
            return e
        self.metrics.phase("launch", time.perf_counter() - t0)
        self.profiler.after(plan.num_tokens)
        return _Launched(step, plan.num_tokens, spans, t0)

    def _finish(self, item: _Launched) -> BaseException | None:
        """Collect a step whose tokens are on the host and post its result; a failure is returned (it ends the
        stream)."""
        t1 = time.perf_counter()
        try:
            if item.error is not None:
                raise item.error
            with self.device_lock:
                result = self.runner.finish(item.step)
            out = result_to_proto(result)
        except Exception as e:  # noqa: BLE001 - ends the stream with its status (``Step`` maps it)
            return e
        finally:
            item.spans.end()
        elapsed = time.perf_counter() - item.t0
        self.metrics.step(elapsed, item.num_tokens, result.graph_captures)
        self.metrics.phase("finish", time.perf_counter() - t1)
        out.forward_ms = elapsed * 1e3
        self._post(out)
        return None


__all__ = ["StepPipeline"]
