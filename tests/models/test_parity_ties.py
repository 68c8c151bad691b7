"""Tie-aware parity (docs/parity.md) on configurations and seeds no other test uses: V4 against transformers, V4.1
against NeMo AutoModel, fp32 on the CPU, one whole-sequence forward on each side.

For every prompt the reference's top-k selections (indexer rows, candidate blocks, router experts) are logged
(``models.ties``): positions before the first near-tie (relative margin < 1e-4) must match within 1e-4; positions at
and after it are reported. Then the reference's selections are replayed on our side, which breaks every tie the same
way: all positions must match within 1e-4. With V4.1's cache formats on, the rounding-boundary ties of the FP8/FP4
caches are broken the same way too (NeMo's roundings replayed).
"""

from __future__ import annotations

import pytest
import torch

from models.ties import TopkCall, TopkLog, logprob_diffs, record_topk, replay_on, split_at_first_tie

ATOL = 1e-4

# (configuration, seed, overrides): seeds and overrides no other parity test uses
V4_CASES = [("base", 21, {}), ("odd", 22, {"index_topk": 3}), ("wide", 23, {"num_experts_per_tok": 2})]
V41_CASES = [
    ("sketch", 41, {"index_topk": 2}),
    ("mixed", 42, {"candidate_topk_blocks": 3}),
    ("heads8", 43, {"num_experts_per_tok": 3}),
    ("mixed", 44, {"index_n_heads": 4}),
]


def _prompts(vocab: int, seed: int, lengths: tuple[int, ...], low: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 100)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def _check(label: str, plain: torch.Tensor, log: TopkLog, replayed: torch.Tensor) -> None:
    split = split_at_first_tie(plain, log.margins())
    print(f"{label}: {split}; the reference's selections replayed: max |Δ| {float(replayed.max()):.2e}")
    assert split.before <= ATOL, f"{label}: {split}"
    assert float(replayed.max()) <= ATOL, f"{label}: {float(replayed.max()):.3g} with the selections replayed"


def test_margins_find_near_ties_and_exact_ties_broken_otherwise() -> None:
    inf = float("inf")
    scores = torch.tensor(
        [
            [3.0, 2.0, 1.0],  # clear: margin 1/3
            [1.0, 1.00001, 0.5],  # near-tie (~1e-5)
            [0.0, 0.0, -1.0],  # exact tie broken by the rule (lower index): not a near-tie
            [0.0, 0.0, -1.0],  # exact tie broken otherwise: margin 0
            [5.0, -inf, -inf],  # no competitor
        ]
    )
    call = TopkCall(scores, 1, torch.tensor([[0], [1], [0], [1], [0]]))
    m = call.margins()
    assert m[0] == pytest.approx(1 / 3) and 0 < m[1] < 2e-5 and m[2] == inf and m[3] == 0 and m[4] == inf
    split = split_at_first_tie(torch.tensor([0.0, 1e-5, 5e-3, 1e-6, 0.0]), m)
    assert (split.first, split.ties, split.before) == (1, 2, 0.0) and split.after == pytest.approx(5e-3)


# -- DeepSeek-V4 against transformers -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=V4_CASES, ids=lambda c: f"{c[0]}-seed{c[1]}")
def v4_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from deepinfer import LLM
    from deepinfer.checkpoint.references import build_hf_model
    from deepinfer.checkpoint.tiny import make_tiny_model
    from models.tiny_configs import CONFIGS

    name, seed, extra = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("ties") / name, seed=seed, overrides={**CONFIGS[name], **extra})
    llm = LLM(model=path, dtype="float32", page_size=16, num_pages=32)
    return f"{name}-seed{seed}", llm, build_hf_model(llm.model)


def _v4_logits(llm, p: list[int]) -> torch.Tensor:
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState

    cache = PagedKVCache(llm.config, 16, 16)
    batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(p), torch.arange(16))], [p])
    return llm.model.logits(llm.model(batch, cache))


@torch.no_grad()
def test_v4_tie_aware_parity(v4_pair) -> None:
    label, llm, hf = v4_pair
    for p in _prompts(llm.config.vocab_size, int(label.split("seed")[1]), (45, 90), low=2):
        with record_topk(len(p)) as log:
            ref = hf(torch.tensor([p]), use_cache=False).logits[0]
        assert log.calls, "no top-k call of the reference was logged"
        plain = logprob_diffs(_v4_logits(llm, p), ref)
        with replay_on(llm.model.ops, log) as done:
            replayed = logprob_diffs(_v4_logits(llm, p), ref)
        assert len(done) == len(log.calls)
        _check(f"V4 {label} ({len(p)} tokens, {len(log.calls)} top-k calls)", plain, log, replayed)


