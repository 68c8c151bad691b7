"""The worker's structured-output matchers (engine/constraints.py) with real xgrammar grammars compiled
against the DeepSeek-V4 tokenizer: masks, EOS, control tokens, thinking mode, rollback, refusal."""

from __future__ import annotations

import random
import re

import pytest
import torch

from deepinfer.chat.tokens import THINK_END
from deepinfer.engine.constraints import Constraint, ConstraintSet
from deepinfer.engine.token_masks import pack
from deepinfer.grammar import Compiler, GrammarSpec, build_tokenizer_info, control_token_ids, tokenizer_fingerprint
from deepinfer.tokenizer import load_tokenizer

V, EOS = 129280, 1


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    return Compiler(None)


@pytest.fixture(scope="module")
def controls() -> dict[int, str]:
    return control_token_ids(None)


def make_set(controls: dict[int, str], fingerprint: str | None = None) -> ConstraintSet:
    by_text = {t: i for i, t in controls.items()}
    fp = tokenizer_fingerprint(None) if fingerprint is None else fingerprint
    return ConstraintSet(lambda: build_tokenizer_info(None), controls, V, EOS, by_text[THINK_END], fp)


def allowed_ids(cs: ConstraintSet, rid: str) -> torch.Tensor:
    return ConstraintSet.allowed(cs.fill([rid]), V, "cpu")[0].nonzero().flatten()


def walk(cs: ConstraintSet, rid: str, rng: random.Random, limit: int = 200) -> list[int]:
    """Sample uniformly among the allowed tokens (EOS as soon as it is allowed) until EOS."""
    out: list[int] = []
    for _ in range(limit):
        ids = allowed_ids(cs, rid).tolist()
        assert ids, "a constrained row must always allow something"
        t = EOS if EOS in ids else rng.choice(ids)
        cs.accept(rid, t)
        out.append(t)
        if t == EOS:
            return out
    raise AssertionError("the grammar never allowed EOS")


def test_pack_matches_xgrammar_layout(compiler: Compiler, controls: dict[int, str]) -> None:
    cs = make_set(controls)
    g = compiler.compile(GrammarSpec("regex", "x"))
    cs.install("r", Constraint(g))
    ids = set(allowed_ids(cs, "r").tolist())
    x = load_tokenizer().token_to_id("x")
    assert x in ids and EOS not in ids  # the grammar starts: "x" only (and tokens that are exactly "x")
    row = pack([0, 31, 32, V - 1], V)
    assert ConstraintSet.allowed(row[None], V, "cpu")[0].nonzero().flatten().tolist() == [0, 31, 32, V - 1]


def test_regex_walk_produces_matching_text_and_ends_on_eos(tok, compiler: Compiler, controls: dict[int, str]) -> None:
    cs = make_set(controls)
    pattern = r"(yes|no|maybe) [0-9]{1,3}"
    g = compiler.compile(GrammarSpec("regex", pattern))
    for seed in range(5):
        cs.install(f"r{seed}", Constraint(g))
        ids = walk(cs, f"r{seed}", random.Random(seed))
        assert ids[-1] == EOS and EOS not in ids[:-1]
        assert re.fullmatch(pattern, tok.decode(ids[:-1], skip_special_tokens=False))
        # terminated: a row the async pipeline scheduled after EOS may only repeat EOS
        assert allowed_ids(cs, f"r{seed}").tolist() == [EOS]


