"""Which drafts a verify step keeps: the acceptance rule of speculative decoding.

A verify step runs the target model over, for each sequence ``b``, its last token followed by its ``n_b`` drafts
``d_1 .. d_n`` (``n_b`` may differ between sequences, 0 included: a plain decode row). Row ``j`` of sequence
``b`` (``j = 0 .. n_b``) holds the target's logits for position ``p_b + 1 + j`` given the sequence and the drafts
before it. Every row is sampled with the ordinary sampler, as a step without speculation would sample that
position: the request's own parameters, and for a seeded request the seed of that position
(``position_seed(seed, position)``), so a row's token depends on its logits and its position only. Call those
samples ``t_0 .. t_n``. The sequence keeps the longest prefix of drafts equal to the samples, ``a`` drafts with
``t_j == d_{j+1}`` for every ``j < a``, and emits ``t_0 .. t_a``: the accepted drafts and one more token, the
target's own sample at the first disagreement (or after the last draft).

Why the output is exact. Each emitted ``t_j`` was sampled from the target's distribution given exactly the tokens
emitted before it (the drafts before row ``j`` equal the samples ``t_0 .. t_{j-1}``, or row ``j`` is not emitted).
So speculation emits what a run without it would emit:

* greedy: the same tokens, token for token (each ``t_j`` is the argmax given the same prefix);
* seeded sampling: the same tokens, token for token (same logits, same position seed, same draw), in any batch and
  with any drafts or draft lengths; the drafts only decide how many tokens one step emits;
* unseeded sampling: the same distribution. For a deterministic draft (both of our drafters propose their argmax)
  this rule *is* the standard rejection rule: a draft ``d`` is kept with probability ``p(d)`` (``= min(1, p(d) /
  q(d))`` with ``q`` the one-hot draft distribution), and after a rejection the emitted token is distributed as
  ``p`` without ``d``, renormalised (``= norm(max(0, p - q))``). A drafter that samples its drafts would need the
  general rule (accept with ``min(1, p/q)``) to keep its higher acceptance; none of ours does.

Structured outputs: each row is masked by the grammar state after the drafts before it (the matcher advanced
through the drafts, then rolled back to the accepted prefix), so a kept draft is one the grammar allows.

Layout: the verify rows of all sequences are flat, sequence after sequence (``starts[b]``, ``lens[b] = n_b + 1``);
``drafts`` is aligned with the rows: row ``j < n_b`` holds ``d_{j+1}``, the sequence's last row ``NO_DRAFT``.
``accepted_counts`` keeps everything on the device (no host synchronisation); ``kept`` is the same rule on host lists
(what the runner's settle uses: a verify step ends on the host).
"""

from __future__ import annotations

import torch

NO_DRAFT = -1  # the draft of a sequence's last verify row (no draft follows it): never equal to a sample


def row_layout(draft_lens: list[int]) -> tuple[list[int], list[int]]:
    """``starts`` and ``lens`` of the verify rows of sequences with ``draft_lens`` drafts each (``lens = n + 1``)."""
    if any(n < 0 for n in draft_lens):
        raise ValueError(f"draft lengths must be >= 0, got {draft_lens}")
    starts, at = [], 0
    for n in draft_lens:
        starts.append(at)
        at += n + 1
    return starts, [n + 1 for n in draft_lens]


def aligned_drafts(drafts: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """The flat ``drafts`` row tensor (see the module docstring) of the sequences' draft lists."""
    flat: list[int] = []
    for d in drafts:
        if any(t < 0 for t in d):
            raise ValueError(f"draft token ids must be >= 0, got {d}")
        flat.extend(d)
        flat.append(NO_DRAFT)
    return torch.tensor(flat, dtype=torch.long, device=device)


def accepted_counts(samples: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Drafts kept per sequence (``[B]`` int64): the leading rows of each sequence whose sample equals its draft.

    ``samples`` and ``drafts``: ``[R]`` (the flat rows), ``lens``: ``[B]`` rows per sequence (``sum(lens) == R``,
    each at least 1); the sequence emits ``samples[start : start + count + 1]``."""
    if samples.shape != drafts.shape or samples.dim() != 1:
        shapes = f"{tuple(samples.shape)}, {tuple(drafts.shape)}"
        raise ValueError(f"samples and drafts must be flat and alike, got {shapes}")
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=samples.numel())
    miss = (samples != drafts).long()
    before = torch.cumsum(miss, 0) - miss  # misses in the rows before this one, over all sequences
    first = torch.cumsum(lens, 0) - lens  # each sequence's first row
    leading = before - before[first][seq] == 0  # no miss earlier in its own sequence...
    kept = (leading & (miss == 0)).long()  # ...and a match here
    return torch.zeros(lens.numel(), dtype=torch.long, device=samples.device).index_add_(0, seq, kept)


def kept(samples: list[int], drafts: list[int]) -> int:
    """The host form of ``accepted_counts`` for one sequence: its leading drafts equal to the samples of the rows
    before them (the runner's settle has the samples on the host already)."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


def emitted(samples: list[int], starts: list[int], counts: list[int]) -> list[list[int]]:
    """Each sequence's emitted tokens (host lists): its kept drafts' samples and the one after them."""
    return [samples[s : s + c + 1] for s, c in zip(starts, counts)]


__all__ = ["NO_DRAFT", "accepted_counts", "aligned_drafts", "emitted", "kept", "row_layout"]
