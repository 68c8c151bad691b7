"""Speculative decoding in a worker of several ranks (``LLM(ep=2, num_speculative_tokens=N)``): each rank drafts for
its own sequences (the drafter's experts whole on every rank) and verifies them through the sharded MoE layers, and
the outputs are, request by request, those of one process without speculation: tokens and logprobs bit for bit
with the batch-invariant ops, greedy and seeded, through chunked prefill, preemptions (few pages a rank) and async
scheduling. Rank 0 drafts with an oracle that replays the plain run's continuation (most drafts kept, so rollbacks
of partly kept drafts happen there), rank 1 with the model's drafter (V4's MTP block, V4.1's DSpark; random weights:
nearly every draft rejected)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.engine import RequestOutput
from deepinfer.engine.speculative.oracle import OracleProposer

pytestmark = pytest.mark.timeout(600)
DRAFTS = 3
PROMPTS = [[(13 * i + 5 * j) % 400 + 3 for j in range(5 + 7 * i)] for i in range(4)]


def params(i: int) -> SamplingParams:
    if i >= 2:  # (seeded requests on both ranks)
        return SamplingParams(temperature=0.9, top_p=0.9, seed=70 + i, max_tokens=12, logprobs=1, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=11 + i, logprobs=2, ignore_eos=True)


def run(llm: LLM, ranks: dict[str, int] | None = None) -> list[RequestOutput]:
    """The outputs of ``PROMPTS`` as requests ``r0, r1, ..`` (the oracle knows them by these ids); ``ranks`` gets the
    rank each ran on (a data-parallel scheduler's)."""
    eng, outs = llm.engine, {}
    for k, p in enumerate(PROMPTS):
        eng.add_request(f"r{k}", p, params(k))
    while eng.has_unfinished_requests():
        if ranks is not None:
            ranks.update(eng.scheduler.rank_of)
        for o in eng.step():
            outs[o.request_id] = o
    return [outs[f"r{k}"] for k in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_speculation_over_two_ranks_changes_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     arch: str) -> None:  # fmt: skip
    """(DeepSeek-V4.1: rank 1 drafts with DSpark, its lengths chosen by confidence: ``DEEPINFER_ENABLE_MTP_VARLEN``.)"""
    monkeypatch.setenv("DEEPINFER_SPEC_DECODE_EXPLORE_STEPS", "0")  # every step drafts (no cost measurement)
    monkeypatch.setenv("DEEPINFER_EP_FIXED_BUFFER_TOKENS", "4")  # one verify row set fits (1 + 3 drafts), two do not
    model = make_tiny_model(tmp_path / "m", arch=arch, seed=5)
    kw = dict(model=model, dtype="float32", page_size=16, batch_invariant=True, max_num_batched_tokens=24,
              async_scheduling=True)  # fmt: skip
    plain = run(LLM(num_pages=64, **kw))
    if arch == "deepseek_v41":
        monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with LLM(num_pages=4, ep=2, num_speculative_tokens=DRAFTS, **kw) as llm:
        cont = {f"r{k}": PROMPTS[k] + o.outputs[0].token_ids for k, o in enumerate(plain)}
        local = llm.engine.runner.local.runner  # rank 0's runner (rank 1's drafter is its MTP block)
        local.spec = llm.family.speculator(llm.model, DRAFTS, OracleProposer(cont, 0.3, llm.config.vocab_size))
        on_rank: dict[str, int] = {}
        got = run(llm, on_rank)
        preempted = llm.engine.scheduler.num_preemptions
        fixed = llm.model.layers[0].ffn.ep.fixed.steps
    for want, out in zip(plain, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].logprobs == want.outputs[0].logprobs
    assert sorted(on_rank) == [f"r{k}" for k in range(len(PROMPTS))] and set(on_rank.values()) == {0, 1}
    usage = {r: [sum(o.usage.get(k, 0) for o in got if on_rank[o.request_id] == r)
                 for k in ("draft_tokens", "accepted_draft_tokens")] for r in (0, 1)}  # fmt: skip
    assert usage[0][0] > 0 and 0 < usage[0][1] < usage[0][0]  # rank 0: drafts verified, most of them kept
    assert usage[1][0] > 0  # rank 1: drafts verified (and rejected)
    seeded_kept = [o.usage["accepted_draft_tokens"] for k, o in enumerate(got) if params(k).seed is not None
                   and on_rank[o.request_id] == 0]  # fmt: skip
    assert seeded_kept and max(seeded_kept) > 0  # a seeded request's drafts kept
    assert preempted > 0
    assert fixed > 0  # verify steps through the fixed buffers: the plan's bound counts the drafts


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_a_prompt_joining_drafting_rows_on_a_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """The default ops (verify steps on the decode path): a prompt longer than the rings joins requests that draft.
    Such a step runs as two forwards (``deepseek_v4.verify_split``), also on a rank of a worker whose experts are
    spread over ranks: rank 0 decides that every rank runs two forwards in that step (the other rank adds an idle
    one, so that every MoE exchange meets its peer), and the tokens are one process's."""
    from deepinfer.models.deepseek_v4 import verify_split

    monkeypatch.setenv("DEEPINFER_SPEC_DECODE_EXPLORE_STEPS", "0")
    model = make_tiny_model(tmp_path / "m", arch=arch, seed=5)
    kw = dict(model=model, dtype="float32", page_size=16, max_num_batched_tokens=40, async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    asked: list[bool] = []
    real = verify_split.split
    monkeypatch.setattr(verify_split, "split", lambda *a: (lambda m: asked.append(m is not None) or m)(real(*a)))

    def staggered(llm: LLM) -> list[list[int]]:
        eng, outs, steps = llm.engine, {}, 0
        for k in range(4):
            eng.add_request(f"r{k}", PROMPTS[k], greedy)
        late = [(31 * j) % 400 + 3 for j in range(31)]  # (longer than either model's rings)
        while eng.has_unfinished_requests():
            steps += 1
            if steps == 6:
                eng.add_request("r4", late, greedy)
            for o in eng.step():
                outs[o.request_id] = o
        return [outs[f"r{k}"].outputs[0].token_ids for k in range(5)]

    plain = staggered(LLM(num_pages=64, **kw))
    with LLM(num_pages=64, ep=2, num_speculative_tokens=DRAFTS, **kw) as llm:
        got = staggered(llm)
        split = llm.model.split_steps
    assert got == plain
    assert any(asked) and split == sum(asked) > 0, (asked, split)  # rank 0 ran mixed steps as two forwards