def test_control_tokens_masked_unless_named_and_banned_tokens_never(compiler: Compiler, controls) -> None:
    cs = make_set(controls)
    think = next(i for i, t in controls.items() if t == "<think>")
    dsml = next(i for i, t in controls.items() if t == "｜DSML｜")
    free = compiler.compile(GrammarSpec("regex", r"[^\n]{0,40}"))  # any text: control tokens are text too
    cs.install("free", Constraint(free))
    allowed = set(allowed_ids(cs, "free").tolist())
    assert not allowed & set(controls), "no think tag / DSML / role marker unless the grammar names it"
    named = compiler.compile(GrammarSpec("regex", r"(<think>|[a-z]{1,5})"))
    cs.install("named", Constraint(named, banned_token_ids=(dsml,)))
    allowed = set(allowed_ids(cs, "named").tolist())
    assert think in allowed and dsml not in allowed
    # no grammar, banned tokens only (tool_choice "none"): everything but the banned ones
    cs.install("none", Constraint(None, banned_token_ids=(dsml,)))
    mask = ConstraintSet.allowed(cs.fill(["none"]), V, "cpu")[0]
    assert not mask[dsml] and int(mask.sum()) == V - 1


def test_thinking_mode_grammar_starts_after_think_end(tok, compiler: Compiler, controls) -> None:
    cs = make_set(controls)
    end = tok.token_to_id(THINK_END)
    g = compiler.compile(GrammarSpec("regex", r"ok"))
    cs.install("t", Constraint(g, after_think=True))
    before = ConstraintSet.allowed(cs.fill(["t"]), V, "cpu")[0]
    assert not before[EOS] and int(before.sum()) == V - 1  # reasoning is free, but may not end the answer
    for t in tok.encode("let me think", add_special_tokens=False).ids:
        cs.accept("t", t)
    cs.accept("t", end)
    after = set(allowed_ids(cs, "t").tolist())
    assert after and EOS not in after and all(tok.decode([i]).startswith("o") or tok.decode([i]) == "" for i in after)
    # rolling back over "</think>" makes the reasoning free again; forward again re-applies the grammar
    cs.rollback("t", 1)
    assert int(ConstraintSet.allowed(cs.fill(["t"]), V, "cpu")[0].sum()) == V - 1
    cs.accept("t", end)
    assert set(allowed_ids(cs, "t").tolist()) == after


def test_rollback_restores_the_grammar_state(tok, compiler: Compiler, controls) -> None:
    cs = make_set(controls)
    g = compiler.compile(GrammarSpec("regex", r"abc(d|e)f"))
    cs.install("r", Constraint(g))
    rng = random.Random(3)
    first = [rng.choice(allowed_ids(cs, "r").tolist())]
    cs.accept("r", first[0])
    state = allowed_ids(cs, "r").tolist()
    nxt = rng.choice(state)
    cs.accept("r", nxt)
    cs.rollback("r", 1)
    assert allowed_ids(cs, "r").tolist() == state
    with pytest.raises(ValueError, match="rollback"):
        cs.rollback("r", 5)


def test_history_replays_a_preempted_request(tok, compiler: Compiler, controls) -> None:
    cs = make_set(controls)
    g = compiler.compile(GrammarSpec("regex", r"[a-c]{3}-[0-9]{2}"))
    cs.install("a", Constraint(g))
    ids = walk(cs, "a", random.Random(0))
    # re-admission after a preemption: the same constraint and the tokens so far
    cs.install("b", Constraint(g), history=ids[:3])
    cs.release(["a"])
    assert "a" not in cs
    cs2 = make_set(controls)
    cs2.install("c", Constraint(g))
    for t in ids[:3]:
        cs2.accept("c", t)
    assert allowed_ids(cs, "b").tolist() == allowed_ids(cs2, "c").tolist()


def test_apply_masks_the_constrained_rows_only(compiler: Compiler, controls) -> None:
    cs = make_set(controls)
    cs.install("a", Constraint(compiler.compile(GrammarSpec("regex", "[0-9]+"))))
    cs.install("b", Constraint(None, banned_token_ids=(3, 4)))
    packed = cs.fill(["a", "b"])
    logits = torch.randn(3, V + 64)  # a model vocabulary wider than the tokenizer's: the extra columns are refused
    raw = logits.clone()
    cs.apply(logits, packed, [2, 0])
    assert torch.equal(logits[1], raw[1])
    for row, mask in ((2, 0), (0, 1)):
        allowed = ConstraintSet.allowed(packed[mask : mask + 1], V, "cpu")[0]
        assert torch.equal(logits[row, :V][allowed], raw[row, :V][allowed])
        assert torch.isneginf(logits[row, :V][~allowed]).all() and torch.isneginf(logits[row, V:]).all()


