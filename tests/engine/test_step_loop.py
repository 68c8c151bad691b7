"""The engine loop (``engine.step_loop.StepLoop``) and the one stop-string path (``tokenizer.TextStream``)."""

from __future__ import annotations

import pytest

from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.step_loop import StepLoop, Turn
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import TextStream, encode_ids, load_tokenizer
from engine.test_scheduler import FakeWorker, make_scheduler


def _scheduler_with(n: int, max_tokens: int = 4):
    sched = make_scheduler(num_pages=64)
    for i in range(n):
        sched.add(f"r{i}", [10 + i] * 3, SamplingParams(temperature=0, max_tokens=max_tokens))
    return sched


def test_depth_one_sends_then_receives_each_step() -> None:
    sched = _scheduler_with(2)
    loop, worker = StepLoop(sched, depth=1), FakeWorker(sched)
    turns = []
    while loop.busy:
        turn = loop.turn(worker.waits_for_tokens)
        turns.append(turn)
        if turn is Turn.SEND:
            worker.send(loop.plan)
        elif turn is Turn.RECEIVE:
            loop.received(worker.receive())
    assert turns[:4] == [Turn.SEND, Turn.RECEIVE, Turn.SEND, Turn.RECEIVE]
    assert all(a != b for a, b in zip(turns, turns[1:]))  # never two in flight
    assert all(sched.requests[f"r{i}"].finish_reason == "length" for i in range(2))
    assert loop.turn() is Turn.IDLE


def test_depth_two_plans_ahead_and_a_plan_that_waits_for_tokens_is_held() -> None:
    sched = _scheduler_with(1, max_tokens=6)
    loop, worker = StepLoop(sched, depth=2), FakeWorker(sched)
    assert loop.turn() is Turn.SEND
    worker.send(loop.plan)
    assert loop.turn() is Turn.SEND and len(loop.in_flight) == 2  # the next step, planned before the first's result
    worker.send(loop.plan)
    assert loop.turn() is Turn.RECEIVE  # full
    loop.received(worker.receive())
    # the runner says the next plan needs the tokens of the step in flight: it is held until that step is received
    asked: list[WorkerStepPlan] = []
    assert loop.turn(lambda p: asked.append(p) or True) is Turn.RECEIVE and len(asked) == 1
    assert len(loop.in_flight) == 1
    loop.received(worker.receive())
    assert loop.turn(lambda p: pytest.fail("a held plan is not asked again")) is Turn.SEND
    assert loop.plan is asked[0]


def test_a_result_out_of_order_is_refused_and_forget_empties_the_pipeline() -> None:
    sched = _scheduler_with(1)
    loop = StepLoop(sched, depth=2)
    assert loop.turn() is Turn.SEND and loop.turn() is Turn.SEND
    second = loop.in_flight[1].step_id
    with pytest.raises(RuntimeError, match=f"step {second} answered"):
        loop.received(StepResult(second))
    loop.forget()
    assert not loop.in_flight and loop.plan is None
    with pytest.raises(ValueError, match="depth"):
        StepLoop(sched, depth=0)


def _stream(tok, text_ids: list[int], **kw) -> tuple[TextStream, list[str | None]]:
    """The stream fed until it reports a stop string (as its users stop there)."""
    s, stops = TextStream(tok, SamplingParams(**kw)), []
    for t in text_ids:
        stops.append(s.add(t))
        if stops[-1] is not None:
            break
    return s, stops


def test_text_stream_stop_rules() -> None:
    tok = load_tokenizer()
    ids = encode_ids(tok, "Hello world, stop here and more")
    s, stops = _stream(tok, ids, stop=["stop"])
    assert "stop" in stops and s.text == "Hello world, " and s.stopped_by == "stop"
    s, stops = _stream(tok, ids, stop=["stop"], include_stop_str_in_output=True)
    assert s.text == "Hello world, stop"
    # not before min_tokens are out: a stop string that ended early is never acted on later
    n_before = next(i for i, st in enumerate(_stream(tok, ids, stop=["stop"])[1]) if st) + 1
    s, stops = _stream(tok, ids, stop=["stop"], min_tokens=n_before + 1, max_tokens=64)
    assert not any(stops) and s.text == "Hello world, stop here and more"
    # the token that ended generation by itself is not checked
    s = TextStream(tok, SamplingParams(stop=["more"]))
    for t in ids[:-1]:
        assert s.add(t) is None
    assert s.add(ids[-1], ends=True) is None and s.text.endswith("more")


def test_text_stream_holds_back_what_could_become_a_stop_string() -> None:
    tok = load_tokenizer()
    ids = encode_ids(tok, "abcdefgh")
    s = TextStream(tok, SamplingParams(stop=["xyz1"]))  # 4 characters: the last 3 wait
    sent = ""
    for t in ids:
        s.add(t)
        sent += s.delta(done=False)
    assert sent == s.text[: len(s.text) - 3] and s.delta(done=True) == s.text[-3:]
    assert s.delta(done=True) == ""