# -- DeepSeek-V4.1 against NeMo AutoModel --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from models.tiny_v41 import build_tokenizer

    return build_tokenizer()


def _v41_logits(ours, s: list[int]) -> torch.Tensor:
    from models.test_v41_parity import run_chunked

    return run_chunked(ours, [s], [[len(s)]])[0]


@pytest.mark.parametrize(("name", "seed", "extra"), V41_CASES, ids=[f"{c[0]}-seed{c[1]}" for c in V41_CASES])
def test_v41_tie_aware_parity(nemo, tokenizer, name, seed, extra) -> None:
    from models.nemo_v41 import build_pair, nemo_logits, reference_rules

    theirs, ours = build_pair(name, tokenizer, seed=seed, **extra)
    ours.set_quant_sim(False)
    for s in _prompts(len(tokenizer), seed, (45, 90)):
        with reference_rules(), record_topk(len(s)) as log:
            ref = nemo_logits(theirs, torch.tensor([s]))[0]
        plain = logprob_diffs(_v41_logits(ours, s), ref)
        with replay_on(ours.ops, log) as done:
            replayed = logprob_diffs(_v41_logits(ours, s), ref)
        assert len(done) == len(log.calls) > 0
        _check(f"V4.1 {name}-seed{seed} ({len(s)} tokens, {len(log.calls)} top-k calls)", plain, log, replayed)


def test_v41_replayed_selection_reaches_our_model(nemo, tokenizer) -> None:
    """The replay is not a no-op: a router selection changed at one position moves that position and later ones,
    and leaves the earlier ones as they were."""
    from models.nemo_v41 import build_pair, nemo_logits, reference_rules

    theirs, ours = build_pair("sketch", tokenizer, seed=45)
    ours.set_quant_sim(False)
    s = _prompts(len(tokenizer), 45, (40,))[0]
    with reference_rules(), record_topk(len(s)) as log:
        ref = nemo_logits(theirs, torch.tensor([s]))[0]
    n_exp = ours.config.text_config.n_routed_experts
    router = next(c for c in log.calls if c.scores.shape[-1] == n_exp)  # the first layer that routes by score
    p = 20
    others = [e for e in range(n_exp) if e not in router.indices[p].tolist()]
    router.indices[p] = torch.tensor(others[: router.k])
    with replay_on(ours.ops, log):
        d = logprob_diffs(_v41_logits(ours, s), ref)
    assert float(d[:p].max()) <= ATOL and float(d[p]) > 1e-3


@pytest.mark.parametrize(("seed", "length"), [(12, 64), (13, 100), (14, 100)])
def test_v41_cache_rounding_ties(nemo, tokenizer, seed, length) -> None:
    """With the cache formats on both sides (FP8 window, NVFP4 rows, MXFP4 index keys and queries), a value that
    sits on a rounding boundary is a tie too: op-order noise rounds it the other way and the position moves by up
    to ~1e-2. With NeMo's roundings replayed (and its selections), every position matches within 1e-4."""
    from models.nemo_v41 import build_pair, nemo_logits, record_cache_rounds, reference_rules, replay_cache_rounds

    theirs, ours = build_pair("sketch", tokenizer, seed=seed)
    ours.set_quant_sim(True)
    s = next(p for p in _prompts(len(tokenizer), seed, (37, 64, 100)) if len(p) == length)
    with reference_rules(cache_quant=True), record_cache_rounds() as rounds, record_topk(len(s)) as log:
        ref = nemo_logits(theirs, torch.tensor([s]))[0]
    plain = logprob_diffs(_v41_logits(ours, s), ref)
    with replay_on(ours.ops, log):
        selections = logprob_diffs(_v41_logits(ours, s), ref)
    with replay_cache_rounds(ours.ops, rounds) as counts, replay_on(ours.ops, log):
        both = logprob_diffs(_v41_logits(ours, s), ref)
    print(
        f"V4.1 sketch-seed{seed} ({length} tokens, cache formats on): {split_at_first_tie(plain, log.margins())}; "
        f"selections replayed {float(selections.max()):.2e}; roundings and selections replayed {float(both.max()):.2e}"
    )
    assert counts["own"] == 0 and counts["replayed"] == len(rounds)
    assert float(both.max()) <= ATOL
    ours.set_quant_sim(False)
