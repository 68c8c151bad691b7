"""Speculative decoding in the offline engine (issue 38): a run with drafts verified emits exactly the tokens of a
run without, greedy and seeded, whatever the drafts are worth — the model's MTP block (random weights: few kept),
and an oracle that replays the plain run's continuation with a set error rate (0: nearly every draft kept, 1: none).
Around it: max_tokens and stop tokens / strings landing inside a verify step, prefix-cache hits (the drafter lags
and catches up), preemption under a tight page pool, structured output (drafts cut and rows masked by the grammar),
logprobs, usage and the
scheduler's counters, the batch limit that switches drafting off, and the checkpoints that cannot draft refusing
(DeepSeek-V4.1's DSpark: tests/engine/test_speculative_v41.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.engine import RequestOutput
from deepinfer.engine.factory import constraint_set
from deepinfer.engine.speculative.grammar import allows, constrain
from deepinfer.engine.speculative.oracle import OracleProposer
from deepinfer.engine.speculative.stats import SpecStats

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_thread")]
PROMPTS = [[0, 17, 4242, 99, 5, 6, 7], [5, 9, 11], list(range(100, 140)), [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=3, max_tokens=20, logprobs=2, ignore_eos=True)
DRAFTS = 4


@pytest.fixture(scope="module", autouse=True)
def always_draft():
    """Every step under the batch limit drafts: the counts these tests compare do not depend on measured step times
    (the cost policy has its own tests, tests/engine/test_spec_policy.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_SPEC_DECODE_EXPLORE_STEPS", "0")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec_engine") / "m", seed=0)


def engine(model_dir: Path, drafts: int, **kw) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=kw.pop("num_pages", 128), page_size=16,
               num_speculative_tokens=drafts, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def base(model_dir: Path) -> LLM:
    return engine(model_dir, 0)


@pytest.fixture(scope="module")
def spec(model_dir: Path) -> LLM:
    return engine(model_dir, DRAFTS)


def plain_runs(base: LLM) -> Callable[[SamplingParams], tuple[RequestOutput, ...]]:
    """The plain run of ``PROMPTS`` under ``GREEDY`` or ``SEEDED`` on ``base`` (a non-speculative engine), computed
    once per module and shared by the tests that compare against it: the same engine, prompts and params, under the
    module's settings (a test that changes a setting before its reference runs its own). Its outputs are the same
    whichever test runs it first, prefix-cache hits or not; the tests only read them (a tuple: not to be mutated)."""
    memo: dict[int, tuple[RequestOutput, ...]] = {}

    def get(params: SamplingParams) -> tuple[RequestOutput, ...]:
        assert params is GREEDY or params is SEEDED  # (other params: the test runs its own)
        if id(params) not in memo:
            memo[id(params)] = tuple(run(base, params))
        return memo[id(params)]

    return get


@pytest.fixture(scope="module")
def reference(base: LLM) -> Callable[[SamplingParams], tuple[RequestOutput, ...]]:
    return plain_runs(base)


