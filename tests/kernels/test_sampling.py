"""``deepinfer.kernels.sampling`` (the sampler in two Triton kernels) against its reference: the winner of the Gumbel
race ``argmax x / T + G`` over the tokens the torch sampler keeps (``Sampler._filtered_probs > 0``), with ``G`` the
kernel's own noise (``sampling.noise``), and the raw logprob ``log_softmax(raw)[token]``. Without a GPU the kernel
runs in Triton's interpreter (the conftest sets it); the GPU test runs a whole step at DeepSeek-V4's vocabulary."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.engine.sampler import Sampler  # noqa: E402
from deepinfer.kernels.sampling import noise, pack_params, sample  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

host = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on host tensors needs TRITON_INTERPRET=1"
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA device"
)
NEG = float("-inf")

CASES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
    SamplingParams(temperature=2.0, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.2),
    SamplingParams(temperature=3.0, top_p=0.3),  # a flat distribution, a small nucleus: several rejection rounds
    SamplingParams(temperature=1.0, top_k=1),
]


def _run(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], raw=None, parts=None):
    raw = logits if raw is None else raw
    packed = pack_params(
        [0.0 if p.greedy else p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
        seeds,
        logits.shape[1],
    )
    return sample(logits, raw, packed.to(logits.device), parts)


def _expected(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> list[int]:
    """The race over the torch sampler's kept set, with the kernel's noise."""
    g = noise(torch.tensor(seeds, dtype=torch.int64, device=logits.device), logits.shape[1])
    out = []
    for i, p in enumerate(params):
        x = logits[i]
        if p.greedy:
            out.append(int(torch.argmax(x)))
            continue
        kept = Sampler._filtered_probs(x[None], [p])[0] > 0
        inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(p.temperature, dtype=torch.float32)
        score = torch.where(kept, x * inv_t.to(x.device) + g[i], NEG)
        out.append(int(torch.argmax(score)))
    return out


def _check(logits, params, seeds, raw=None, parts=None):
    tok, lp = _run(logits, params, seeds, raw, parts)
    assert tok.tolist() == _expected(logits, params, seeds)
    raw_lp = torch.log_softmax(logits if raw is None else raw, -1)
    torch.testing.assert_close(lp, raw_lp.gather(1, tok[:, None]).squeeze(1), atol=2e-5, rtol=1e-5)
    return tok


@host
@pytest.mark.parametrize("vocab", [6, 300, 5000])  # 5000: two noise blocks, the second partial
def test_matches_the_race_over_the_reference_kept_set(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = [(p, 17 * j + i) for i, p in enumerate(CASES) for j in range(3)]
    logits = torch.randn(len(rows), vocab, generator=gen) * 2
    _check(logits, [p for p, _ in rows], [s for _, s in rows])


@host
def test_the_rejection_rounds_alone(monkeypatch):
    """A short list of 2 (longer lists take the rejection rounds): every filter through the rounds and the radix
    select, the same tokens as the reference."""
    import deepinfer.kernels.sampling as sampling

    widths = sampling._widths
    monkeypatch.setattr(sampling, "_widths", lambda v, cuda: (*widths(v, cuda)[:2], 2))
    gen = torch.Generator().manual_seed(4)
    rows = [(p, 31 * j + i) for i, p in enumerate(CASES) for j in range(2)]
    logits = torch.randn(len(rows), 300, generator=gen) * 2
    _check(logits, [p for p, _ in rows], [s for _, s in rows])


@host
def test_the_first_pass_split_over_programs():
    """Three programs a row for the first pass (whole noise blocks each, the last partial): the same tokens and
    logprobs as one, bit for bit, with constrained rows (the raw logits apart)."""
    gen = torch.Generator().manual_seed(9)
    raw = torch.randn(5, 9000, generator=gen) * 2
    logits = raw.clone()
    logits[1, :6000] = NEG  # row 1's maximum and leader in the last part
    logits[3, 4096:] = NEG
    params = [CASES[i] for i in (0, 1, 3, 4, 7)]
    seeds = [5, 6, 7, 8, 9]
    one = _check(logits, params, seeds, raw=raw, parts=1)
    tok, lp = _run(logits, params, seeds, raw, parts=3)
    assert torch.equal(tok, one)
    torch.testing.assert_close(lp, _run(logits, params, seeds, raw, parts=1)[1], atol=1e-6, rtol=0)


def test_the_invariant_mode_splits_every_batch_as_it_splits_one_row(monkeypatch):
    """By default the first pass gives a row fewer programs in a larger batch (about two waves of the GPU), and its
    logprob sums another set of partials; the batch-invariant mode splits every batch the same way."""
    from deepinfer.kernels import sampling

    monkeypatch.setitem(sampling._SMS, 0, 132)  # (an H100's or H200's SMs: no GPU needed to pick the split)
    cuda, vocab = torch.device("cuda", 0), 129280  # DeepSeek-V4's vocabulary: 32 noise blocks
    assert [sampling._parts(b, vocab, cuda) for b in (1, 16, 64)] == [32, 17, 5]
    assert {sampling._parts(b, vocab, cuda, invariant=True) for b in (1, 16, 64, 256)} == {32}
    assert sampling._parts(64, vocab, torch.device("cpu"), invariant=True) == 1


@host
def test_a_rows_logprob_is_bit_identical_alone_and_in_a_batch_with_one_split():
    """A row sampled alone and among 15 others: the same token always; the same logprob bit for bit when the split
    is the same (what the invariant mode keeps), not always with another split (as the default picks by batch)."""
    gen = torch.Generator().manual_seed(11)
    vocab = 4 * 4096
    batch = torch.randn(16, vocab, generator=gen) * 3
    params, seeds = [CASES[3]] * 16, list(range(100, 116))
    alone = _run(batch[:1], params[:1], seeds[:1], parts=4)
    together = _run(batch, params, seeds, parts=4)
    assert torch.equal(alone[0], together[0][:1]) and torch.equal(alone[1], together[1][:1])
    split = _run(batch, params, seeds, parts=2)
    assert torch.equal(split[0], together[0])
    assert not torch.equal(split[1], together[1])  # another split rounds some logprobs differently


@host
def test_tied_logits_top_k_cuts_a_tie_by_id():
    """Integer logits (large tie groups): top-k keeps the lower ids of the group it cuts, as the stable sort does."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (8, 300), generator=gen).float()
    params = [
        SamplingParams(temperature=1.0, top_k=k, top_p=tp)
        for k, tp in ((10, 1.0), (37, 1.0), (75, 1.0), (150, 0.37), (299, 0.61), (1, 1.0), (2, 1.0), (0, 0.2))
    ]
    tok = _check(logits, params, list(range(8)))
    assert tok[5] == int(torch.argmax(logits[5]))  # top_k=1: the first maximum


