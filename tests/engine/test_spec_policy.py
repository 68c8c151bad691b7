"""The scheduler's choice to draft or not, by measured cost per token (``engine.speculative.policy``), on a fake
clock: it drafts first, tries plain steps, keeps the cheaper mode per decode-batch bucket and keeps measuring the
other; idle time and the first step after a switch are not counted; a scheduler driven with synthetic step results
plans no drafts while plain steps are cheaper, and the metric names the reason."""

from __future__ import annotations

from deepinfer.engine.interfaces import PLACEHOLDER, SeqResult, StepResult
from deepinfer.engine.pages import PagePool
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.engine.speculative.policy import BURST, MIN_SAMPLES, SpecPolicy, bucket
from deepinfer.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(policy: SpecPolicy, clock: Clock, rows: int, steps: int, cost: dict[bool, tuple[float, float]]) -> list:
    """``steps`` steps of ``rows`` decode rows, one in flight at a time; ``cost[drafted]``: (seconds, tokens emitted
    per row). Returns the modes chosen."""
    modes = []
    for k in range(steps):
        mode = policy.choose(rows)
        modes.append(mode)
        policy.planned(k, rows, mode, True)
        seconds, per_row = cost[mode]
        clock.t += seconds
        policy.observed(k, int(rows * per_row))
    return modes


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 64)] == [1, 2, 4, 4, 8, 16, 32, 64]


def test_plain_steps_win_when_verify_steps_cost_more_per_token() -> None:
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)  # exploring: BURST steps every 32 + BURST
    # a verify step: 3.0 s for 2 tokens a row (1.5 s a token); a plain step 1.0 s a token
    modes = drive(policy, clock, 8, 200, {True: (3.0, 2), False: (1.0, 1)})
    assert modes[: MIN_SAMPLES + 1] == [True] * (MIN_SAMPLES + 1)  # drafting is measured first (the first not counted)
    assert False in modes[: MIN_SAMPLES + 2 + BURST]  # then the plain steps are tried
    tail = modes[100:]
    assert tail.count(False) > 0.8 * len(tail) and True in tail  # plain steps, and drafting measured again now and then
    est = policy.estimates
    assert abs(est[(8, True)].seconds_per_token - 1.5) < 1e-9 and abs(est[(8, False)].seconds_per_token - 1.0) < 1e-9


def test_one_slow_step_does_not_decide() -> None:
    """The first plain steps of a shape are slow once (a CUDA graph captured, a kernel compiled): the median of the
    recent samples ignores such a step, so the policy does not keep drafting on its account (measured on the H200,
    2026-12-04: a mean with that sample kept batch 16 drafting at 16x the plain TPOT)."""
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    first = {"done": False}

    def cost(mode: bool) -> tuple[float, float]:
        if not mode and not first["done"]:
            first["done"] = True
            return (1.0, 1)  # the burst's first plain step: not counted (the pipeline changes shape)
        return (3.0, 2) if mode else (1.0, 1)

    modes = []
    for k in range(120):
        mode = policy.choose(8)
        modes.append(mode)
        policy.planned(k, 8, mode, True)
        seconds, per_row = cost(mode)
        if not mode and modes.count(False) == 2:
            seconds = 300.0  # the first counted plain step captured a graph
        clock.t += seconds
        policy.observed(k, int(8 * per_row))
    assert modes[60:].count(False) > 0.8 * 60
    assert policy.estimates[(8, False)].seconds_per_token == 1.0


def test_steps_weigh_as_many_tokens_as_they_emitted() -> None:
    """At batch 1 a verify step emits 1 to 4 tokens: here 2 s a step emitting 1, 4, 1, 4, 1, ... (0.8-0.94 s a token
    over any eight steps) against plain steps of 1 s a token. A mode's cost is its seconds over its tokens, so the
    policy drafts; the median of per-step ratios (2.0 s at every step whose drafts were all rejected) called drafting
    dearer, and at batch 1 on an H100 the policy ran 56 of 61 steps plain where drafting was 20% cheaper."""
    clock, policy = Clock(), SpecPolicy(explore=16, clock=Clock())
    policy.clock = clock
    cycle, drafted = [1, 4, 1, 4, 1], 0
    modes = []
    for k in range(200):
        mode = policy.choose(1)
        modes.append(mode)
        policy.planned(k, 1, mode, True)
        if mode:
            tokens, drafted = cycle[drafted % len(cycle)], drafted + 1
            clock.t += 2.0
        else:
            tokens = 1
            clock.t += 1.0
        policy.observed(k, tokens)
    assert modes[100:].count(True) > 0.7 * 100  # (the rest: plain steps measured again now and then)
    est = policy.estimates[(1, True)].seconds_per_token
    assert 0.79 < est < 0.95 and policy.estimates[(1, False)].seconds_per_token == 1.0