def run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list:
    """The outputs of ``prompts`` as requests ``r0, r1, ..`` (the oracle knows them by these ids)."""
    eng, outs = llm.engine, {}
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for k, (p, sp) in enumerate(zip(prompts, plist)):
        eng.add_request(f"r{k}", p, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    return [outs[f"r{k}"] for k in range(len(prompts))]


def oracle(llm: LLM, plain: Sequence[RequestOutput], error_rate: float, prompts: list[list[int]] = PROMPTS) -> None:
    """Give ``llm`` a drafter that replays ``plain``'s continuations with ``error_rate`` wrong drafts."""
    cont = {f"r{k}": prompts[k] + o.outputs[0].token_ids for k, o in enumerate(plain)}
    proposer = OracleProposer(cont, error_rate, llm.config.vocab_size)
    llm.engine.runner.spec = llm.family.speculator(llm.model, DRAFTS, proposer)


def assert_same(a: Sequence[RequestOutput], b: Sequence[RequestOutput], logprob_tol: float = 1e-4) -> None:
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
        assert y.outputs[0].text == x.outputs[0].text
        for u, v in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert u.keys() == v.keys() and max(abs(u[t] - v[t]) for t in u) <= logprob_tol


def drafted(outs: Sequence[RequestOutput]) -> tuple[int, int]:
    return (
        sum(o.usage.get("draft_tokens", 0) for o in outs),
        sum(o.usage.get("accepted_draft_tokens", 0) for o in outs),
    )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_drafts_change_no_token(reference: Callable, spec: LLM, params: SamplingParams) -> None:
    spec.engine.runner.spec = spec.family.speculator(spec.model, DRAFTS)
    ref, fast = reference(params), run(spec, params)
    assert_same(ref, fast)
    drafts, kept = drafted(fast)
    assert drafts > 0 and 0 <= kept <= drafts
    assert all("draft_tokens" not in o.usage for o in ref)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_early_drafts_are_the_next_steps_drafts(spec: LLM, params: SamplingParams,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The MTP drafts queued as a verify step settles (``DEEPINFER_SPEC_EARLY_DRAFTS``) are those the next step
    would draft when launched: every step proposes the same drafts either way, so the outputs and the kept counts
    are the same; with it on, the verify steps after the first take theirs from the early drafts."""
    got = {}
    for on in (False, True):
        monkeypatch.setenv("DEEPINFER_SPEC_EARLY_DRAFTS", "1" if on else "0")
        sp = spec.family.speculator(spec.model, DRAFTS)
        proposed, propose = [], sp.propose

        def recorded(*a, propose=propose, proposed=proposed):
            out = propose(*a)
            proposed.append(out)
            return out

        sp.propose = recorded
        spec.engine.runner.spec = sp
        outs = run(spec, params)
        got[on] = outs, proposed, sp.early_used
    (off, drafts_off, used_off), (on, drafts_on, used_on) = got[False], got[True]
    assert_same(off, on, logprob_tol=0.0)
    assert drafts_on == drafts_off and drafted(on) == drafted(off) and drafted(on)[0] > 0
    assert used_off == 0 and used_on > len(drafts_on)  # (most steps verify all four requests)


def test_batch_invariant_mode_is_bit_identical(model_dir: Path) -> None:
    """With batch-invariant ops a verify row computes exactly what a plain decode row does: logprobs bit-identical."""
    plain = run(engine(model_dir, 0, batch_invariant=True), SEEDED)
    fast_llm = engine(model_dir, DRAFTS, batch_invariant=True)
    oracle(fast_llm, plain, 0.3)
    fast = run(fast_llm, SEEDED)
    assert_same(plain, fast, logprob_tol=0.0)
    assert drafted(fast)[1] > 0


def test_a_judged_oracle_keeps_the_drafts_it_draws_right(spec: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's judged oracle (``OracleProposer(judged=True)``): in a run that mixes plain and verify steps
    (here every third step plain), each verify step keeps exactly the leading drafts the oracle drew right, whatever
    the target samples, and emits them: replayed from the outputs, every request's kept count and every kept
    token is the oracle's (a draft at position ``q`` is ``(q - 1) % vocab``, the continuation being empty)."""
    vocab, plain_every = spec.config.vocab_size, 3
    proposer = OracleProposer({}, 0.4, vocab, judged=True)
    spec.engine.runner.spec = spec.family.speculator(spec.model, DRAFTS, proposer)
    policy, calls = spec.engine.scheduler.spec_policy, [0]
    monkeypatch.setattr(policy, "explore", 1)

    def choose(rows: int) -> bool:
        calls[0] += 1
        return calls[0] % plain_every != 0

    monkeypatch.setattr(policy, "choose", choose)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = spec.engine.scheduler.spec.steps_off_cost
    outs = run(spec, params)
    assert spec.engine.scheduler.spec.steps_off_cost > before  # (plain steps among the verify steps)
    for k, o in enumerate(outs):
        toks, n0, got_kept, drawn_wrong = o.outputs[0].token_ids, len(PROMPTS[k]), 0, 0
        for i in range(1, len(toks)):  # token i sits at position n0 + i: a kept draft or a sample
            if toks[i] == (n0 + i - 1) % vocab and not proposer._wrong(f"r{k}", n0 + i):
                got_kept += 1
            drawn_wrong += proposer._wrong(f"r{k}", n0 + i)
        assert got_kept == o.usage["accepted_draft_tokens"] > 0
        assert 0 < drawn_wrong < len(toks)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_oracle_acceptance_rates(reference: Callable, spec: LLM, params: SamplingParams) -> None:
    """Drafts that are right are kept, wrong ones are not; the output never changes."""
    ref = reference(params)
    seen = {}
    for error_rate in (0.0, 0.3, 1.0):
        oracle(spec, ref, error_rate)
        before = spec.engine.scheduler.spec.accepted_tokens
        fast = run(spec, params)
        assert_same(ref, fast)
        seen[error_rate] = drafted(fast)
        assert spec.engine.scheduler.spec.accepted_tokens - before == seen[error_rate][1]
    (d0, k0), (d3, k3), (d1, k1) = seen[0.0], seen[0.3], seen[1.0]
    assert k0 == d0 > 0  # every draft of the true continuation is kept
    assert k1 == 0 < d1
    assert 0 < k3 < d3 and k3 < k0
    # with every draft kept a verify step emits DRAFTS + 1 tokens: far fewer steps than tokens
    n = sum(len(o.outputs[0].token_ids) for o in ref)
    assert d0 <= n


def test_max_tokens_and_stops_inside_a_verify_step(base: LLM, reference: Callable, spec: LLM) -> None:
    """A request whose max_tokens, stop token or stop string falls among a verify step's kept drafts ends exactly
    where the plain run ends (the tokens after it are dropped, its text cut)."""
    free = reference(GREEDY)
    seq = [o.outputs[0].token_ids for o in free]  # case k runs prompt k
    text = free[2].outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[seq[1][6]], ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=20, stop=[text[len(text) // 2 : len(text) // 2 + 2]], ignore_eos=True
        ),  # fmt: skip
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[seq[3][5]], include_stop_str_in_output=True, ignore_eos=True
        ),  # fmt: skip
    ]
    plain = run(base, cases)
    assert len(plain[0].outputs[0].token_ids) == 7
    assert [o.outputs[0].finish_reason for o in plain[1:]] == ["stop"] * 3
    oracle(spec, free, 0.0)  # the drafts are the free run's continuation: stops land inside verify steps
    fast = run(spec, cases)
    assert_same(plain, fast)
    assert drafted(fast)[1] > 0


def test_prefix_cache_hits(base: LLM, spec: LLM) -> None:
    """A second turn resumes from the prefix cache (the first turn's prompt): the drafter has not seen that prefix
    (the MTP block lags and skips what it missed; the oracle drafts anyway) and the tokens do not change."""
    turn1 = [list(range(200, 264)) + [k] for k in range(3)]
    first = run(base, GREEDY, turn1)
    turn2 = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(turn1, first)]
    base.reset_prefix_cache()
    second = run(base, GREEDY, turn2)
    for proposer in ("mtp", "oracle"):
        spec.reset_prefix_cache()
        spec.engine.runner.spec = spec.family.speculator(spec.model, DRAFTS)
        fast_first = run(spec, GREEDY, turn1)
        if proposer == "oracle":
            oracle(spec, second, 0.0, turn2)
        fast_second = run(spec, GREEDY, turn2)
        assert_same(first, fast_first)
        assert_same(second, fast_second)
        assert all(o.num_cached_tokens >= 64 for o in fast_second) and drafted(fast_second)[0] > 0
    assert drafted(fast_second)[1] > 0


