"""Async scheduling in the offline engine and the worker runtime (``LLMEngine(async_scheduling=True)``).

Step N+1 is planned and launched before step N's tokens are collected: decoding requests continue on placeholders
that ``ModelRunner`` fills on the device from step N's samples (``ForwardBatch.substitute``). The outputs must be
those of the synchronous engine — tokens, logprobs, top logprobs, prompt logprobs, finish reasons, structured
outputs — and the launches must really run ahead (a launch before the previous step's collection, with placeholders
taken on the device).
"""

from __future__ import annotations

import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.interfaces import PLACEHOLDER, ChunkPlan, WorkerStepPlan
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.state import SequenceState

PROMPTS = [
    "Once upon a time",
    {"prompt_token_ids": [0, 17, 4242, 99, 5, 6, 7]},
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hi",
]


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=17, logprobs=1),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=3, stop=["e"]),
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=14),
        SamplingParams(
            temperature=0.7, seed=3, max_tokens=10, so_args={"schema_type": "regex", "schema": "[a-c]{3,6}"}
        ),
    ]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_async") / "m", seed=0)


def outputs(llm: LLM) -> list[tuple]:
    out = llm.generate(PROMPTS, params())
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason, o.outputs[0].text,
         o.prompt_logprobs)
        for o in out
    ]  # fmt: skip


class Trace:
    """Records the runner's launches and collections, and how many placeholders each launch took on the device."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = llm.engine.runner
        self.calls: list[tuple[str, int]] = []
        self.on_device: list[int] = []
        launch, finish, substitute = runner.launch, runner.finish, ForwardBatch.substitute

        def traced_launch(plan):
            self.calls.append(("launch", plan.step_id))
            return launch(plan)

        def traced_finish(step):
            self.calls.append(("finish", step.result.step_id))
            return finish(step)

        def traced_substitute(batch, at, sources):
            self.on_device.append(len(at))
            return substitute(batch, at, sources)

        monkeypatch.setattr(runner, "launch", traced_launch)
        monkeypatch.setattr(runner, "finish", traced_finish)
        monkeypatch.setattr(ForwardBatch, "substitute", traced_substitute)

    def ahead(self) -> int:
        """Launches made while an earlier step was still uncollected."""
        open_, n = set(), 0
        for kind, sid in self.calls:
            if kind == "launch":
                n += bool(open_)
                open_.add(sid)
            else:
                open_.discard(sid)
        return n


def check_async_equals_sync(model_dir, monkeypatch, **kw) -> None:
    sync = outputs(LLM(model=model_dir, async_scheduling=False, **kw))
    llm = LLM(model=model_dir, async_scheduling=True, **kw)
    trace = Trace(llm, monkeypatch)
    got = outputs(llm)
    for a, b in zip(got, sync):
        assert a == b
    assert got[4][2] == "length" or len(got[4][0]) >= 3
    launches = sum(k == "launch" for k, _ in trace.calls)
    assert trace.ahead() >= launches // 2, trace.calls  # most steps launched before the previous one's tokens
    assert sum(trace.on_device) >= 10  # decode tokens taken from the previous step's samples on the device
    runner = llm.engine.runner
    assert set(runner.sampled) <= set(runner.states) and not llm.engine.has_unfinished_requests()
    assert all(isinstance(t, int) for t in runner.sampled.values())  # every step collected


def test_async_engine_gives_the_synchronous_outputs(model_dir, monkeypatch) -> None:
    """Batch-invariant numerics: async scheduling changes batch compositions (a row for a request that stopped on
    EOS), which moves logprobs by float rounding otherwise."""
    check_async_equals_sync(model_dir, monkeypatch, dtype="float32", num_pages=128, page_size=16, batch_invariant=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_async_engine_gives_the_synchronous_outputs(model_dir, monkeypatch) -> None:
    """On the GPU the launches truly overlap: the graphs and the sampling kernels read placeholders filled by the
    device."""
    check_async_equals_sync(model_dir, monkeypatch, accelerator="nvidia", batch_invariant=True, num_pages=128,
                            page_size=16)  # fmt: skip


def test_structured_rows_launch_ahead_and_accept_each_token_once(model_dir, monkeypatch) -> None:
    """A constrained request's next step is launched before the previous step's tokens are collected (the masks wait
    for them at sampling: ``engine.pending_tokens``), each sampled token is accepted by its matcher exactly once, and
    the outputs are the synchronous engine's."""
    from deepinfer.engine.constraints import ConstraintSet

    kw = dict(dtype="float32", num_pages=64, page_size=16, batch_invariant=True)
    ps = [SamplingParams(temperature=0.8, seed=5, max_tokens=12, so_args={"schema_type": "regex", "schema": s})
          for s in ("(ab)+c?", "[a-c]{4,8}")] + [SamplingParams(temperature=0, max_tokens=10)]  # fmt: skip
    prompts = ["Hi", "Once upon a time", "The quick brown fox"]
    sync = [o.outputs[0] for o in LLM(model=model_dir, async_scheduling=False, **kw).generate(prompts, ps)]
    llm = LLM(model=model_dir, async_scheduling=True, **kw)
    trace, accepted = Trace(llm, monkeypatch), []
    accept = ConstraintSet.accept
    monkeypatch.setattr(ConstraintSet, "accept",
                        lambda cs, rid, t: (rid in cs and accepted.append((rid, t))) or accept(cs, rid, t))  # fmt: skip
    got = [o.outputs[0] for o in llm.generate(prompts, ps)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                      for o in sync]  # fmt: skip
    assert re.fullmatch("(ab)+c?", got[0].text) and re.fullmatch("[a-c]{4,8}", got[1].text), [o.text for o in got]
    launches = sum(k == "launch" for k, _ in trace.calls)
    assert trace.ahead() >= launches // 2, trace.calls  # the constrained rows did not hold the pipeline
    runner = llm.engine.runner
    assert not runner.pending.steps and all(isinstance(t, int) for t in runner.sampled.values())
    assert len({r for r, _ in accepted}) == 2
    for rid in {r for r, _ in accepted}:  # every token its request kept, accepted once and in order
        tokens = [t for r, t in accepted if r == rid]
        # (plus at most one: a step launched before the request's last token was known, as for any decode row)
        assert any(tokens[: len(o.token_ids)] == o.token_ids and len(tokens) <= len(o.token_ids) + 1 for o in got)


