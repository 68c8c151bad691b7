import math

import pytest
import torch

from deepinfer.engine.sampler import Sampler, SamplerOutput, compute_logprobs
from deepinfer.sampling_params import SamplingParams

sampler = Sampler(kernel=False)  # the torch path; tests/kernels/test_sampling.py checks the Triton kernel
PROBS = [0.5, 0.25, 0.15, 0.1]


def _logits(probs, v_extra=0):
    lg = torch.log(torch.tensor(probs, dtype=torch.float32))
    if v_extra:
        lg = torch.cat([lg, torch.full((v_extra,), -1e9)])
    return lg


def _support(logits_row, params, n=600, seeded=True):
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    seeds = [1000 + i if seeded else None for i in range(n)]
    out = sampler(logits, [params] * n, seeds)
    return set(out.token_ids.tolist())


def test_output_types_and_shapes():
    logits = torch.randn(3, 11)
    out = sampler(logits, [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=2)], [None] * 3)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64
    assert out.logprobs.shape == (3,) and out.logprobs.dtype == torch.float32
    assert out.top_logprobs == [None, None, None]


def test_greedy_argmax_and_ties():
    logits = torch.tensor([[0.0, 1.0, 3.0, -1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    g = SamplingParams(temperature=0)
    out = sampler(logits, [g, g], [0, None])
    assert out.token_ids.tolist() == [2, 0]


def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: lowest id wins in both
    greedy = sampler(logits, [SamplingParams(temperature=0)] * 16, [None] * 16).token_ids
    for temp in (0.5, 1.0, 3.0):
        tk = sampler(logits, [SamplingParams(temperature=temp, top_k=1)] * 16, [None] * 16).token_ids
        assert torch.equal(tk, greedy)
    assert greedy[3].item() == 7


def test_tiny_temperature_is_finite_and_near_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    out = sampler(logits, [SamplingParams(temperature=1e-8)], [1])
    assert out.token_ids.tolist() == [1]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (1e-6, {0}),
        (0.5, {0}),
        (0.51, {0, 1}),
        (0.7, {0, 1}),
        (0.75, {0, 1}),
        (0.76, {0, 1, 2}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_support(top_p, expected):
    assert _support(_logits(PROBS, v_extra=4), SamplingParams(top_p=top_p)) == expected


def test_top_p_after_top_k_renormalises():
    # top_k=2 leaves {0.5, 0.25} -> renormalised {2/3, 1/3}; top_p=0.6 keeps only token 0.
    assert _support(_logits(PROBS), SamplingParams(top_k=2, top_p=0.6)) == {0}
    assert _support(_logits(PROBS), SamplingParams(top_k=3, top_p=0.99)) == {0, 1, 2}


def test_top_p_uses_temperature_scaled_probs():
    # At T=0.25 probs ~ p^4: token 0 holds > 90% of the mass.
    assert _support(_logits(PROBS), SamplingParams(temperature=0.25, top_p=0.9)) == {0}


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.4, {0, 1}), (1.0, {0})])
def test_min_p_support(min_p, expected):
    assert _support(_logits(PROBS), SamplingParams(min_p=min_p)) == expected


def test_top_k_support():
    assert _support(_logits(PROBS, v_extra=3), SamplingParams(top_k=3), seeded=False) == {0, 1, 2}
    assert _support(_logits(PROBS, v_extra=3), SamplingParams(top_k=-1)) == {0, 1, 2, 3}


def _run_steps(rows, target_pos, steps=5):
    """Sample `steps` steps for a batch; return the target row's tokens."""
    seeds = [s for _, _, s in rows]
    toks = []
    for step in range(steps):
        logits = torch.stack([lg + 0.01 * step for lg, _, _ in rows])
        out = sampler(logits, [p for _, p, _ in rows], seeds)
        toks.append(out.token_ids[target_pos].item())
    return toks


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(123)
    V = 300
    target = (torch.randn(V), SamplingParams(temperature=1.3, top_p=0.95, top_k=200, seed=42), 42)
    others = [
        (torch.randn(V), SamplingParams(temperature=0.8), None),
        (torch.randn(V), SamplingParams(temperature=0), 7),
        (torch.randn(V), SamplingParams(temperature=1.0, seed=9), 9),
        (torch.randn(V), SamplingParams(temperature=2.0, min_p=0.1), None),
    ]
    ref = _run_steps([target], 0)
    assert _run_steps([others[0], target, others[1]], 1) == ref
    assert _run_steps(others + [target], 4) == ref
    assert _run_steps([target] + others[::-1], 0) == ref
    torch.manual_seed(999)  # global RNG state must not matter for a seeded row
    assert _run_steps([others[3], target], 1) == ref
    # and a different seed gives a different trajectory (overwhelmingly likely at V=300, 5 steps)
    other_seed = (target[0], target[1], 43)
    assert _run_steps([other_seed], 0) != ref


def _chi2(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded):
    n = 20000 if not seeded else 4000
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    T = 0.7
    expected = torch.softmax(logits / T, dim=-1).tolist()
    torch.manual_seed(2024)
    batch = logits.unsqueeze(0).expand(n, -1).contiguous()
    seeds = list(range(n)) if seeded else [None] * n
    out = sampler(batch, [SamplingParams(temperature=T)] * n, seeds)
    counts = torch.bincount(out.token_ids, minlength=6).tolist()
    # df = 5: P(chi2 > 30) ~ 1.5e-5
    assert _chi2(counts, expected, n) < 30, (counts, expected)


def test_empirical_distribution_with_top_k_renormalised():
    n = 20000
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    T = 1.5
    kept = [0, 1, 3]  # top-3 by logit
    expected = torch.softmax(logits[kept] / T, dim=-1).tolist()
    torch.manual_seed(7)
    out = sampler(logits.expand(n, -1).contiguous(), [SamplingParams(temperature=T, top_k=3)] * n, [None] * n)
    counts = torch.bincount(out.token_ids, minlength=6)
    assert counts[[2, 4, 5]].sum().item() == 0
    assert _chi2(counts[kept].tolist(), expected, n) < 25  # df = 2


def test_raw_logprobs_are_unprocessed():
    torch.manual_seed(5)
    logits = torch.randn(4, 40) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=2.0, top_p=0.5, min_p=0.05),
        SamplingParams(temperature=1.0, seed=3),
    ]
    out = sampler(logits, params, [None, None, None, 3])
    raw = torch.log_softmax(logits, dim=-1)
    expect = raw.gather(1, out.token_ids.view(-1, 1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expect)


def test_top_logprobs_ordering_and_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0, 1.0], [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(logprobs=0)]
    out = sampler(logits, params, [None, None])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs[1] is None
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == [1, 3, 2, 5]
    for t, lp in top:
        assert math.isclose(lp, raw[0, t].item(), rel_tol=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_top_logprobs_mixed_counts():
    torch.manual_seed(11)
    logits = torch.randn(3, 30)
    params = [SamplingParams(logprobs=1), SamplingParams(logprobs=20), SamplingParams()]
    out = sampler(logits, params, [None] * 3)
    assert len(out.top_logprobs[0]) == 1 and len(out.top_logprobs[1]) == 20 and out.top_logprobs[2] is None
    assert out.top_logprobs[0][0][0] == int(torch.argmax(logits[0]))
    ref = torch.sort(logits[1], descending=True, stable=True).indices[:20].tolist()
    assert [t for t, _ in out.top_logprobs[1]] == ref


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("vocab", [1, 2, 7, 4096, 129280])
def test_the_top_k_selection_is_a_stable_sort_s_head(vocab: int, device: str):
    """``_top_sorted`` (on the host topk of order-preserving integer keys, no full-row sort; on a GPU the sort)
    gives exactly what a stable descending sort gives first: ties (many, coarse values), -inf runs, -0.0 beside
    +0.0, k past the vocabulary."""
    from deepinfer.engine.sampler import _top_sorted

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        x = torch.randn(3, vocab, generator=g)
        if trial % 3 == 0:
            x = torch.round(x * 2) / 2  # many ties
        if trial % 4 == 1:
            x[:, ::3] = float("-inf")
        if trial % 4 == 2:
            x[:, 0], x[:, -1] = -0.0, 0.0
        lp = torch.log_softmax(x, dim=-1) if trial % 2 else x
        for k in (1, 5, 20, vocab + 3):
            want_v, want_i = torch.sort(lp, dim=-1, descending=True, stable=True)
            got_v, got_i = (t.cpu() for t in _top_sorted(lp.to(device), k))
            n = min(k, vocab)
            assert torch.equal(got_i, want_i[:, :n]), (trial, k)
            torch.testing.assert_close(got_v, want_v[:, :n], rtol=0, atol=0, equal_nan=True)  # (a lone -inf: nan)


def test_compute_logprobs_prompt_shape():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    tokens = torch.tensor([0, 0])
    raw = torch.log_softmax(logits, dim=-1)
    d = compute_logprobs(logits, tokens, 2)
    assert list(d[0].keys()) == [0, 3, 2]  # actual token first, then the top ones
    assert list(d[1].keys()) == [0, 1]  # actual token is also top-1: appears once
    for r in range(2):
        for t, lp in d[r].items():
            assert math.isclose(lp, raw[r, t].item(), rel_tol=1e-6)
    assert compute_logprobs(logits, tokens, 0) == [{0: raw[0, 0].item()}, {0: raw[1, 0].item()}]
    with pytest.raises(ValueError):
        compute_logprobs(logits, torch.tensor([0]), 1)


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError):
        sampler(torch.randn(2, 5), [SamplingParams()], [None, None])