def test_preemption(model_dir: Path, base: LLM) -> None:
    """A tight page pool preempts sequences in the middle of speculating (their drafts' pages given back, their
    state recomputed): the tokens do not change."""
    long = [list(range(300, 364)) + [k] for k in range(3)]
    plain = run(base, GREEDY, long)
    tight = LLM(model=model_dir, dtype="float32", num_pages=14, page_size=8, max_num_batched_tokens=16,
                num_speculative_tokens=DRAFTS, enable_prefix_caching=False)  # fmt: skip
    oracle(tight, plain, 0.3, long)
    fast = run(tight, GREEDY, long)
    assert_same(plain, fast)
    assert tight.engine.scheduler.num_preemptions > 0
    assert drafted(fast)[1] > 0


REGEX = "[a-z ]{4,40}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["n"]}


def run_constrained(llm: LLM, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list:
    eng, outs = llm.engine, {}
    for k, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{k}", p, sp, constraint=llm.constraints.for_request(sp.so_args, p))
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    return [outs[f"r{k}"] for k in range(len(prompts))]


def test_structured_output_speculates_within_its_grammar(base: LLM, spec: LLM) -> None:
    """A constrained request keeps only drafts its grammar allows, each verify row sampled under the grammar's state
    after the drafts before it: the same tokens as without speculation, greedy and seeded, mixed with unconstrained
    requests in the same steps; wrong drafts are cut by the grammar (or rejected) and never reach the output."""
    so = {"schema_type": "json_schema", "schema": SCHEMA}
    params = [
        SamplingParams(temperature=0, max_tokens=24, so_args=so),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, so_args=so, logprobs=1),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # unconstrained, in the same steps
        SamplingParams(temperature=0.8, seed=9, max_tokens=24, so_args={"schema_type": "regex", "schema": REGEX}),
    ]  # fmt: skip
    plain = run_constrained(base, params)
    kept = {}
    for error_rate in (0.0, 0.3, 1.0):
        oracle(spec, plain, error_rate)
        fast = run_constrained(spec, params)
        assert_same(plain, fast)
        kept[error_rate] = drafted([fast[k] for k in (0, 1, 3)])
    assert kept[0.0][1] == kept[0.0][0] > 0  # the true continuation obeys the grammar: every draft kept
    assert kept[1.0][1] == 0
    # at e = 1 a JSON request emits one token a step, and DRAFTS drafts are asked for each: the grammar cuts most
    # of the wrong ones before the forward (a wrong token inside a string may still be allowed)
    json_drafts = sum(o.usage.get("draft_tokens", 0) for o in fast[:2])
    assert json_drafts < DRAFTS * sum(len(o.outputs[0].token_ids) for o in fast[:2]) / 2
    assert 0 < kept[0.3][1] < kept[0.0][1]
    spec.engine.runner.spec = spec.family.speculator(spec.model, DRAFTS)
    assert_same(plain, run_constrained(spec, params))
    for o in plain[:2]:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_grammar_cuts_drafts_and_leaves_the_matcher(spec: LLM) -> None:
    """``engine.speculative.grammar.constrain``: the drafts up to the first one the grammar refuses, one mask per
    verify row (each the grammar's state after the drafts before it), and the matcher where it was."""
    cs = constraint_set(spec.model_path, spec.config)
    prompt = [0, 5, 6]
    sp = SamplingParams(so_args={"schema_type": "regex", "schema": "ab(c|d)e"})
    cs.install("x", spec.constraints.for_request(sp.so_args, prompt))
    tok = spec.tokenizer
    ids = {c: tok.encode(c, add_special_tokens=False).ids for c in "abcde"}
    assert all(len(v) == 1 for v in ids.values())
    a, b, c, d, e = (ids[ch][0] for ch in "abcde")
    before = cs.fill(["x"])[0].clone()
    kept, masks = constrain(cs, "x", [a, b, e, c])  # "e" is refused after "ab"
    assert kept == [a, b] and masks.shape[0] == 3
    assert allows(masks[0], a) and not allows(masks[0], b)
    assert allows(masks[1], b) and not allows(masks[1], a)
    assert allows(masks[2], c) and allows(masks[2], d) and not allows(masks[2], e)
    assert torch.equal(cs.fill(["x"])[0], before)  # rolled back
    kept, masks = constrain(cs, "x", [a, b, d, e])
    assert kept == [a, b, d, e] and masks.shape[0] == 5
    assert torch.equal(cs.fill(["x"])[0], before)


