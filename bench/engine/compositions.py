"""A target sequence alone and inside batches of other sequences (batch invariance, issue 4): the step loop that
``bench/engine/batch_invariance.py`` runs on a device and ``tests/models/test_batch_invariance.py`` checks bit for
bit on the CPU."""

from __future__ import annotations

import random

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState


def split(n: int, rng: random.Random, largest: int) -> list[int]:
    """``n`` tokens cut into chunks of random sizes from 1 to ``largest``."""
    plan = []
    while n:
        plan.append(min(n, rng.randint(1, largest)))
        n -= plan[-1]
    return plan


def target_logits(
    model: torch.nn.Module,
    seqs: list[list[int]],
    plans: list[list[int]],
    rng: random.Random | None,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The logits of the target, ``seqs[0]`` (``sequence_logits``)."""
    return sequence_logits(model, seqs, plans, rng, page_size, dtype, device, only=0)[0]


def sequence_logits(
    model: torch.nn.Module,
    seqs: list[list[int]],
    plans: list[list[int]],
    rng: random.Random | None,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    only: int | None = None,
) -> list[torch.Tensor]:
    """The logits (fp32, on the CPU) of every position of each sequence (``only``: of that one only, the others'
    entries empty). Step ``s`` batches ``plans[i][s]`` tokens of each sequence ``i`` (0 or past the plan's end: not
    in this step), in an order ``rng`` shuffles (None: as given), with one head call per step, as the runner does;
    the cache holds ``dtype`` rows in pages of ``page_size``."""
    pages = -(-max(len(s) for s in seqs) // page_size)
    cache = PagedKVCache(model.config, pages * len(seqs), page_size, dtype, device)
    states = [SequenceState() for _ in seqs]
    tables = [torch.arange(i * pages, (i + 1) * pages, device=device) for i in range(len(seqs))]
    pos, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in range(max(len(p) for p in plans)):
        who = [i for i, p in enumerate(plans) if step < len(p) and p[step]]
        if not who:
            continue
        if rng is not None:
            rng.shuffle(who)
        chunks, toks = [], []
        for i in who:
            n = plans[i][step]
            chunks.append(SeqChunk(states[i], pos[i], n, tables[i]))
            toks.append(seqs[i][pos[i] : pos[i] + n])
            pos[i] += n
        batch = ForwardBatch.build(chunks, toks, device)
        logits = model.logits(model(batch, cache))
        for (a, b), i in zip(batch.offsets(), who):
            if only is None or i == only:
                outs[i].append(logits[a:b].float().cpu())
    return [torch.cat(o) if o else torch.empty(0) for o in outs]