def test_intervals_with_graph_captures_are_not_counted() -> None:
    """Verify steps of a new shape capture their graphs (a batch bucket or a context span met once): two of
    drafting's first three samples with a capture would make its median, and the policy would switch drafting off
    where it is twice as cheap (measured on the H200, 2026-12-05: batch 16 ran at 5.75 ms a token against 1.78
    drafting at every step). The scheduler hands the worker's ``graph_captures`` on as ``one_time``; its own
    intervals are measured as usual."""
    for skip in (True, False):
        clock = Clock()
        policy = SpecPolicy(explore=32, clock=clock)
        modes = []
        for k in range(120):
            mode = policy.choose(16)
            modes.append(mode)
            policy.planned(k, 16, mode, True)
            capture = mode and k in (1, 2)  # drafting's first counted samples (the very first is not counted)
            clock.t += (40.0 if capture else 2.0) if mode else 1.5  # 0.5 s a token drafting, 1.5 plain
            policy.observed(k, 16 * (4 if mode else 1), one_time=capture and skip)
        if skip:
            assert modes[40:].count(True) > 0.8 * 80 and policy.estimates[(16, True)].seconds_per_token == 0.5
        else:  # (the case it guards against)
            assert modes[40:].count(False) > 0.8 * 80


def test_the_scheduler_passes_graph_captures_on() -> None:
    clock = Clock()
    cfg = SchedulerConfig(page_size=16, max_model_len=4096, eos_token_id=1, num_speculative_tokens=3, spec_explore=32)
    s = Scheduler(cfg, PagePool(512))
    s.spec_policy.clock = clock
    s.add("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    counted = []
    for k in range(12):
        plan = s.schedule(lookahead=0)
        results = [SeqResult(c.request_id, 9, extra_token_ids=[9] * c.num_drafts, num_drafts=c.num_drafts)
                   for c in plan.chunks if c.sample]  # fmt: skip
        clock.t += 1.0
        s.update(StepResult(plan.step_id, results, graph_captures=int(k % 2 == 0)))
        counted.append(sum(e.samples for e in s.spec_policy.estimates.values()))
    rises = [k for k in range(1, 12) if counted[k] > counted[k - 1]]
    assert len(rises) >= 3 and all(k % 2 for k in rises), counted  # never an interval with a capture


def test_a_batch_run_as_two_steps_is_measured_under_its_own_bucket() -> None:
    """16 decode requests whose verify steps keep them out of the next plan run as two steps of 8 rows: the choice
    is made for 16 (the batch), so the steps are measured under 16, and plain steps win there (measured on the H200,
    2026-12-04: keyed by the step's 8 rows, the choice for 16 never found a measurement and drafted at every step)."""
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    modes = []
    for k in range(150):
        mode = policy.choose(16)
        modes.append(mode)
        policy.planned(k, 8, mode, True)  # half the batch in this step
        clock.t += 3.0 if mode else 1.0
        policy.observed(k, 8 * (2 if mode else 1))
    assert modes[60:].count(False) > 0.8 * 90
    assert set(policy.estimates) == {(16, True), (16, False)}


def test_drafting_wins_when_it_is_cheaper_and_buckets_are_apart() -> None:
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    small = drive(policy, clock, 1, 150, {True: (1.2, 3), False: (1.0, 1)})  # 0.4 s a token with drafts
    large = drive(policy, clock, 40, 150, {True: (9.0, 2), False: (2.0, 1)})  # 4.5 s a token with drafts
    assert small[50:].count(True) > 0.8 * 100 and large[50:].count(False) > 0.8 * 100


def test_a_far_dearer_mode_is_measured_less_often() -> None:
    """Verify steps ten times dearer per token: the bursts that measure them again come ten times less often, so they
    take about the share of the time that a mode 1.5 times dearer takes."""
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    modes = drive(policy, clock, 2, 2000, {True: (10.0, 1), False: (1.0, 1)})
    tail = modes[100:]
    assert 0 < tail.count(True) <= 2 * BURST * len(tail) / (32 * 10)


def test_a_change_of_acceptance_is_seen() -> None:
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    drive(policy, clock, 4, 100, {True: (1.2, 3), False: (1.0, 1)})
    later = drive(policy, clock, 4, 300, {True: (1.2, 1), False: (1.0, 1)})  # the drafts stopped being right
    assert later[-100:].count(False) > 0.8 * 100


def test_idle_time_and_switches_are_not_counted() -> None:
    clock = Clock()
    policy = SpecPolicy(explore=16, clock=clock)
    for k in range(6):
        clock.t += 1000.0  # idle: nothing to run
        policy.planned(k, 2, True, True)
        clock.t += 1.0
        policy.observed(k, 2, busy=False)
    assert (2, True) not in policy.estimates  # each interval began with nothing to run
    clock.t += 1000.0
    policy.planned(10, 2, True, True)
    policy.planned(11, 2, True, True)  # two in flight
    clock.t += 1.0
    policy.observed(10, 2)  # (began idle)
    clock.t += 2.0
    policy.observed(11, 4)  # 2 s for 2 tokens a row: 1 s a token
    assert policy.estimates[(2, True)].seconds_per_token == 1.0
    policy.planned(12, 2, False, True)
    policy.planned(13, 2, False, True)
    clock.t += 5.0
    policy.observed(12, 2)  # the first step after a switch of mode: not counted
    clock.t += 0.5
    policy.observed(13, 2)
    assert policy.estimates[(2, False)].seconds_per_token == 0.5
    policy.planned(14, 2, False, False)  # a step with a prefill chunk: not a token's cost
    clock.t += 9.0
    policy.observed(14, 2)
    assert policy.estimates[(2, False)].samples == 1


def test_steps_without_decode_rows_do_not_use_up_a_burst() -> None:
    """A choice whose step goes out without decode rows (every row waits for a result), or does not go out, leaves
    the burst of the other mode to steps that use it."""
    clock = Clock()
    policy = SpecPolicy(explore=32, clock=clock)
    drive(policy, clock, 4, MIN_SAMPLES + 1, {True: (3.0, 2), False: (1.0, 1)})
    assert policy.choose(4) is False  # the plain steps' burst starts
    for k in range(10):
        assert policy.choose(4) is False
        policy.planned(100 + k, 0, False, True)  # nothing to decode
    assert policy._burst[4] == (False, BURST)
    assert policy.choose(4) is False
    policy.planned(200, 4, False, True)
    assert policy._burst[4] == (False, BURST - 1)


def test_explore_zero_always_drafts() -> None:
    policy = SpecPolicy(explore=0)
    assert all(policy.choose(n) for n in (1, 8, 64))


def test_scheduler_plans_without_drafts_while_plain_steps_are_cheaper() -> None:
    clock = Clock()
    cfg = SchedulerConfig(page_size=16, max_model_len=4096, eos_token_id=1, num_speculative_tokens=3, spec_explore=32)
    s = Scheduler(cfg, PagePool(512))
    s.spec_policy.clock = clock
    for k in range(4):
        s.add(f"r{k}", [5, 6, 7, 8 + k], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    drafted_steps = plain_steps = 0
    for _ in range(300):
        plan = s.schedule(lookahead=0)
        results = []
        for c in plan.chunks:
            if not c.sample:
                continue
            drafts = c.num_drafts
            # a verify step keeps one draft of three: 2 tokens a row for 3.0 s; a plain step 1 token for 1.0 s
            results.append(SeqResult(c.request_id, 9, extra_token_ids=[9] if drafts else [], num_drafts=drafts))
        decode = all(len(c.token_ids) == 1 or c.token_ids == [PLACEHOLDER] for c in plan.chunks)
        if decode and plan.chunks:
            if any(c.num_drafts for c in plan.chunks):
                drafted_steps += 1
                clock.t += 3.0
            else:
                plain_steps += 1
                clock.t += 1.0
        s.update(StepResult(plan.step_id, results))
    assert drafted_steps > 0 and plain_steps > 0.7 * 300
    assert s.spec.steps_off_cost > 0.7 * 300 and s.spec.steps_off_batch == 0
    est = s.spec_policy.estimates
    assert est[(4, True)].seconds_per_token > est[(4, False)].seconds_per_token


def test_a_split_batch_verifies_together_again() -> None:
    """Two requests whose prompts ran in different steps get out of phase: while one's verify step is in flight the
    other would draft alone, and they would verify in two halves for ever (measured on the H200: a batch of 16 whose
    prompts took two chunks ran as alternating verify steps of 8, twice the steps). A request that would draft while
    another verifies waits for that step, so after the first rounds they verify in one step. Driven as the engine
    loop drives it: up to two steps in flight, results in order."""
    cfg = SchedulerConfig(page_size=16, max_model_len=4096, eos_token_id=1, num_speculative_tokens=3, spec_explore=0)
    s = Scheduler(cfg, PagePool(512))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    s.add("a", [5, 6, 7, 8], params)
    flight: list = []
    verifies: list[set[str]] = []
    for k in range(200):
        if k == 1:
            s.add("b", [5, 6, 7, 9], params)  # its prompt runs while a's first step is in flight
        plan = s.schedule(lookahead=len(flight)) if len(flight) < 2 else None
        if plan is not None and plan.chunks:
            flight.append(plan)
            if any(c.num_drafts for c in plan.chunks):
                verifies.append({c.request_id for c in plan.chunks if c.num_drafts})
            continue
        if not flight:
            break
        done = flight.pop(0)
        s.update(StepResult(done.step_id, [
            SeqResult(c.request_id, 9, extra_token_ids=[9] * c.num_drafts, num_drafts=c.num_drafts)
            for c in done.chunks if c.sample
        ]))  # fmt: skip
    assert len(verifies) > 10 and all(v == {"a", "b"} for v in verifies[3:10]), verifies  # (then a ends first)
