"""A worker of several ranks in real processes (``LLM(ep=N)``: ``parallel/launch.py``, ``parallel/rank_group.py``):
rank 0 here drives the engine, the other ranks run in their own processes (``deepinfer rank``), the MoE layers'
experts shared among them over gloo, each rank attending over its own sequences.

With the batch-invariant ops the outputs must be, request by request, the single-process engine's: tokens and
logprobs, over chunked prefill, steps mixing prefill and decode, preemptions (few pages a rank), prefix-cache hits,
greedy and seeded sampling, async scheduling, and steps in which one rank has nothing to run."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model

SHARED = list(range(40, 80))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_ranks") / "m", seed=4)


def prompts_and_params() -> tuple[list[dict], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(7):
        other = [(13 * i + 5 * j) % 400 + 3 for j in range(6 + 6 * i)]
        prompts.append({"prompt_token_ids": SHARED + list(range(5, 7 + i)) if i % 3 == 0 else other})
        params.append(SamplingParams(temperature=0, max_tokens=8 + i, logprobs=2) if i % 2 == 0 else
                      SamplingParams(temperature=0.9, top_p=0.9, seed=50 + i, max_tokens=10, logprobs=1))  # fmt: skip
    return prompts, params


def outputs(llm: LLM) -> list[tuple]:
    prompts, params = prompts_and_params()
    first = llm.generate(prompts[:3], params[:3])  # r0's prompt then is a resume point for r3 and r6
    rest = llm.generate(prompts[3:], params[3:])
    lone = llm.generate([prompts[1]], [params[1]])  # one request: the other rank idles through its steps
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens) for o in first + rest + lone]


@pytest.mark.timeout(600)
def test_a_worker_of_several_ranks_gives_one_process_outputs(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Two ranks; the sharded model itself is checked on more ranks and on V4.1 in ``test_expert_parallel.py``.)
    EPLB runs every fifth step (``DEEPINFER_EPLB_INTERVAL_STEPS``): experts move between the ranks mid-request, and
    the outputs stay the single process's; steps of at most 6 tokens a rank exchange through fixed buffers
    (``DEEPINFER_EP_FIXED_BUFFER_TOKENS``), the others their row counts, as rank 0 decides from every rank's plan."""
    kw = dict(model=model_dir, dtype="float32", page_size=16, batch_invariant=True, max_num_batched_tokens=24,
              async_scheduling=True)  # fmt: skip
    want = outputs(LLM(num_pages=64, **kw))
    monkeypatch.setenv("DEEPINFER_EPLB_INTERVAL_STEPS", "5")
    monkeypatch.setenv("DEEPINFER_EP_FIXED_BUFFER_TOKENS", "6")
    with LLM(num_pages=5, ep=2, **kw) as llm:
        got = outputs(llm)
        preempted = llm.engine.scheduler.num_preemptions
        balancer = llm.engine.runner.balancer
        held = [layer.ffn.ep.placement for layer in llm.model.layers]
        first = llm.model.layers[0].ffn.ep
        fixed, steps, agreed = first.fixed.steps, first.calls, first.fixed.agreements
        gate = llm.model.replay_gate
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert preempted > 0
    assert got[3][2] > 0, "r3 resumed from r0's resume point"
    assert balancer.rebalances >= 3 and balancer.layers_moved > 0
    assert any(sum(map(len, p.slots)) > p.n_experts for p in held)  # redundant copies placed
    assert 0 < fixed < steps  # both forms of the exchanges ran
    assert agreed == 0  # each step's form came with its plans (``rank_group.step_form``), none agreed in a forward
    # EPLB's slots per rank from the start (``launch.expert_group``): its moves kept every tensor, and the graphs
    assert gate.fixed is not None


def test_layouts_that_cannot_be_built_are_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="tp must divide ep"):
        LLM(model=model_dir, ep=3, tp=2)
    with pytest.raises(ValueError, match="dp_attention=1 with ep=2"):
        LLM(model=model_dir, ep=2, dp_attention=1)
    with pytest.raises(ValueError, match="not both"):
        LLM(model=model_dir, ep=4, tp=2, cp=2)


@pytest.mark.timeout(600)
def test_a_context_parallel_worker_gives_one_process_outputs(model_dir) -> None:
    """Two ranks in one context-parallel group (``LLM(cp=2)``: each prefill step's tokens split between them, the
    state whole on both), the batch-invariant ops, async scheduling, chunked prefill, preemptions and a prefix-cache
    hit: the single process's tokens and logprobs, request by request."""
    kw = dict(model=model_dir, dtype="float32", page_size=16, batch_invariant=True, max_num_batched_tokens=24,
              async_scheduling=True)  # fmt: skip
    want = outputs(LLM(num_pages=64, **kw))
    with LLM(num_pages=8, cp=2, **kw) as llm:
        got = outputs(llm)
        preempted = llm.engine.scheduler.num_preemptions
        split = llm.model.cp.steps
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert preempted > 0 and split > 5 and got[3][2] > 0


def _sampled_logprobs(o: object) -> list[float]:
    c = o.outputs[0]
    return [lp[t] for t, lp in zip(c.token_ids, c.logprobs)]