def test_large_batches_run_without_drafts(model_dir: Path, base: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above DEEPINFER_SPEC_DECODE_MAX_BATCH decode rows a step drafts nothing, and the scheduler counts it."""
    monkeypatch.setenv("DEEPINFER_SPEC_DECODE_MAX_BATCH", "2")
    llm = engine(model_dir, DRAFTS)
    assert llm.engine.scheduler.config.spec_max_batch == 2
    plain, fast = run(base, GREEDY), run(llm, GREEDY)
    assert_same(plain, fast)
    stats: SpecStats = llm.engine.scheduler.spec
    assert stats.steps_off > 0
    # four sequences decode together until the short ones end: the first decode steps draft nothing
    solo = run(llm, GREEDY, PROMPTS[:2])
    assert drafted(solo)[0] > 0


def test_stats_record_and_usage() -> None:
    s = SpecStats()
    s.record(4, 2)
    s.record(4, 4)
    s.record(0, 0)  # a row without drafts is not a verify row
    assert (s.verifies, s.draft_tokens, s.accepted_tokens) == (2, 8, 6)
    assert dict(s.accepted_per_pos) == {0: 2, 1: 2, 2: 1, 3: 1} and dict(s.emitted) == {3: 1, 5: 1}


def test_checkpoints_without_a_drafter_refuse(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="window"):
        engine(model_dir, 10_000)
    bare = make_tiny_model(tmp_path / "no_mtp", seed=1, overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="no MTP block"):
        engine(bare, 2)


def test_a_prompt_joining_drafting_rows_runs_beside_their_verify_step(
    base: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than the model's rings arrives while two requests draft: the steps that hold one of its
    chunks beside their verify rows run the chunk as a plain step and the verify rows on the decode path
    (``deepseek_v4.verify_split``: taken), and every request's tokens and logprobs are the plain run's."""
    from deepinfer.models.deepseek_v4 import verify_split

    taken: list[bool] = []
    real = verify_split.split
    monkeypatch.setattr(verify_split, "split", lambda *a: (lambda m: taken.append(m is not None) or m)(real(*a)))
    late = [(31 * j) % 3000 + 50 for j in range(3 * spec.config.sliding_window + 7)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)

    def staggered(llm: LLM) -> list[RequestOutput]:
        eng, outs = llm.engine, {}
        for k in range(2):
            eng.add_request(f"r{k}", PROMPTS[k], params)
        steps = 0
        while eng.has_unfinished_requests():
            steps += 1
            if steps == 4:
                eng.add_request("r2", late, params)
            for o in eng.step():
                outs[o.request_id] = o
        return [outs[f"r{k}"] for k in range(3)]

    want = staggered(base)
    assert not any(taken)
    assert_same(want, staggered(spec))
    assert any(taken), taken
