"""The continuous-batching scheduler, driven directly (no model).

A small in-test worker plays the other side of the ``WorkerStepPlan`` / ``StepResult`` contract: it tracks how
many tokens of each request it holds (dropping the ones a plan releases), checks every chunk starts where
its state ends, scores the prompt-logprob targets and "samples" a token that depends only on the request
and the position, so outputs are reproducible across preemption and recomputation.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer.engine.interfaces import ImmediateRunner, SeqResult, StepResult, WorkerStepPlan
from deepinfer.engine.pages import PagePool
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.sampling_params import SamplingParams

PS = 8  # page size
EOS = 1
REASONS = {"stop", "length", "abort"}

TokenFn = Callable[[str, int], int]


def make_scheduler(
    num_pages: int = 64,
    budget: int = 8192,
    max_seqs: int = 256,
    max_model_len: int = 4096,
    page_size: int = PS,
    prefix_caching: bool = False,  # the core mechanics; tests/engine/test_prefix_cache.py covers caching
) -> Scheduler:
    cfg = SchedulerConfig(
        page_size=page_size,
        max_model_len=max_model_len,
        eos_token_id=EOS,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        prefix_caching=prefix_caching,
    )
    return Scheduler(cfg, PagePool(num_pages))


def pos_token(rid: str, pos: int) -> int:
    """A token that never is EOS: depends on the position only."""
    return 100 + pos


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FakeWorker(ImmediateRunner):
    """The worker side of the contract, without a model."""

    def __init__(self, sched: Scheduler, token_fn: TokenFn = pos_token) -> None:
        self.sched, self.token_fn = sched, token_fn
        self.held: dict[str, int] = {}  # request id -> tokens whose state the worker holds
        self.scored: dict[str, list[int]] = {}  # request id -> prompt positions scored, in order

    def execute(self, plan: WorkerStepPlan) -> StepResult:
        for rid in plan.released:
            self.held.pop(rid, None)
        out = StepResult(plan.step_id)
        for c in plan.chunks:
            assert self.held.get(c.request_id, 0) == c.start, (
                f"{c.request_id}: chunk starts at {c.start}, worker holds {self.held.get(c.request_id, 0)}"
            )
            self.held[c.request_id] = c.start + len(c.token_ids)
            r = SeqResult(c.request_id)
            if c.logprob_targets is not None:
                assert len(c.logprob_targets) == len(c.token_ids)
                rows = [(c.start + j, t) for j, t in enumerate(c.logprob_targets) if t >= 0]
                # the scored position (j + 1) is encoded in the value, to check order and uniqueness later
                r.prompt_logprobs = [{t: -float(p + 1)} for p, t in rows]
                self.scored.setdefault(c.request_id, []).extend(p + 1 for p, _ in rows)
            if c.sample:
                r.token_id = self.token_fn(c.request_id, c.start + len(c.token_ids))
                r.logprob = -0.25
            out.results.append(r)
        return out


def step(sched: Scheduler, worker: FakeWorker) -> tuple[WorkerStepPlan, list[Request]]:
    plan = sched.schedule()
    check_plan(sched, plan)
    check_state(sched)
    done = sched.update(worker.execute(plan))
    check_state(sched)
    return plan, done


def check_plan(sched: Scheduler, plan: WorkerStepPlan) -> None:
    cfg = sched.config
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [c.request_id for c in plan.chunks]
    assert len(ids) == len(set(ids)), "a request got two chunks in one step"
    for c in plan.chunks:
        req = sched.requests[c.request_id]
        assert req.status is Status.RUNNING
        n = len(c.token_ids)
        assert n >= 1
        assert c.start + n == req.num_computed
        assert c.token_ids == req.all_token_ids[c.start : c.start + n]
        assert c.block_table == req.pages
        assert len(c.block_table) * cfg.page_size >= c.start + n
        assert c.sample == (c.start + n == req.num_tokens)
        assert c.params is req.params


def check_state(sched: Scheduler) -> None:
    pages, ps = sched.pages, sched.config.page_size
    assert pages.num_free + pages.num_used == pages.num_total
    owner: dict[int, str] = {}
    for rid, req in sched.requests.items():
        for p in req.pages:
            assert p not in owner, f"page {p} is held by {owner[p]} and {rid}"
            owner[p] = rid
            assert pages.refcount(p) == 1
    assert len(owner) == pages.num_used
    assert len(sched.running) <= sched.config.max_num_seqs
    running, waiting = {r.request_id for r in sched.running}, {r.request_id for r in sched.waiting}
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    assert not running & waiting
    for rid, req in sched.requests.items():
        if req.status is Status.RUNNING:
            assert rid in running
            assert 0 < req.num_computed <= req.num_tokens
            assert len(req.pages) == ceil_div(req.num_computed, ps), (rid, req.num_computed, req.pages)
        elif req.status is Status.WAITING:
            assert rid in waiting
            assert req.pages == [] and req.num_computed == 0
        else:
            assert rid not in running and rid not in waiting
            assert req.pages == [] and req.num_computed == 0
            assert req.finish_reason in REASONS
    assert sched.has_unfinished() == bool(running or waiting)


def drain(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> list[WorkerStepPlan]:
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return plans
        plans.append(step(sched, worker)[0])
    raise AssertionError("scheduler made no progress (livelock)")


def greedy(max_tokens: int | None = 16, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# -- property test -------------------------------------------------------------------------------


def expected_output(sched: Scheduler, req: Request, token_fn: TokenFn) -> tuple[list[int], str, int | None]:
    """What an ideal scheduler produces for ``req`` (no abort): the reference model of the stop rules."""
    p, out = req.params, []
    limit = min(sched.config.max_model_len, sched.pages.num_total * sched.config.page_size)
    while True:
        t = token_fn(req.request_id, req.num_prompt_tokens + len(out))
        out.append(t)
        if len(out) >= p.min_tokens:
            if t == EOS and not p.ignore_eos:
                return out, "stop", None
            if t in p.stop_token_ids:
                return out, "stop", t
        if p.max_tokens is not None and len(out) >= p.max_tokens:
            return out, "length", None
        if req.num_prompt_tokens + len(out) >= limit:
            return out, "length", None


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    num_pages = draw(st.integers(4, 30))
    cfg = {
        "num_pages": num_pages,
        "budget": draw(st.integers(1, 64)),
        "max_seqs": draw(st.integers(1, 6)),
        "max_model_len": draw(st.integers(2, 100)),
    }
    events = []
    for _ in range(draw(st.integers(1, 25))):
        arrivals = []
        for _ in range(draw(st.integers(0, 3))):
            max_tokens = draw(st.integers(1, 20))
            arrivals.append(
                {
                    "prompt_len": draw(st.integers(1, 60)),
                    "max_tokens": draw(st.sampled_from([None, max_tokens])),
                    "min_tokens": draw(st.integers(0, min(3, max_tokens))),
                    "ignore_eos": draw(st.booleans()),
                    "stop_token_ids": draw(st.lists(st.integers(2, 9), max_size=2)),
                    "prompt_logprobs": draw(st.sampled_from([None, 0, 2])),
                }
            )
        aborts = draw(st.lists(st.integers(0, 100), max_size=2))
        events.append((arrivals, aborts))
    return {"cfg": cfg, "events": events, "seed": draw(st.integers(0, 2**32 - 1))}


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_random_traffic_keeps_every_invariant(sc: dict) -> None:
    cfg = sc["cfg"]
    sched = make_scheduler(cfg["num_pages"], cfg["budget"], cfg["max_seqs"], cfg["max_model_len"])
    seed = sc["seed"]

    def token_fn(rid: str, pos: int) -> int:
        # small vocabulary so EOS (1) and the stop ids (2..9) come up often; a pure function of (rid, pos)
        return random.Random(f"{seed}/{rid}/{pos}").randrange(0, 40)

    worker = FakeWorker(sched, token_fn)
    aborted: set[str] = set()
    accepted: list[str] = []
    n = 0
    for arrivals, aborts in sc["events"]:
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
                prompt_logprobs=a["prompt_logprobs"],
            )
            too_long = a["prompt_len"] >= cfg["max_model_len"] or a["prompt_len"] + 1 > cfg["num_pages"] * PS
            if too_long:
                with pytest.raises(ValueError):
                    sched.add(rid, prompt, params)
                assert rid not in sched.requests
                event("prompt rejected")
                continue
            sched.add(rid, prompt, params)
            accepted.append(rid)
        for k in aborts:
            if accepted:
                rid = accepted[k % len(accepted)]
                was_finished = sched.requests[rid].finished
                sched.abort([rid])
                assert sched.requests[rid].finished
                if not was_finished:
                    aborted.add(rid)
                    assert sched.requests[rid].finish_reason == "abort"
        check_state(sched)
        step(sched, worker)
    drain(sched, worker, max_steps=3000)

    # nothing leaks: every page is back, and one more (empty) step hands the worker every last release
    assert sched.pages.num_free == sched.pages.num_total and sched.pages.num_used == 0
    plan = sched.schedule()
    assert plan.chunks == []
    worker.execute(plan)
    assert worker.held == {}

    event("preemptions" if sched.num_preemptions else "no preemption")
    for rid in accepted:
        req = sched.requests[rid]
        assert req.finished and req.finish_reason in REASONS
        event(f"finish: {req.finish_reason} {type(req.stop_reason).__name__}")
        if rid in aborted:
            assert req.finish_reason == "abort"
            continue
        out, reason, stop_reason = expected_output(sched, req, token_fn)
        assert (req.output_token_ids, req.finish_reason, req.stop_reason) == (out, reason, stop_reason), rid
        assert len(req.logprobs) == len(out)
        if req.wants_prompt_logprobs:
            # every prompt position 1.. scored exactly once, in order, even across preemptions
            assert worker.scored.get(rid, []) == list(range(1, req.num_prompt_tokens))
            assert req.prompt_logprobs[0] is None
            assert req.prompt_logprobs[1:] == [
                {req.prompt_token_ids[i]: -float(i)} for i in range(1, req.num_prompt_tokens)
            ]
        else:
            assert req.prompt_logprobs == []


# -- chunked prefill, ordering, preemption ---------------------------------------------------------


def test_chunked_prefill_splits_by_budget_and_samples_last():
    sched = make_scheduler(num_pages=32, budget=16)
    worker = FakeWorker(sched)
    prompt = list(range(10, 60))
    sched.add("a", prompt, greedy(max_tokens=2))
    sizes, starts, samples, tables = [], [], [], []
    for _ in range(4):
        plan, done = step(sched, worker)
        (c,) = plan.chunks
        sizes.append(len(c.token_ids))
        starts.append(c.start)
        samples.append(c.sample)
        tables.append(len(c.block_table))
        assert c.token_ids == prompt[c.start : c.start + len(c.token_ids)]
        assert not done
    assert sizes == [16, 16, 16, 2]
    assert starts == [0, 16, 32, 48]
    assert samples == [False, False, False, True]
    assert tables == [2, 4, 6, 7]
    req = sched.requests["a"]
    assert req.output_token_ids == [pos_token("a", 50)]
    plan, done = step(sched, worker)  # decode: one token at position 50
    (c,) = plan.chunks
    assert (c.start, c.token_ids, c.sample) == (50, [pos_token("a", 50)], True)
    assert done == [req] and req.finish_reason == "length"
    assert sched.pages.num_used == 0


def test_running_decodes_go_before_new_admissions():
    sched = make_scheduler(num_pages=32, budget=16, max_seqs=2)
    worker = FakeWorker(sched)
    sched.add("a", list(range(10, 20)), greedy(max_tokens=8))
    plan, _ = step(sched, worker)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("a", 10)]
    sched.add("b", list(range(10, 50)), greedy(max_tokens=8))
    sched.add("c", list(range(10, 13)), greedy(max_tokens=8))
    plan, _ = step(sched, worker)
    # a's decode token first, then b's first chunk with the rest of the budget; c waits (max_num_seqs=2)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in plan.chunks] == [("a", 10, 1), ("b", 0, 15)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    plan, _ = step(sched, worker)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in plan.chunks] == [("a", 11, 1), ("b", 15, 15)]
    drain(sched, worker)
    assert all(sched.requests[r].finish_reason == "length" for r in "abc")
    assert sched.num_preemptions == 0


def test_preemption_requeues_newest_at_front_and_recomputes_from_zero():
    sched = make_scheduler(num_pages=4, budget=64)  # 32 token slots
    worker = FakeWorker(sched)
    sched.add("a", list(range(10, 26)), greedy(max_tokens=3))  # 16 tokens: 2 pages
    sched.add("b", list(range(30, 46)), greedy(max_tokens=3))  # 16 tokens: 2 pages
    plan, _ = step(sched, worker)
    assert [c.request_id for c in plan.chunks] == ["a", "b"] and sched.pages.num_free == 0
    sched.add("c", [7, 8], greedy(max_tokens=1))  # arrives after b
    a, b = sched.requests["a"], sched.requests["b"]

    # a's next token (position 16) needs a third page: b, the most recently admitted, is preempted
    plan, _ = step(sched, worker)
    assert sched.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert plan.released == ["b"]
    assert [(c.request_id, c.start) for c in plan.chunks] == [("a", 16)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # re-queued at the front
    assert b.status is Status.WAITING and b.pages == [] and b.num_computed == 0
    assert b.output_token_ids == [pos_token("b", 16)]  # what it produced is kept
    assert len(a.pages) == 3

    plan, _ = step(sched, worker)  # a finishes (max_tokens 3); b cannot come back yet (needs 3 pages, 1 free)
    assert [c.request_id for c in plan.chunks] == ["a"] and a.finish_reason == "length"
    plan, _ = step(sched, worker)  # b is recomputed from position 0: prompt + its token, sampling at the end
    assert plan.released == ["a"]
    (cb,) = [c for c in plan.chunks if c.request_id == "b"]
    assert (cb.start, cb.token_ids, cb.sample) == (0, b.prompt_token_ids + [pos_token("b", 16)], True)
    assert [c.request_id for c in plan.chunks] == ["b", "c"]  # c behind b
    drain(sched, worker)
    assert b.output_token_ids == [pos_token("b", p) for p in (16, 17, 18)]
    assert sched.pages.num_used == 0


def test_constraint_goes_with_the_first_chunk_and_again_with_history_after_a_preemption():
    from deepinfer.engine.constraint import Constraint

    sched = make_scheduler(num_pages=4, budget=8)  # chunked prefill: 8 tokens a step
    worker = FakeWorker(sched)
    ca, cb = Constraint(None, banned_token_ids=(5,)), Constraint(None, banned_token_ids=(6,))
    sched.add("a", list(range(10, 26)), greedy(max_tokens=12), constraint=ca)
    sched.add("b", list(range(30, 38)), greedy(max_tokens=12), constraint=cb)
    sent: list[tuple[str, int, list[int] | None]] = []
    while sched.has_unfinished():
        plan, _ = step(sched, worker)
        for c in plan.chunks:
            assert (c.constraint is None) == (c.constraint_history is None)
            if c.constraint is not None:
                assert c.constraint is sched.requests[c.request_id].constraint
                sent.append((c.request_id, c.start, c.constraint_history))
    b = sched.requests["b"]
    assert b.num_preemptions >= 1
    assert sent[0] == ("a", 0, []) and ("b", 0, []) in sent
    # after each preemption the chunk that starts the recompute carries the tokens generated so far
    replays = [h for rid, start, h in sent if rid == "b" and h]
    assert len(replays) == b.num_preemptions and all(h == b.output_token_ids[: len(h)] for h in replays)
    assert len(sent) == 2 + b.num_preemptions + sched.requests["a"].num_preemptions


def test_newest_request_that_needs_a_page_preempts_itself():
    sched = make_scheduler(num_pages=3, budget=64)
    worker = FakeWorker(sched)
    sched.add("a", list(range(10, 25)), greedy(max_tokens=4))  # 15 tokens: 2 pages
    sched.add("b", list(range(10, 18)), greedy(max_tokens=4))  # 8 tokens: 1 page
    step(sched, worker)
    # a's position 15 still fits its 2 pages; b's position 8 needs a second page, none is free and b is
    # the newest running request: b gives up its own pages rather than take a's
    plan, _ = step(sched, worker)
    a, b = sched.requests["a"], sched.requests["b"]
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and plan.released == ["b"]
    assert [(c.request_id, c.start) for c in plan.chunks] == [("a", 15)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    drain(sched, worker)
    assert a.finish_reason == b.finish_reason == "length"
    assert b.output_token_ids == [pos_token("b", p) for p in range(8, 12)]
    assert sched.pages.num_used == 0


# -- stop conditions ---------------------------------------------------------------------------------


def run_one(params: SamplingParams, tokens: list[int], prompt_len: int = 5, **cfg: int) -> Request:
    sched = make_scheduler(**cfg)
    worker = FakeWorker(sched, lambda rid, pos: tokens[pos - prompt_len])
    sched.add("x", list(range(10, 10 + prompt_len)), params)
    drain(sched, worker)
    assert sched.pages.num_used == 0
    return sched.requests["x"]


@pytest.mark.parametrize(
    "params, tokens, out, reason, stop_reason",
    [
        (greedy(), [5, EOS, 6], [5, EOS], "stop", None),
        (greedy(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], "length", None),
        (greedy(stop_token_ids=[7, 8]), [5, 8, 7], [5, 8], "stop", 8),
        (greedy(stop_token_ids=[7], ignore_eos=True), [EOS, 7], [EOS, 7], "stop", 7),
        (greedy(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], "length", None),
        (greedy(max_tokens=1), [EOS], [EOS], "stop", None),  # eos on the last allowed token is "stop"
        (greedy(min_tokens=3), [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], "stop", None),
        (greedy(min_tokens=2, stop_token_ids=[7]), [7, 5, 7], [7, 5, 7], "stop", 7),
        (greedy(min_tokens=2, max_tokens=2), [EOS, EOS, 5], [EOS, EOS], "stop", None),
    ],
)
def test_stop_conditions(params, tokens, out, reason, stop_reason):
    req = run_one(params, tokens)
    assert (req.output_token_ids, req.finish_reason, req.stop_reason) == (out, reason, stop_reason)


def test_max_model_len_ends_with_length():
    req = run_one(greedy(max_tokens=None), [5] * 20, prompt_len=10, max_model_len=13)
    assert req.output_token_ids == [5, 5, 5] and req.finish_reason == "length"
    assert req.num_tokens == 13


def test_sequence_cannot_outgrow_the_page_pool():
    # 2 pages of 8: a sequence can never hold more than 16 tokens, whatever max_model_len says
    req = run_one(greedy(max_tokens=None), [5] * 40, prompt_len=10, num_pages=2, budget=4)
    assert req.finish_reason == "length" and req.num_tokens == 16


def test_add_rejects_bad_prompts():
    sched = make_scheduler(num_pages=2, max_model_len=12)
    with pytest.raises(ValueError, match="at least one token"):
        sched.add("e", [], greedy())
    with pytest.raises(ValueError, match="limit"):
        sched.add("l", list(range(12)), greedy())
    sched2 = make_scheduler(num_pages=2)
    with pytest.raises(ValueError, match="pages"):
        sched2.add("p", list(range(16)), greedy())
    sched2.add("ok", list(range(15)), greedy())
    with pytest.raises(ValueError, match="already in use"):
        sched2.add("ok", [3], greedy())
    assert not sched.requests and list(sched2.requests) == ["ok"]


def test_abort_running_and_waiting_frees_pages():
    sched = make_scheduler(num_pages=8, budget=16, max_seqs=1)
    worker = FakeWorker(sched)
    sched.add("a", list(range(10, 30)), greedy(max_tokens=10))
    sched.add("b", list(range(10, 30)), greedy(max_tokens=10))
    step(sched, worker)
    a, b = sched.requests["a"], sched.requests["b"]
    assert a.status is Status.RUNNING and len(a.pages) == 2 and b.status is Status.WAITING
    sched.abort(["a", "b", "unknown"])
    check_state(sched)
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert sched.pages.num_used == 0 and not sched.has_unfinished()
    plan = sched.schedule()
    assert plan.released == ["a"] and plan.chunks == []  # b never ran: nothing to release
    worker.execute(plan)
    assert worker.held == {}
    sched.abort(["a"])  # aborting a finished request is a no-op
    assert a.finish_reason == "abort"
    # a finished request keeps its reason when aborted afterwards
    sched.add("c", [3, 4], greedy(max_tokens=1))
    drain(sched, worker)
    sched.abort(["c"])
    assert sched.requests["c"].finish_reason == "length"


# -- prompt-logprob targets --------------------------------------------------------------------------


def test_prompt_logprob_targets_are_next_prompt_tokens():
    sched = make_scheduler(num_pages=16, budget=8)
    worker = FakeWorker(sched)
    prompt = list(range(100, 112))  # 12 tokens
    sched.add("a", prompt, greedy(max_tokens=2, prompt_logprobs=1))
    plan, _ = step(sched, worker)
    assert plan.chunks[0].logprob_targets == prompt[1:9]
    plan, _ = step(sched, worker)
    assert plan.chunks[0].logprob_targets == prompt[9:12] + [-1]  # position 11 predicts a generated token
    plan, _ = step(sched, worker)
    assert plan.chunks[0].logprob_targets is None  # decode
    req = sched.requests["a"]
    assert req.prompt_logprobs == [None] + [{prompt[i]: -float(i)} for i in range(1, 12)]


def test_prompt_logprobs_of_one_token_prompt():
    sched = make_scheduler()
    worker = FakeWorker(sched)
    sched.add("a", [42], greedy(max_tokens=1, prompt_logprobs=0))
    plan, _ = step(sched, worker)
    assert plan.chunks[0].logprob_targets is None
    assert sched.requests["a"].prompt_logprobs == [None]


def test_preemption_does_not_retarget_scored_positions():
    sched = make_scheduler(num_pages=4, budget=9)
    worker = FakeWorker(sched)
    pa = list(range(10, 18))
    pb = list(range(200, 220))  # 20 tokens
    sched.add("a", pa, greedy(max_tokens=20))
    sched.add("b", pb, greedy(max_tokens=1, prompt_logprobs=1))
    plan, _ = step(sched, worker)  # a: 8 tokens, b: the last budget token
    assert [(c.request_id, c.start, len(c.token_ids)) for c in plan.chunks] == [("a", 0, 8), ("b", 0, 1)]
    assert plan.chunks[1].logprob_targets == [pb[1]]
    plan, _ = step(sched, worker)  # a decodes, b prefills positions 1..8
    assert plan.chunks[1].logprob_targets == pb[2:10]
    b = sched.requests["b"]
    assert len(b.prompt_logprobs) == 10
    # b needs a third page for positions 9..16, none is free and b is the newest: it preempts itself,
    # then is re-admitted from position 0 in the same step; positions 1..9 are already scored
    plan, _ = step(sched, worker)
    assert b.num_preemptions == 1 and plan.released == ["b"]
    cb = plan.chunks[1]
    assert (cb.request_id, cb.start, len(cb.token_ids), cb.logprob_targets) == ("b", 0, 8, None)
    plan, _ = step(sched, worker)
    cb = plan.chunks[1]
    assert (cb.start, cb.logprob_targets) == (8, [-1] + pb[10:17])
    drain(sched, worker)
    assert worker.scored["b"] == list(range(1, 20))
    assert b.prompt_logprobs == [None] + [{pb[i]: -float(i)} for i in range(1, 20)]
    assert b.finish_reason == "length" and sched.pages.num_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_worker_lost_drops_every_request_and_frees_every_page(prefix_caching: bool) -> None:
    sched = make_scheduler(num_pages=32, prefix_caching=prefix_caching)
    worker = FakeWorker(sched)
    for i in range(6):
        sched.add(f"r{i}", [2 + i] * 20, greedy(max_tokens=40))
    for _ in range(4):  # (check_state's page accounting leaves the prefix cache out: plain steps here)
        sched.update(worker.execute(sched.schedule()))
    assert sched.pages.num_free < sched.pages.num_total
    assert sorted(sched.worker_lost()) == [f"r{i}" for i in range(6)]
    assert sched.pages.num_free == sched.pages.num_total and not sched.has_unfinished()
    assert not sched.has_pending_releases  # nothing is owed to a worker that holds nothing
    sched.add("after", [3] * 20, greedy(max_tokens=4))  # the replica goes on with a fresh worker
    fresh = FakeWorker(sched)  # it checks every chunk starts where its (empty) state ends
    while sched.has_unfinished():
        sched.update(fresh.execute(sched.schedule()))
    assert sched.requests["after"].output_token_ids == [pos_token("after", 20 + k) for k in range(4)]


def test_a_moved_request_continues_after_its_streamed_tokens() -> None:
    """A request resubmitted with the tokens it already generated elsewhere produces exactly the rest of what it
    would have produced undisturbed: those tokens count against max_tokens, and the next token is sampled at the
    position after them."""
    whole = make_scheduler()
    whole.add("r", [5] * 10, greedy(max_tokens=12))
    drain(whole, FakeWorker(whole))
    expected = whole.requests["r"].output_token_ids
    moved = make_scheduler()
    moved.add("r", [5] * 10, greedy(max_tokens=12), output_token_ids=expected[:5])
    drain(moved, FakeWorker(moved))
    req = moved.requests["r"]
    assert req.output_token_ids == expected and req.finish_reason == "length"
    with pytest.raises(ValueError, match="output_token_ids"):
        moved.add("s", [5] * 10, greedy(max_tokens=3), output_token_ids=[7, 7, 7])


def test_a_token_slice_is_the_slice_of_all_tokens():
    """``Request.token_slice`` (a chunk's tokens, without building the whole sequence's list) is
    ``all_token_ids[start:stop]`` wherever the slice falls: in the prompt, across its end, in the output, past both."""
    req = Request("r", [10, 11, 12, 13], SamplingParams(), 0, output_token_ids=[20, 21, 22])
    for start in range(9):
        for stop in range(start, 10):
            assert req.token_slice(start, stop) == req.all_token_ids[start:stop], (start, stop)
    assert Request("e", [1, 2], SamplingParams(), 0).token_slice(1, 5) == [2]
