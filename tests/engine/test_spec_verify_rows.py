"""Sampling a verify step's rows (``engine.speculative.verify``): each row as plain decoding samples its position
(the request's parameters, the position's seed), then the acceptance rule."""

from __future__ import annotations

import torch

from deepinfer.engine.sampler import Sampler
from deepinfer.engine.speculative.verify import accept, row_seeds
from deepinfer.engine.worker import position_seed
from deepinfer.sampling_params import SamplingParams


def test_rows_are_seeded_by_their_positions() -> None:
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=7)
    seeds = row_seeds([greedy, seeded, SamplingParams(temperature=1.0)], [4, 9, 2], [1, 2, 0])
    assert seeds == [None, None, position_seed(7, 10), position_seed(7, 11), position_seed(7, 12), None]


def test_greedy_rows_keep_the_agreeing_prefix() -> None:
    V = 10
    want = [3, 5, 1, 7, 2]  # the argmax of each row: sequence 0 has 3 drafts, sequence 1 none
    logits = torch.full((5, V), -1.0)
    logits[torch.arange(5), torch.tensor(want)] = 1.0
    p = SamplingParams(temperature=0)
    v = accept(Sampler(kernel=False), logits, [[3, 5, 9], []], [p, p], [11, 4])
    assert v.counts == [2, 0] and v.tokens == [[3, 5, 1], [2]]


def test_seeded_rows_sample_as_plain_decoding_does() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler(kernel=False)
    plain = [int(sampler(logits[j : j + 1], [p], [position_seed(3, 21 + j)]).token_ids[0]) for j in range(4)]
    v = accept(sampler, logits, [plain[:3]], [p], [20])
    assert v.counts == [3] and v.tokens == [plain]