def test_substitute_reads_device_samples_of_several_steps() -> None:
    states = [SequenceState() for _ in range(3)]
    chunks = [SeqChunk(s, 0, n, torch.zeros(1, dtype=torch.long)) for s, n in zip(states, (2, 1, 1))]
    batch = ForwardBatch.build(chunks, [[5, 0], [0], [9]], "cpu")
    a, b = torch.tensor([40, 41, 42]), torch.tensor([70, 71])
    batch.substitute([1, 2], [(a, 2), (b, 0)])
    assert batch.token_ids.tolist() == [5, 42, 70, 9] and batch.host_token_ids is None
    assert batch.positions.tolist() == [0, 1, 0, 0]
    for at, rows, want in (([0, 1, 2], [0, 1, 2], [40, 41, 42, 9]),  # consecutive rows: one slice copy
                           ([1, 2], [1, 2], [5, 41, 42, 9]),
                           ([0, 2], [2, 0], [42, 0, 40, 9]),  # neither consecutive nor in order: by index
                           ([0, 1], [2, 1], [42, 41, 0, 9])):  # fmt: skip
        batch = ForwardBatch.build(chunks, [[5, 0], [0], [9]], "cpu")
        batch.substitute(at, [(a, r) for r in rows])
        assert batch.token_ids.tolist() == want, (at, rows)


def test_a_placeholder_without_a_sampled_token_is_refused(model_dir) -> None:
    llm = LLM(model=model_dir, dtype="float32", num_pages=16, page_size=16)
    runner = llm.engine.runner
    plan = WorkerStepPlan(1, chunks=[ChunkPlan("x", [PLACEHOLDER], 0, [0], True, SamplingParams(temperature=0))])
    with pytest.raises(ValueError, match=r"chunks.token_ids: request 'x' has no sampled token"):
        runner.launch(plan)
    assert "x" not in runner.states


def test_abort_with_a_step_in_flight(model_dir) -> None:
    """An abort while the request's next step is launched: the other request's tokens are unchanged, the aborted
    one's late result is dropped, and every page comes back."""
    kw = dict(dtype="float32", num_pages=64, page_size=16, batch_invariant=True)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(model=model_dir, async_scheduling=False, **kw).generate([{"prompt_token_ids": [9, 8, 7, 6]}], p)
    llm = LLM(model=model_dir, async_scheduling=True, **kw)
    eng = llm.engine
    eng.add_request("a", [0, 17, 4242, 99, 5], p)
    eng.add_request("b", [9, 8, 7, 6], p)
    for _ in range(4):
        eng.step()
    assert eng.runner.launched and "a" in {c.request_id for plan in eng.loop.in_flight for c in plan.chunks}
    (aborted,) = eng.abort_request(["a"])
    assert aborted.outputs[0].finish_reason == "abort"
    done = []
    while eng.has_unfinished_requests():
        done += eng.step()
    assert [o.request_id for o in done] == ["b"]
    assert done[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    while eng.scheduler.has_pending_releases or eng.has_unfinished_requests():
        eng.step()  # the last releases travel with a plan
    pages = eng.scheduler.pages
    assert pages.num_free == pages.num_total and eng.runner.states == {} and eng.runner.sampled == {}
