"""The start-up warm-up (``engine.warmup``): synthetic requests through the model runner, on the tiny V4 on CPU.

It runs the prefill and decode sizes it is given (skipping those the pages or the model length cannot hold),
leaves no state in the runner, and a warmed engine answers exactly as a cold one. The factory warms only the
nvidia backend (``DEEPINFER_WARMUP``); on a GPU the same path compiles the kernels and captures the decode graphs
(``tests/kernels/test_graphs.py`` checks the graphs themselves).
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine import warmup
from deepinfer.engine.interfaces import ChunkPlan, WorkerStepPlan
from deepinfer.engine.warmup import decode_sizes, warm_up
from deepinfer.llm import LLM
from deepinfer.runtime.decode_graphs import BUCKETS
from deepinfer.runtime.piecewise_graphs import prefill_buckets
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

PAGES, PAGE, LIMIT = 24, 16, 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_warmup") / "m", seed=0)


def _llm(model_dir) -> LLM:
    return LLM(model_dir, accelerator="cpu", num_pages=PAGES, page_size=PAGE, max_model_len=LIMIT)


def _answers(llm: LLM) -> list[list[int]]:
    prompts = ["Once upon a time", {"prompt_token_ids": [0, 17, 4242, 99, 5, 6, 7]}, "Hi"]
    params = [SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=0.8, seed=3, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=5)]  # fmt: skip
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_warm_up_runs_its_sizes_and_leaves_nothing(model_dir, monkeypatch):
    cold, warm = _llm(model_dir), _llm(model_dir)
    runner = warm.engine.runner
    plans = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda plan: plans.append(plan) or execute(plan))
    report = warm_up(runner, PAGES, PAGE, LIMIT, warm.config.vocab_size, batches=[1, 4, 32], prefill_tokens=[40, 10**6])
    # 10**6 tokens: clipped to 255, 16 pages (fits); batch 32 needs 32 pages of 24: skipped
    assert set(report) == {"prefill_40", "prefill_255", "decode_1", "decode_4"}
    assert not runner.states and not runner.tables and not runner.sampled
    sizes = [(len(p.chunks), [len(c.token_ids) for c in p.chunks]) for p in plans]
    assert sizes[:2] == [(1, [40]), (1, [255])]
    steps = 1 + warmup.DECODES
    assert sizes[2 : 2 + steps] == [(4, [warmup.PROMPT] * 4)] + [(4, [1] * 4)] * warmup.DECODES  # largest first
    assert sizes[2 + steps :] == [(1, [warmup.PROMPT])] + [(1, [1])] * warmup.DECODES
    decode = plans[1 + steps].chunks
    assert [c.start for c in decode] == [warmup.PROMPT + warmup.DECODES - 1] * 4
    assert len({tuple(c.block_table) for c in decode}) == 4 and all(
        c.request_id.startswith("__warmup__") for c in decode
    )
    monkeypatch.undo()
    assert _answers(warm) == _answers(cold)  # the pages it wrote are rewritten before anything reads them


def test_warm_up_runs_verify_steps_of_its_sizes(model_dir, monkeypatch):
    """With speculative decoding the warm-up also runs a verify step per size it is given (the drafts of a fixed
    drafter, put in the runner for that step only) and the model's own drafter's passes at that size (observe 1, 2
    and 4 rows per sequence, then draft: what its graphs capture on a GPU), and leaves nothing behind in the runner
    or its speculator."""
    llm = LLM(model_dir, accelerator="cpu", num_pages=PAGES, page_size=PAGE, max_model_len=LIMIT,
              num_speculative_tokens=3)  # fmt: skip
    runner = llm.engine.runner
    own = runner.spec
    verifier = llm.family.speculator(llm.model, own.max_drafts, warmup.FixedDrafts())
    results = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda plan: results.append((plan, execute(plan))) or results[-1][1])
    observed = []  # the drafter's observe passes its warm_graphs runs (batch, rows per sequence)
    observe = own.drafter.observe_rows

    warm, warming = own.warm_graphs, []

    def observe_rows(h, ids, counts, *a):
        if warming:
            observed.append((len(counts), counts))
        return observe(h, ids, counts, *a)

    def warm_graphs(states):
        warming.append(1)
        try:
            return warm(states)
        finally:
            warming.clear()

    monkeypatch.setattr(own.drafter, "observe_rows", observe_rows)
    monkeypatch.setattr(own, "warm_graphs", warm_graphs)
    report = warm_up(runner, PAGES, PAGE, LIMIT, llm.config.vocab_size, batches=[1, 2], verifier=verifier,
                     verify_batches=[2, 4])  # fmt: skip
    assert set(report) == {"decode_4", "verify_4", "decode_2", "verify_2", "decode_1"}
    verify = [(p, r) for p, r in results if any(c.num_drafts for c in p.chunks)]
    assert [len(p.chunks) for p, _ in verify] == [4, 2]
    assert all(s.num_drafts == 3 for _, r in verify for s in r.results)  # every sequence verified 3 drafts
    assert runner.spec is own and not runner.states and not runner.sampled
    assert not own.carry and not own.heads and not verifier.carry and not verifier.heads
    assert observed == [(4, [1] * 4), (4, [2] * 4), (4, [4] * 4), (2, [1] * 2), (2, [2] * 2), (2, [4] * 2)]


def test_decode_sizes_follow_the_graph_buckets():
    assert decode_sizes(256, 256, BUCKETS) == list(BUCKETS)
    assert decode_sizes(48, 256, BUCKETS) == [1, 2, 4, 8, 16, 24, 32, 48]
    assert decode_sizes(256, 20, BUCKETS) == [1, 2, 4, 8, 16]


def test_the_factory_warms_only_the_nvidia_backend(model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **kw: calls.append(a))
    _llm(model_dir)
    assert calls == []  # cpu: nothing to compile or capture


@pytest.mark.parametrize(("prefill_graphs", "batched"), [(True, 8192), (True, 5000), (False, 8192)])
def test_the_warm_up_runs_every_prefill_bucket_that_replays(monkeypatch, prefill_graphs, batched):
    """With piecewise prefill graphs the factory's warm-up runs a prefill of each token bucket a step of up to
    ``DEEPINFER_MAX_NUM_BATCHED_TOKENS`` may run in (none is captured while serving, where a capture stalls every
    request); without them only the long-prefill tiles (2048 and the step's limit)."""
    from types import SimpleNamespace

    from deepinfer.engine import factory
    from deepinfer.runtime.piecewise_graphs import prefill_bucket

    monkeypatch.setenv("DEEPINFER_MAX_NUM_BATCHED_TOKENS", str(batched))
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "4")
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **kw: calls.append(a))
    ops = SimpleNamespace(cuda_graphs=True, prefill_graphs=prefill_graphs, invariant_by_sequence=False)
    runner = SimpleNamespace(spec=None, model=SimpleNamespace(piecewise_prefill=True))
    family = SimpleNamespace(decode_buckets=(1, 2, 4, 8))
    factory._warm_up(runner, family, ops, 1000, 64, 100_000, 1000)
    (args,) = calls
    assert args[5] == [1, 2, 4]  # the decode buckets up to DEEPINFER_MAX_NUM_SEQS
    want = {2048, batched} | ({prefill_bucket(n, 8192) for n in range(1, batched + 1)} if prefill_graphs else set())
    assert set(args[6]) == want


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA (the graphs)"
)
def test_gpu_warm_up_leaves_every_bucket_captured(model_dir, monkeypatch):
    """On a GPU the factory warms up: every decode bucket up to ``DEEPINFER_MAX_NUM_SEQS`` stays captured (the
    largest first, so the state pool grows once) and every prefill token bucket up to the model's length, and
    requests afterwards capture nothing: prompts of several lengths, alone and together."""
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "32")
    llm = LLM(model_dir, accelerator="nvidia", num_pages=256, page_size=64, max_model_len=1024)
    graphs, pieces = llm.model.decode_graphs, llm.model.prefill_graphs
    assert sorted(k[0] for k in graphs.buckets) == [1, 2, 4, 8, 16, 24, 32] and not graphs.failures
    assert sorted({k[0] for k in pieces.buckets}) == prefill_buckets(8192, 1023) and not pieces.failures
    held, held_pieces = len(graphs.buckets), pieces.captures
    params = SamplingParams(temperature=0, max_tokens=6)
    llm.generate([{"prompt_token_ids": [5 + i, 17, 99]} for i in range(12)], params)
    llm.generate([{"prompt_token_ids": [(7 * j + i) % 500 + 5 for j in range(n)]} for i, n in
                  enumerate((40, 300, 700, 130, 1000))], params)  # fmt: skip
    assert len(graphs.buckets) == held and graphs.replays > 0
    assert pieces.captures == held_pieces and pieces.replays > 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA (the graphs)"
)
def test_gpu_warm_up_captures_the_verify_steps(model_dir, tiny_v41_dir, monkeypatch):
    """With speculative decoding the factory's warm-up also runs verify steps (the fixed drafter put in for them,
    the model's own drafter back afterwards): their graphs are captured before serving (the decode-path verify graphs
    and, V4, the MTP drafter's), and speculative requests afterwards capture nothing of a warmed batch. Both families
    (V4's MTP, V4.1's DSpark)."""
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("DEEPINFER_SPEC_DECODE_EXPLORE_STEPS", "0")
    for path in (model_dir, tiny_v41_dir):
        llm = LLM(path, accelerator="nvidia", num_pages=256, page_size=64, max_model_len=1024,
                  num_speculative_tokens=2)  # fmt: skip
        # V4.1: every prefill step DSpark follows runs eagerly (the piecewise graphs return no features)
        pieces = llm.model.prefill_graphs
        assert path != model_dir or pieces is not None and pieces.captures > 0 and not pieces.failures
        assert llm.engine.runner.spec.proposer is None  # the model's own drafter serves
        held = pieces and pieces.captures
        # captured by the warm-up
        kinds = ("verify", "draft", "observe") if path == model_dir else ("verify", "decode", "draft", "observe")
        spec = {k: getattr(llm.model, f"{k}_graphs") for k in kinds}
        assert all(g is not None and g.captures > 0 and not g.failures for g in spec.values()), spec
        before = {k: g.captures for k, g in spec.items()}
        outs = llm.generate([{"prompt_token_ids": [5 + i, 17, 99]} for i in range(4)],
                            SamplingParams(temperature=0, max_tokens=8))  # fmt: skip
        assert all(o.usage.get("draft_tokens", 0) > 0 for o in outs)
        assert (pieces and pieces.captures) == held, (pieces, held)
        assert {k: g.captures for k, g in spec.items()} == before
        assert all(g.replays > 0 for g in spec.values())


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA (the graphs)"
)
def test_gpu_a_result_reports_the_graphs_captured_before_it(model_dir, monkeypatch):
    """Without the warm-up the first decode step of a batch captures its bucket: its result says so
    (``graph_captures``, which the scheduler's speculation policy does not count as a step's cost); the next
    replays and reports none."""
    monkeypatch.setenv("DEEPINFER_WARMUP", "0")
    llm = LLM(model_dir, accelerator="nvidia", num_pages=64, page_size=64, max_model_len=512)
    runner, params = llm.engine.runner, SamplingParams(temperature=0, max_tokens=8)
    got = runner.execute(WorkerStepPlan(1, [ChunkPlan("a", [5, 17, 99], 0, [0], True, params)]))
    captured = [got.graph_captures]
    for k in range(2):
        got = runner.execute(WorkerStepPlan(2 + k, [ChunkPlan("a", [got.results[0].token_id], 3 + k, [0], True,
                                                              params)]))  # fmt: skip
        captured.append(got.graph_captures)
    assert captured[1] >= 1 and captured[2] == 0, captured
