"""Sampling a verify step's rows and keeping the drafts the samples agree with (``acceptance``'s rule), for any model
whose verify forward gives the flat rows of ``acceptance``'s layout (DeepSeek-V4: ``models/deepseek_v4/
speculative.py``, which then rolls each sequence back to ``p_b + count + 1`` consumed tokens).

Row ``j`` of sequence ``b`` is sampled as a step without speculation samples position ``p_b + 1 + j``: the
request's parameters and, for a seeded request, ``position_seed(seed, p_b + 1 + j)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.sampler import Sampler
from deepinfer.engine.speculative.acceptance import accepted_counts, aligned_drafts, emitted, row_layout
from deepinfer.engine.worker import position_seed
from deepinfer.sampling_params import SamplingParams


@dataclass
class Verdict:
    """Per sequence: drafts kept (``counts``) and tokens emitted (``tokens``: the kept drafts and one more)."""

    counts: list[int]
    tokens: list[list[int]]


def row_seeds(params: list[SamplingParams], consumed: list[int], draft_lens: list[int]) -> list[int | None]:
    """The seed of every verify row (None: greedy or unseeded): sequence ``b`` consumed ``consumed[b]`` tokens."""
    out: list[int | None] = []
    for p, c, n in zip(params, consumed, draft_lens):
        seeded = not p.greedy and p.seed is not None
        out += [position_seed(p.seed, c + 1 + j) if seeded else None for j in range(n + 1)]
    return out


def accept(
    sampler: Sampler,
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    consumed: list[int],
) -> Verdict:
    """Sample the verify rows ``logits [R, V]`` (sequence ``b``: its ``len(drafts[b]) + 1`` rows, having consumed
    ``consumed[b]`` tokens before the step) and apply the acceptance rule."""
    lens = [len(d) for d in drafts]
    starts, rows = row_layout(lens)
    row_params = [p for p, n in zip(params, rows) for _ in range(n)]
    out = sampler(logits, row_params, row_seeds(params, consumed, lens))
    dev = logits.device
    counts = accepted_counts(out.token_ids, aligned_drafts(drafts, dev), torch.tensor(rows, device=dev)).tolist()
    return Verdict(counts, emitted(out.token_ids.tolist(), starts, counts))


__all__ = ["Verdict", "accept", "row_seeds"]