def test_the_refused_token_sets_kept_are_bounded(controls) -> None:
    """Requests bring their own banned ids: the sets kept for sharing stay within the cache's size, and a request
    whose set went out still fills as it did (its matcher holds its own)."""
    cs = ConstraintSet(lambda: build_tokenizer_info(None), controls, V, EOS, None, cache_size=4)
    for i in range(10):
        cs.install(f"r{i}", Constraint(None, banned_token_ids=(100 + i,)))
    assert len(cs._refusals) == 4
    mask = ConstraintSet.allowed(cs.fill(["r0", "r9"]), V, "cpu")
    assert not mask[0, 100] and mask[0, 109] and not mask[1, 109] and int(mask.sum()) == 2 * V - 2


def test_every_row_constrained_masks_as_a_step_with_an_unconstrained_row(compiler: Compiler, controls) -> None:
    """A step whose rows are all constrained, in order, hands the filled masks over as they are (no index): the
    same logits as where an unconstrained row sits among them."""
    cs = make_set(controls)
    cs.install("a", Constraint(compiler.compile(GrammarSpec("regex", "[0-9]+"))))
    cs.install("b", Constraint(None, banned_token_ids=(3, 4)))
    packed = cs.fill(["a", "b"])
    logits = torch.randn(2, V + 64)
    every, mixed = logits.clone(), torch.cat([logits, torch.randn(1, V + 64)])
    cs.apply(every, packed, [0, 1])
    cs.apply(mixed, packed, [0, 1])
    assert torch.equal(every, mixed[:2]) and torch.isneginf(every[:, V:]).all()
    assert not torch.equal(every, logits)


def test_the_samplers_masks_follow_its_rows_whatever_the_fills_order(compiler: Compiler, controls) -> None:
    """``row_masks``: each sampled row of a constrained request gets that request's filled mask, in whatever order
    the fill had them; an unconstrained row is left alone."""
    from concurrent.futures import Future

    from deepinfer.engine.speculative.grammar import row_masks

    cs = make_set(controls)
    cs.install("a", Constraint(compiler.compile(GrammarSpec("regex", "[0-9]+"))))
    cs.install("b", Constraint(None, banned_token_ids=(3, 4)))
    filled: Future = Future()
    filled.set_result(cs.fill(["b", "a"]))
    logits = torch.randn(3, V)
    got = logits.clone()
    row_masks(cs, (["b", "a"], filled, {}), ["a", "x", "b"])(got)
    want = logits.clone()
    cs.apply(want, cs.fill(["a", "b"]), [0, 2])
    assert torch.equal(got, want) and torch.equal(got[1], logits[1])


def test_a_grammar_for_another_tokenizer_is_refused_not_fatal(compiler: Compiler, controls) -> None:
    cs = make_set(controls, fingerprint="0" * 64)
    g = compiler.compile(GrammarSpec("regex", "x+"))
    cs.install("bad", Constraint(g))  # logged; the request may only end
    cs.install("ok", Constraint(None, banned_token_ids=(5,)))
    masks = ConstraintSet.allowed(cs.fill(["bad", "ok"]), V, "cpu")
    assert masks[0].nonzero().flatten().tolist() == [EOS]
    assert not masks[1][5] and masks[1][EOS]