@host
def test_top_p_boundaries():
    """``engine.sampler``'s top-p cases: the probabilities [0.5, 0.25, 0.15, 0.1] (and 4 masked tokens)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    x = torch.cat([probs.log(), torch.full((4,), -1e9)])
    for top_p, allowed in ((1e-6, 1), (0.5, 1), (0.51, 2), (0.75, 2), (0.76, 3), (1.0, 4)):
        seeds = list(range(24))
        tok = _check(x.expand(24, -1).contiguous(), [SamplingParams(top_p=top_p)] * 24, seeds)
        assert set(tok.tolist()) == set(range(allowed)), top_p  # 24 draws reach every kept token here


@host
def test_constrained_rows_choose_allowed_tokens_and_report_raw_logprobs():
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(6, 700, generator=gen)
    allowed = torch.rand(6, 700, generator=gen) < 0.1
    allowed[5] = False
    allowed[5, 123] = True  # one allowed token
    logits = raw.masked_fill(~allowed, NEG)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=50), SamplingParams(top_p=0.9, temperature=1.5)]
    params += [SamplingParams(min_p=0.3), SamplingParams(top_k=200, top_p=0.95), SamplingParams(top_k=5)]
    tok = _check(logits, params, [9, 8, 7, 6, 5, 4], raw=raw)
    assert all(allowed[i, t] for i, t in enumerate(tok.tolist()))
    assert tok[5] == 123


@host
def test_a_seeded_row_ignores_its_batch():
    gen = torch.Generator().manual_seed(11)
    batch = torch.randn(6, 900, generator=gen)
    params = [CASES[i] for i in (1, 2, 3, 4, 5, 7)]
    seeds = [101, 102, 103, 104, 105, 106]
    tok, lp = _run(batch, params, seeds)
    for r in (0, 3, 5):
        alone, alone_lp = _run(batch[r : r + 1].clone(), [params[r]], [seeds[r]])
        assert alone.item() == tok[r].item() and torch.equal(alone_lp, lp[r : r + 1])
    swapped, _ = _run(batch.flip(0).contiguous(), params[::-1], seeds[::-1])
    assert swapped.flip(0).tolist() == tok.tolist()
    other, _ = _run(batch, params, [s + 1000 for s in seeds])
    assert other.tolist() != tok.tolist()  # other seeds, other draws (6 rows of wide distributions)


@host
def test_noise_is_gumbel_and_its_layout_ignores_the_widths():
    g = noise(torch.tensor([7, 8], dtype=torch.int64), 20000)
    x = torch.sort(g[0]).values.double()
    cdf = torch.exp(-torch.exp(-x))
    n = x.numel()
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max().item()
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at 1%
    assert abs(torch.corrcoef(g).item() if g.dim() == 1 else torch.corrcoef(g)[0, 1].item()) < 0.03
    assert torch.equal(noise(torch.tensor([7]), 6)[0], g[0, :6])  # narrower programs, the same noise
    assert torch.equal(noise(torch.tensor([8]), 4100)[0], g[1, :4100])


@host
def test_edge_rows():
    x = torch.full((4, 50), NEG)
    x[0, 31] = 0.0  # one finite token
    x[1] = 2.0  # all equal
    x[2, 5] = x[2, 9] = 1.0
    x[3, :] = torch.linspace(0, 1, 50)
    params = [SamplingParams(top_k=3, top_p=0.5), SamplingParams(top_k=1), SamplingParams(min_p=1.0),
              SamplingParams(temperature=1e-8, top_p=0.5)]  # fmt: skip
    tok = _check(x, params, [1, 2, 3, 4])
    assert tok.tolist() == [31, 0, 5, 49]


@host
def test_the_sampler_on_the_kernel_path():
    """``Sampler(kernel=True)``: seeded rows repeat, unseeded rows draw, constraints and top logprobs as the torch
    path."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 60, generator=gen)
    allowed = torch.zeros(4, 60, dtype=torch.bool)
    allowed[:, [3, 7, 11, 40]] = True
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(seed=5, top_k=2), SamplingParams(),
              SamplingParams(top_p=0.5, logprobs=1)]  # fmt: skip
    k = Sampler(kernel=True)
    out = k(logits, params, [None, 5, None, 77], lambda z: z.masked_fill_(~allowed, NEG))
    assert set(out.token_ids.tolist()) <= {3, 7, 11, 40}
    assert out.token_ids[0] == [3, 7, 11, 40][int(logits[0, [3, 7, 11, 40]].argmax())]
    ref = Sampler(kernel=False)(logits, params, [None, 5, None, 77])
    assert out.top_logprobs[0] == ref.top_logprobs[0] and out.top_logprobs[3] == ref.top_logprobs[3]
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    again = k(logits, params, [None, 5, None, 77], lambda z: z.masked_fill_(~allowed, NEG))
    assert again.token_ids[1] == out.token_ids[1] and again.token_ids[3] == out.token_ids[3]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="params"):
        sample(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(3, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="fp32"):
        sample(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8), torch.zeros(2, 6, dtype=torch.int64))