@pytest.mark.timeout(600)
def test_a_tensor_parallel_worker_gives_one_process_outputs(model_dir) -> None:
    """Four ranks in two tensor-parallel groups of two (``LLM(ep=4, tp=2)``: a group's ranks the same sequences,
    half the heads each; the groups their own sequences, the experts over all four), async scheduling and
    preemptions: greedy and seeded tokens equal the single process's, logprobs within fp32 rounding.
    An unseeded sampled request: the group's ranks draw the same noise, so both ranks' KV state holds the tokens
    rank 0 reports; the single process, scoring those tokens as a prompt, gives their logprobs."""
    kw = dict(model=model_dir, dtype="float32", page_size=16, batch_invariant=True, max_num_batched_tokens=24,
              async_scheduling=True)  # fmt: skip
    prompts, params = (x[:4] for x in prompts_and_params())  # (two ranks of each group share a core here)
    prompts.append({"prompt_token_ids": [11, 12, 13]})  # structured output: the group's ranks advance their matchers
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=0,
                                 so_args={"schema_type": "regex", "schema": "(ab)+c?"}))  # fmt: skip
    free = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0)
    one = LLM(num_pages=64, **kw)
    want = one.generate(prompts, params)
    with LLM(num_pages=6, ep=4, tp=2, **kw) as llm:
        got = llm.generate(prompts, params)
        sampled = llm.generate(prompts[1:2], free)
        preempted = llm.engine.scheduler.num_preemptions
    assert preempted > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(_sampled_logprobs(g), _sampled_logprobs(w))) < 1e-4
    for o, p in zip(sampled, prompts[1:2]):
        ids = p["prompt_token_ids"] + o.outputs[0].token_ids
        scored = one.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        n = len(p["prompt_token_ids"])
        ref = [lp[t] for t, lp in zip(ids[n:], scored.prompt_logprobs[n:])]
        assert max(abs(a - b) for a, b in zip(_sampled_logprobs(o), ref)) < 1e-4


@pytest.mark.timeout(300)
def test_a_dead_rank_fails_the_worker_instead_of_stalling_it(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower killed between requests: the next request fails with an error (the peer's loss, or the group's
    timeout, short here), and closing the worker does not hang."""
    monkeypatch.setenv("DEEPINFER_RANK_TIMEOUT_S", "20")
    llm = LLM(model=model_dir, dtype="float32", page_size=16, num_pages=16, batch_invariant=True, ep=2)
    try:
        assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        llm._ranks.procs[0].kill()
        llm._ranks.procs[0].wait()
        prompts = [{"prompt_token_ids": [8, 9, 10]}, {"prompt_token_ids": [11, 12]}]
        with pytest.raises(RuntimeError):
            llm.generate(prompts, SamplingParams(max_tokens=4))
    finally:
        llm.close()


def test_a_rank_counts_the_forwards_its_runner_ran(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RankRunner`` knows that a step ran a forward from its runner's count (``ModelRunner.forwards``), not from
    the exchanges its MoE layers counted, which a replayed CUDA graph does not count (it runs no Python): a busy step
    whose plan ran a forward runs no idle one, a busy step with an empty plan runs one; in a step of two forwards
    (rank 0's decision) it runs idle ones up to two, its model's split steps counted, and one that ran more is
    refused."""
    from deepinfer.engine.factory import build_worker
    from deepinfer.engine.interfaces import ChunkPlan, WorkerStepPlan
    from deepinfer.parallel.rank_group import RankRunner

    rank = RankRunner(build_worker(model_dir, "float32", "cpu", num_pages=4, page_size=16).runner)
    idle: list[int] = []
    monkeypatch.setattr(rank, "idle_forward", lambda: idle.append(1))
    plan = WorkerStepPlan(1, [ChunkPlan("a", [5, 6, 7], 0, [0], True, SamplingParams(max_tokens=2))])
    rank.runner.finish(rank.launch(plan, busy=True))
    assert idle == [] and rank.calls == 1
    rank.runner.finish(rank.launch(WorkerStepPlan(2, []), busy=True))
    assert idle == [1] and rank.calls == 1
    more = WorkerStepPlan(3, [ChunkPlan("b", [8, 9], 0, [1], True, SamplingParams(max_tokens=2))])
    rank.runner.finish(rank.launch(more, busy=True, forwards=2))
    assert idle == [1, 1] and rank.calls == 2
    model = rank.runner.model
    real = model.forward

    def splitting(*a, **kw):  # (a step its model runs as two forwards: verify_split)
        model.split_steps += 1
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", splitting)
    rank.runner.finish(rank.launch(WorkerStepPlan(4, [ChunkPlan("c", [3], 0, [2], True, SamplingParams(max_tokens=2))]),
                                   busy=True, forwards=2))  # fmt: skip
    assert idle == [1, 1] and rank.calls == 4
    with pytest.raises(RuntimeError, match="ran 2 forwards"):
        rank.launch(WorkerStepPlan(5, [ChunkPlan("d", [4], 0, [3], True, SamplingParams(max_tokens=2))]), busy=True)


def test_the_step_form_bounds_every_rank_s_tokens() -> None:
    """``step_form``: the most tokens a rank may send, drafts included, a tensor-parallel rank's share, an idle
    rank's one; fixed buffers only where every rank fits."""
    from deepinfer.engine.interfaces import ChunkPlan, WorkerStepPlan
    from deepinfer.parallel.layout import Layout
    from deepinfer.parallel.rank_group import step_form

    def plan(*chunks: tuple[int, int]) -> WorkerStepPlan:
        return WorkerStepPlan(1, [ChunkPlan(f"r{i}", [5] * n, 0, [0], True, SamplingParams(), num_drafts=d)
                                  for i, (n, d) in enumerate(chunks)])  # fmt: skip

    two = Layout(ranks=2)
    assert step_form([plan((1, 3), (1, 3)), plan()], two, 8) is True  # 2 x (1 + 3) rows
    assert step_form([plan((1, 3), (1, 3)), plan()], two, 7) is False
    assert step_form([plan((5, 0)), plan((9, 0))], two, 8) is False  # the other rank's prompt
    assert step_form([plan((9, 0))], Layout(ranks=2, tp=2), 5) is True  # each rank sends 5 of the 9
    assert step_form([plan(), plan()], two, 1) is True and step_form([plan()], two, 0) is None