def test_sampler_chooses_among_allowed_tokens_and_reports_raw_logprobs() -> None:
    from deepinfer.engine.sampler import Sampler
    from deepinfer.sampling_params import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = torch.zeros(3, 50, dtype=torch.bool)
    allowed[:, [7, 9, 11]] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(top_k=2)]
    seeds = [None, 5, None]
    before = logits.clone()
    out = Sampler()(logits, params, seeds, lambda x: x.masked_fill_(~allowed, float("-inf")))
    assert torch.equal(logits, before)  # the caller's logits are left alone
    assert set(out.token_ids.tolist()) <= {7, 9, 11}
    assert int(out.token_ids[0]) == [7, 9, 11][int(logits[0, [7, 9, 11]].argmax())]
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


@pytest.mark.parametrize("batch_fails", [False, True])
def test_a_batch_fills_the_rows_each_request_fills_alone(compiler: Compiler, controls, monkeypatch, batch_fails):
    """xgrammar's matchers of a batch fill in one threaded call (``_fill_rows``); the rows are those each request
    gets alone, whatever its state (advanced, terminated, thinking, unconstrained), and the same if that call fails
    (then row by row)."""
    import xgrammar as xgr

    calls = []
    real = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def spy(self, matchers, bitmask, indices=None, debug_print=False):
        calls.append(list(indices))
        if batch_fails:
            raise RuntimeError("planted")
        return real(self, matchers, bitmask, indices, debug_print)

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", spy)
    cs, rng = make_set(controls), random.Random(3)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    grammars = [compiler.compile(GrammarSpec("regex", "(ab)+c?")), compiler.compile(GrammarSpec("json_schema", schema))]
    rids = [f"r{i}" for i in range(10)]
    for i, rid in enumerate(rids[:5]):
        cs.install(rid, Constraint(grammars[i % 2]))
    cs.install("r5", Constraint(grammars[0], after_think=True))  # thinking: no grammar yet
    # rows refusing other token sets besides their grammar's (each set cleared in the batch's rows that have it)
    cs.install("r6", Constraint(None, banned_token_ids=(5, 77)))
    cs.install("r7", Constraint(grammars[1], banned_token_ids=(9,)))
    cs.install("r8", Constraint(None, banned_token_ids=(77, 5)))  # r6's set: one update clears both rows
    for i in range(4):  # r0..r3 advanced by different numbers of tokens
        for _ in range(i):
            cs.accept(rids[i], rng.choice(allowed_ids(cs, rids[i]).tolist()))
    walk(cs, "r4", rng)  # to EOS: terminated
    alone = torch.stack([cs.fill([rid])[0] for rid in rids])  # (r9 unconstrained: everything)
    together = cs.fill(rids)
    assert torch.equal(together, alone)
    assert calls and calls[-1] == [0, 1, 2, 3, 7]  # the grammars' rows in one call (r4 terminated, r5 thinking)
    refused = ConstraintSet.allowed(together, V, "cpu")
    assert not refused[6, 5] and not refused[6, 77] and int(refused[6].sum()) == V - 2
    assert torch.equal(refused[8], refused[6]) and not refused[7, 9] and refused[9].all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_on_a_gpu_never_waits_for_it(compiler: Compiler, controls) -> None:
    """The masks and row indices go to the device without the host waiting for the work queued ahead (a served
    constrained step keeps its overlap), and mask exactly the constrained row."""
    cs = make_set(controls)
    cs.install("r", Constraint(compiler.compile(GrammarSpec("regex", "x"))))
    packed = cs.fill(["r"])
    logits = torch.randn(3, V, device="cuda")
    want = logits.clone()
    cs.apply(logits.clone(), packed, [1])  # (xgrammar's kernel compiled)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # GPU work queued ahead
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cs.apply(logits, packed, [1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not queued.query(), "the host waited for the GPU"
    allowed = ConstraintSet.allowed(packed, V, "cuda")[0]
    assert torch.equal(logits[1][allowed], want[1][allowed]) and bool(torch.isinf(logits[1][~allowed]).all())
    assert torch.equal(logits[0], want[0]) and torch.equal(logits[2], want[2])
