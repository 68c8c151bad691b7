"""The engine loop, once, for the offline engine and the scheduler service: which step to plan next, when to
collect one, what a result finishes.

The loop is written without I/O (:meth:`StepLoop.turn` says what to do next; :meth:`StepLoop.received` takes a
step's result), so that one implementation drives a runner in process (``LLMEngine``: ``ModelRunner``, a plain
call) and over the network (the scheduler service: ``RemoteWorker``, awaited on the ``Worker.Step`` stream).
Both runners keep one contract (:class:`~deepinfer.engine.interfaces.Runner`): steps are sent and their results
received in order.

Pipelining: with ``depth`` 2 the next step is planned and sent while one is in flight (requests decoding in it
continue on placeholder tokens that the runner fills in), so the runner never waits for the planner. With ``depth``
3 (the scheduler service's default, ``DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT``) a step's result may take two device
steps to come back over the network and be planned on before the runner runs dry. A step whose rows need the
previous tokens on the host before its launch (``Runner.waits_for_tokens``: a grammar installed, speculative drafting
under one) is held until the steps in flight are collected.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from enum import Enum

from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler


class Turn(Enum):
    SEND = "send"  # send ``StepLoop.plan`` to the runner
    RECEIVE = "receive"  # receive the oldest step's result and hand it to ``StepLoop.received``
    WAIT = "wait"  # requests wait for something outside the loop (a kvstore fetch): poll again shortly
    IDLE = "idle"  # nothing to run until a request arrives


class StepLoop:
    def __init__(self, scheduler: Scheduler, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth: at least 1 step in flight, got {depth}")
        self.scheduler, self.depth = scheduler, depth
        self.in_flight: collections.deque[WorkerStepPlan] = collections.deque()
        self.plan: WorkerStepPlan | None = None  # the step to send (``Turn.SEND``)
        self._held: WorkerStepPlan | None = None  # planned, waiting for the steps in flight to be collected

    @property
    def busy(self) -> bool:
        """Requests are unfinished, or steps are in flight."""
        return self._has_work or bool(self.in_flight)

    @property
    def _has_work(self) -> bool:
        """Requests are unfinished, or released ones wait to be told to the runner."""
        return self.scheduler.has_unfinished() or self.scheduler.has_pending_releases

    def turn(self, waits_for_tokens: Callable[[WorkerStepPlan], bool] | None = None) -> Turn:
        """What the driver does next. ``waits_for_tokens`` (the runner's, or None): whether a plan must wait for
        the steps in flight. After ``Turn.SEND`` the plan is in :attr:`plan` and counts as in flight."""
        if self._held is not None:
            if self.in_flight:
                return Turn.RECEIVE
            return self._send(self._held)
        if len(self.in_flight) < self.depth:
            plan = self._next_plan()
            if plan is not None:
                if self.in_flight and waits_for_tokens is not None and waits_for_tokens(plan):
                    self._held = plan
                    return Turn.RECEIVE
                return self._send(plan)
        if self.in_flight:
            return Turn.RECEIVE
        return Turn.WAIT if self._has_work else Turn.IDLE

    def idle_step(self) -> Turn:
        """While idle: send an empty step anyway (``Turn.SEND``), to carry what the driver must tell the runner
        with a step (the scheduler service's dropped image features)."""
        return self._send(self.scheduler.schedule())

    def received(self, result: StepResult) -> list[Request]:
        """Apply the oldest step's result; the requests it finished (still in the scheduler until popped)."""
        plan = self.in_flight.popleft()
        if result.step_id != plan.step_id:
            raise RuntimeError(f"step {result.step_id} answered where step {plan.step_id} was due")
        return self.scheduler.update(result)

    def forget(self) -> None:
        """The runner lost every step in flight (and the held plan): nothing is in flight any more."""
        self.in_flight.clear()
        self.plan = self._held = None

    def _send(self, plan: WorkerStepPlan) -> Turn:
        self._held, self.plan = None, plan
        self.in_flight.append(plan)
        return Turn.SEND

    def _next_plan(self) -> WorkerStepPlan | None:
        """The next step (planned ahead of the steps in flight), or None when there is nothing to run."""
        if not self._has_work:
            return None
        plan = self.scheduler.schedule(lookahead=len(self.in_flight))
        busy = plan.chunks or plan.released or plan.snapshots or plan.dropped_snapshots or plan.offloads
        return plan if busy or plan.fetches or self.scheduler.fetching or self.scheduler.exporting else None
