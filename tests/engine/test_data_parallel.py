"""Attention data parallelism in the engine (``engine/data_parallel.py``): one scheduler per rank behind the engine
loop, each rank its own runner, pages, prefix cache and preemptions, against one runner serving everything.

With the batch-invariant ops a request's tokens and logprobs do not depend on which other requests shared its steps,
so the data-parallel engine must give, request by request, exactly what the single engine gives: over chunked
prefill, steps mixing prefill and decode, preemption (few pages per rank), prefix-cache hits, greedy and seeded
sampling, async scheduling. The ranks' runners are in this process here; a worker's ranks in their own processes
take the same plans."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.data_parallel import DataParallelScheduler, RankedPlan, RanksInProcess
from deepinfer.engine.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

SHARED = list(range(40, 80))  # r0's prompt is a prefix of r3's and r6's: they resume from its resume point


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dp") / "m", seed=3)


def llm(model_dir, pages: int) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=pages, page_size=16, batch_invariant=True,
               max_num_batched_tokens=24, async_scheduling=True)  # fmt: skip


def requests() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(8):
        prompt = (
            SHARED + list(range(5, 7 + i)) if i % 3 == 0 else [(11 * i + 7 * j) % 500 + 3 for j in range(9 + 5 * i)]
        )
        p = (SamplingParams(temperature=0, max_tokens=10 + i, logprobs=2) if i % 2 == 0 else
             SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, logprobs=1))  # fmt: skip
        out.append((prompt, p))
    return out


def run(engine: LLMEngine, reqs: list) -> dict[str, tuple]:
    outs = {}
    for i, (prompt, p) in enumerate(reqs):
        if i == 3:  # the first shared-prefix request has stored its resume point before the next one arrives
            while engine.has_unfinished_requests():
                outs.update({o.request_id: o for o in engine.step()})
        engine.add_request(f"r{i}", prompt, p)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    return {k: (o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens) for k, o in outs.items()}


def test_data_parallel_ranks_give_the_single_engines_outputs(model_dir) -> None:
    single = llm(model_dir, 64)
    want = run(single.engine, requests())
    ranks = [llm(model_dir, 6), llm(model_dir, 6)]  # few pages per rank: requests get preempted
    config = ranks[0].engine.scheduler.config
    dp = DataParallelScheduler(config, 6, 2)
    runner = RanksInProcess([r.engine.runner for r in ranks])
    sent = []
    real = runner.send
    runner.send = lambda plan: sent.append(plan) or real(plan)
    engine = LLMEngine(dp, runner, ranks[0].tokenizer, ranks[0].config.vocab_size, async_scheduling=True)
    got = run(engine, requests())
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}
    used = {r for plan in sent for r, sub in enumerate(plan.ranks) if sub.chunks}
    assert used == {0, 1}, "both ranks ran requests"
    assert all(isinstance(p, RankedPlan) and len(p.ranks) == 2 for p in sent)
    assert dp.num_preemptions > 0, "the small page pools preempted"
    assert got["r3"][2] > 0 and want["r3"][2] > 0, "the shared-prefix request resumed from r0's resume point"


def test_placement_prefers_the_rank_holding_the_prefix_then_the_least_loaded(model_dir) -> None:
    from deepinfer.engine.scheduler_config import SchedulerConfig

    config = SchedulerConfig(page_size=16, max_model_len=512, eos_token_id=1, max_num_seqs=8,
                             max_num_batched_tokens=64, prefix_caching=True)  # fmt: skip
    dp = DataParallelScheduler(config, 32, 3)
    dp.add("a", list(range(3, 40)), SamplingParams(max_tokens=4))
    dp.add("b", list(range(3, 20)), SamplingParams(max_tokens=4))
    dp.add("c", list(range(3, 10)), SamplingParams(max_tokens=4))
    assert [dp.rank_of[x] for x in "abc"] == [0, 1, 2]  # each to the least loaded
    dp.add("d", [7, 8], SamplingParams(max_tokens=4))
    assert dp.rank_of["d"] == 2  # the fewest tokens left
    with pytest.raises(ValueError, match="already in use"):
        dp.add("a", [5, 6], SamplingParams(max_tokens=4))
