"""The scheduler's lookahead (async pipeline): step N+1 is planned before step N's result is applied.

Driven by the engine loop (``StepLoop``: two or three steps in flight, results in order), with a model-free
worker that fills placeholders with the token it sampled the step before. The outputs must be exactly
those of the synchronous schedule, and no page may leak.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.scheduler import PLACEHOLDER, Scheduler
from deepinfer.engine.step_loop import StepLoop, Turn
from deepinfer.sampling_params import SamplingParams
from engine.test_scheduler import REASONS, FakeWorker, expected_output, make_scheduler, scenarios


class PipelinedWorker(FakeWorker):
    def __init__(self, sched: Scheduler, token_fn) -> None:
        super().__init__(sched, token_fn)
        self.last: dict[str, int] = {}
        self.placeholders = 0

    def execute(self, plan: WorkerStepPlan) -> StepResult:
        for rid in plan.released:
            self.last.pop(rid, None)
        for c in plan.chunks:
            if PLACEHOLDER in c.token_ids:
                assert c.token_ids == [PLACEHOLDER] and c.request_id in self.last
                c.token_ids = [self.last[c.request_id]]
                self.placeholders += 1
        res = super().execute(plan)
        for r in res.results:
            if r.token_id is not None:
                self.last[r.request_id] = r.token_id
        return res


def check_pages(sched: Scheduler) -> None:
    pages = sched.pages
    assert pages.num_free + pages.num_used == pages.num_total
    owned = [p for r in sched.requests.values() for p in r.pages]
    assert len(owned) == len(set(owned)) == pages.num_used
    for r in sched.running:
        assert len(r.pages) * sched.config.page_size >= r.num_computed
        assert r.num_computed <= r.num_tokens + r.in_flight


def run_pipelined(sched: Scheduler, worker: PipelinedWorker, events: list, seed: int, depth: int = 2) -> list[str]:
    """The engine loop (``StepLoop``, as the scheduler service and the offline engine run it) turned once after each
    batch of arrivals and aborts, then until nothing is left."""
    loop = StepLoop(sched, depth)
    accepted: list[str] = []
    n = 0

    def pump() -> None:
        turn = loop.turn(worker.waits_for_tokens)
        if turn is Turn.SEND:
            worker.send(loop.plan)
        elif turn is Turn.RECEIVE:
            loop.received(worker.receive())
        check_pages(sched)

    for arrivals, aborts in events:
        for a in arrivals:
            rid = f"r{n}"
            n += 1
            prompt = [random.Random(f"{seed}/p/{rid}/{i}").randrange(10, 40) for i in range(a["prompt_len"])]
            params = SamplingParams(
                temperature=0,
                max_tokens=a["max_tokens"],
                min_tokens=a["min_tokens"],
                ignore_eos=a["ignore_eos"],
                stop_token_ids=a["stop_token_ids"],
            )
            try:
                sched.add(rid, prompt, params)
            except ValueError:
                continue
            accepted.append(rid)
        for k in aborts:
            if accepted:
                sched.abort([accepted[k % len(accepted)]])
        pump()
    for _ in range(5000):
        if not loop.busy:
            break
        pump()
    else:
        raise AssertionError("pipeline made no progress")
    return accepted


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), depth=st.sampled_from([2, 3]))
def test_pipelined_schedule_gives_the_synchronous_outputs(sc: dict, depth: int) -> None:
    cfg, seed = sc["cfg"], sc["seed"]

    def token_fn(rid: str, pos: int) -> int:
        return random.Random(f"{seed}/{rid}/{pos}").randrange(0, 40)

    sched = make_scheduler(cfg["num_pages"], cfg["budget"], cfg["max_seqs"], cfg["max_model_len"])
    worker = PipelinedWorker(sched, token_fn)
    accepted = run_pipelined(sched, worker, sc["events"], seed, depth)
    assert sched.pages.num_free == sched.pages.num_total
    plan = sched.schedule()
    worker.execute(plan)
    assert worker.held == {}
    for rid in accepted:
        req = sched.requests[rid]
        assert req.finished and req.finish_reason in REASONS
        if req.finish_reason == "abort":
            continue
        out, reason, stop_reason = expected_output(sched, req, token_fn)
        assert (req.output_token_ids, req.finish_reason, req.stop_reason) == (out, reason, stop_reason), rid


def test_decodes_continue_on_placeholders() -> None:
    sched = make_scheduler(num_pages=64)
    worker = PipelinedWorker(sched, lambda rid, pos: 100 + pos)
    for i in range(3):
        sched.add(f"r{i}", [10 + i] * (3 + i), SamplingParams(temperature=0, max_tokens=8))
    run_pipelined(sched, worker, [], seed=0)
    assert worker.placeholders >= 3 * 5  # most decode steps ran ahead of their previous result
    for i in range(3):
        req = sched.requests[f"r{i}"]
        assert req.output_token_ids == [100 + 3 + i + k for k in range(8)] and req.finish_reason == "length"


def test_three_steps_in_flight_chain_placeholders() -> None:
    """With three steps in flight a decoding request has two tokens in flight: its chunk in the third step holds a
    placeholder for a token sampled in a step whose result has not come back (the scheduler service's default)."""
    sched = make_scheduler(num_pages=64)
    worker = PipelinedWorker(sched, lambda rid, pos: 100 + pos)
    loop = StepLoop(sched, 3)
    sched.add("r0", [10, 11, 12], SamplingParams(temperature=0, max_tokens=6))
    ahead = 0
    while loop.busy:
        turn = loop.turn(worker.waits_for_tokens)
        if turn is Turn.SEND:
            ahead = max(ahead, sched.requests["r0"].in_flight if "r0" in sched.requests else 0)
            worker.send(loop.plan)
        elif turn is Turn.RECEIVE:
            loop.received(worker.receive())
        check_pages(sched)
    req = sched.requests["r0"]
    assert ahead == 3  # the prompt's token and two decode placeholders, none of them answered yet
    assert req.output_token_ids == [103 + k for k in range(6)] and req.finish_reason == "length"
    assert sched.pages.num_free == sched.pages.num_total
