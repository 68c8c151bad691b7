"""The acceptance rule of speculative decoding (``engine.speculative.acceptance``) against decoding without it.

A toy target (logits a fixed random function of the last two tokens) is decoded twice with the engine's sampler:
one token per step, and in verify steps over drafts of random lengths (a drafter that is right at a set rate, or
proposes random tokens). Greedy and seeded requests must emit the same tokens either way, token for token, in any
batch composition; the counts must be the longest agreeing prefixes.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.engine.sampler import Sampler
from deepinfer.engine.speculative.acceptance import (
    NO_DRAFT,
    accepted_counts,
    aligned_drafts,
    emitted,
    kept,
    row_layout,
)
from deepinfer.engine.worker import position_seed
from deepinfer.sampling_params import SamplingParams

V, K = 24, 97
TABLE = torch.randn(K, V, generator=torch.Generator().manual_seed(7)) * 2.5


def target_logits(prefix: list[int]) -> torch.Tensor:
    a, b = (prefix[-2] if len(prefix) > 1 else 0), prefix[-1]
    return TABLE[(a * 31 + b) % K]


def seed_of(p: SamplingParams, position: int) -> int | None:
    return None if p.greedy or p.seed is None else position_seed(p.seed, position)


def plain(prompt: list[int], p: SamplingParams, n: int, sampler: Sampler) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        out = sampler(target_logits(seq)[None], [p], [seed_of(p, len(seq))])
        seq.append(int(out.token_ids[0]))
    return seq[len(prompt) :]


def speculative(
    prompts: list[list[int]], params: list[SamplingParams], n: int, sampler: Sampler, rng: random.Random, right: float
) -> tuple[list[list[int]], int, int]:
    """Every sequence in one batch of verify steps; returns outputs, drafts proposed and drafts kept."""
    seqs = [list(x) for x in prompts]
    proposed = kept = 0
    while any(len(s) - len(x) < n for s, x in zip(seqs, prompts)):
        live = [b for b, (s, x) in enumerate(zip(seqs, prompts)) if len(s) - len(x) < n]
        drafts = []
        for b in live:  # the drafter: the target's greedy continuation, each token right with probability ``right``
            d, ctx = [], list(seqs[b])
            for _ in range(rng.randrange(0, 5)):
                t = int(target_logits(ctx).argmax()) if rng.random() < right else rng.randrange(V)
                d.append(t)
                ctx.append(t)
            drafts.append(d)
        starts, lens = row_layout([len(d) for d in drafts])
        rows, row_params, seeds = [], [], []
        for b, d in zip(live, drafts):
            for j in range(len(d) + 1):
                prefix = seqs[b] + d[:j]
                rows.append(target_logits(prefix))
                row_params.append(params[b])
                seeds.append(seed_of(params[b], len(prefix)))
        out = sampler(torch.stack(rows), row_params, seeds)
        counts = accepted_counts(out.token_ids, aligned_drafts(drafts), torch.tensor(lens))
        for b, toks, d, c in zip(live, emitted(out.token_ids.tolist(), starts, counts.tolist()), drafts, counts):
            assert toks[: int(c)] == d[: int(c)]
            proposed, kept = proposed + len(d), kept + int(c)
            seqs[b].extend(toks)
    return [s[len(x) : len(x) + n] for s, x in zip(seqs, prompts)], proposed, kept


PARAMS = st.sampled_from(
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.3, top_p=0.9, seed=12345),
        SamplingParams(temperature=0.7, top_k=5, seed=2**40 + 3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=99),
    ]
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(PARAMS, min_size=1, max_size=5),
    right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_speculation_emits_what_plain_decoding_emits(params: list[SamplingParams], right: float, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 4))] for _ in params]
    sampler = Sampler(kernel=False)
    spec, proposed, kept = speculative(prompts, params, 12, sampler, rng, right)
    for x, p, out in zip(prompts, params, spec):
        assert out == plain(x, p, 12, sampler)
    if right == 0.0 and proposed:
        assert kept <= proposed  # random drafts: rarely kept, never wrongly


def test_a_right_drafter_is_kept_whole_for_greedy_requests() -> None:
    rng = random.Random(0)
    p = SamplingParams(temperature=0)
    out, proposed, kept = speculative([[1, 2]], [p], 40, Sampler(kernel=False), rng, 1.0)
    assert proposed > 10 and kept == proposed
    assert out[0] == plain([1, 2], p, 40, Sampler(kernel=False))


def test_counts_are_the_longest_agreeing_prefixes() -> None:
    drafts = [[5, 6, 7], [], [1, 2], [9]]
    samples = [5, 6, 0, 3] + [4] + [1, 2, 8] + [2, 9]
    starts, lens = row_layout([len(d) for d in drafts])
    assert starts == [0, 4, 5, 8] and lens == [4, 1, 3, 2]
    counts = accepted_counts(torch.tensor(samples), aligned_drafts(drafts), torch.tensor(lens)).tolist()
    assert counts == [2, 0, 2, 0]
    assert emitted(samples, starts, counts) == [[5, 6, 0], [4], [1, 2, 8], [2]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=5), st.lists(st.integers(0, 3), min_size=6, max_size=6)),
        min_size=1,
        max_size=5,
    )
)
def test_the_host_and_device_forms_agree(cases: list[tuple[list[int], list[int]]]) -> None:
    """``kept`` (host lists, the runner's settle) and ``accepted_counts`` (device tensors) are one rule."""
    drafts = [d for d, _ in cases]
    samples = [s[: len(d) + 1] for d, s in cases]
    _, lens = row_layout([len(d) for d in drafts])
    flat = torch.tensor([t for s in samples for t in s])
    counts = accepted_counts(flat, aligned_drafts(drafts), torch.tensor(lens)).tolist()
    assert counts == [kept(s, d) for s, d in zip(samples, drafts)]


def test_a_match_after_a_miss_is_not_kept() -> None:
    counts = accepted_counts(torch.tensor([1, 7, 3, 0]), aligned_drafts([[1, 2, 3]]), torch.tensor([4]))
    assert counts.tolist() == [1]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="draft lengths"):
        row_layout([1, -1])
    with pytest.raises(ValueError, match="draft token ids"):
        aligned_drafts([[1, NO_DRAFT]])
    with pytest.raises(ValueError, match="flat and alike"):
        accepted_counts(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.tensor([3]))