@needs_gpu
def test_gpu_a_step_at_v4_vocabulary():
    """64 rows of 129280 logits, every case, against the reference race on the GPU; a row alone gives its token."""
    gen = torch.Generator().manual_seed(0)
    vocab = 129280
    logits = (torch.randn(64, vocab, generator=gen) * 3).cuda()
    params = [CASES[i % len(CASES)] for i in range(64)]
    seeds = [1000 + i for i in range(64)]
    tok = _check(logits, params, seeds)
    alone, _ = _run(logits[40:41].clone(), params[40:41], seeds[40:41])
    assert alone.item() == tok[40].item()
    raw = logits.clone()
    masked = raw.clone()
    masked[:, 1000:] = NEG
    tok2 = _check(masked, params, seeds, raw=raw)
    assert int(tok2.max()) < 1000


@needs_gpu
def test_gpu_engine_seeded_requests_repeat_in_any_batch(tmp_path):
    """The engine on the NVIDIA backend samples with the kernel: a seeded request (top-k, top-p) gives the same
    tokens and logprobs alone and inside a batch of greedy, unseeded and seeded neighbours; another seed differs."""
    from deepinfer import LLM
    from deepinfer.checkpoint.tiny import make_tiny_model

    llm = LLM(model=make_tiny_model(tmp_path / "m", seed=0), accelerator="nvidia", dtype="float32", num_pages=64,
              page_size=16, batch_invariant=True)  # fmt: skip
    target = {"prompt_token_ids": list(range(5, 45))}

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.2, top_k=40, top_p=0.9, max_tokens=10, seed=seed, logprobs=2,
                              ignore_eos=True)  # fmt: skip

    (alone,) = llm.generate(target, params(7))
    ref = (tuple(alone.outputs[0].token_ids), tuple(tuple(d.items()) for d in alone.outputs[0].logprobs))
    assert len(ref[0]) == 10 and len(set(ref[0])) > 1
    others = [{"prompt_token_ids": list(range(100 + i, 130 + 2 * i))} for i in range(5)]
    other_params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(max_tokens=9),
                    SamplingParams(seed=3, min_p=0.1, max_tokens=4), SamplingParams(top_p=0.5, max_tokens=12),
                    SamplingParams(temperature=0.3, top_k=5, max_tokens=7)]  # fmt: skip
    outs = llm.generate(others[:2] + [target] + others[2:], other_params[:2] + [params(7)] + other_params[2:])
    got = outs[2].outputs[0]
    assert (tuple(got.token_ids), tuple(tuple(d.items()) for d in got.logprobs)) == ref
    assert tuple(llm.generate(target, params(8))[0].outputs[0].token_ids) != ref[0]