def test_the_invariant_mode_samples_greedy_steps_with_the_kernel_too(monkeypatch):
    """Where the Triton kernel runs, an all-greedy step stays on torch by default; in the invariant mode it takes the
    kernel too, so a greedy row's logprob does not depend on whether a sampling row shares its step."""
    from deepinfer.runtime.platform import platform_of

    monkeypatch.setattr(platform_of("cpu"), "triton", True)  # (as on a GPU; the kernel itself is recorded, not run)
    calls = []

    def kernel(logits, raw, params, seeds, invariant):
        calls.append(invariant)
        return torch.argmax(logits, dim=-1), torch.zeros(logits.shape[0])

    monkeypatch.setattr(Sampler, "_kernel", staticmethod(kernel))
    logits, greedy = torch.randn(3, 50), [SamplingParams(temperature=0)] * 3
    Sampler()(logits, greedy, [None] * 3)
    assert calls == []  # the default: torch
    Sampler(invariant=True)(logits, greedy, [None] * 3)
    Sampler(invariant=True)(logits, [SamplingParams(temperature=1.0)] * 3, [1, 2, 3])
    assert calls == [True, True]


def test_the_factory_gives_the_invariant_ops_the_invariant_sampler(tmp_path):
    from deepinfer.checkpoint.tiny import make_tiny_model
    from deepinfer.engine.factory import build_worker

    model = make_tiny_model(tmp_path / "m", seed=0)
    for invariant in (False, True):
        parts = build_worker(model, "float32", "cpu", None, 8, 16, batch_invariant=invariant)
        assert parts.runner.sampler.invariant is invariant
