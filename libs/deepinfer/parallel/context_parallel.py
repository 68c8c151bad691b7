"""Balanced context parallelism for long prefills: a group of ``cp`` ranks runs the same sequences, and each step's
tokens are split among them, each rank computing everything for its own tokens.

A step's tokens stay with their rank through every layer: the embedding, mHC, the attention's projections and
queries, the indexer's scoring, the attention itself, the output projections and the MoE (whose experts are sharded
over all ranks as ever: each rank dispatches its own tokens). What crosses the group, per layer, is what the state
needs from every token: the window's KV row and the compressors' projections of each token (``STATE_KEYS``, a few
KiB a token). Every rank gathers them, all in one exchange a layer (``gather_many``), and keeps the whole
sequence's state (window, compressor buffers, compressed rows and index keys in its pages), as a tensor-parallel
group does, so the group's ranks hold the same state and any of them can continue the sequence. At the end of the
step the group gathers the final hidden streams.

**Balanced:** attention is causal, so the later tokens of a chunk read more keys (V4's indexer scores every
compressed row before the query: its work grows with the position). Each chunk is cut into ``2·cp`` equal pieces and
rank ``r`` takes pieces ``r`` and ``2·cp - 1 - r`` (one early, one late), the first rank rotating from chunk to
chunk so that short chunks spread too (``ContextParallel.split``).

Steps that the decode path runs (one token per sequence, speculative verify steps) are not split: every rank of the
group runs them whole. With the batch-invariant ops each chunk's queries attend sequence by sequence as in one
process, so the logits are one process's bit for bit; otherwise within fp32 rounding. The models' split steps are
``models.deepseek_v4.context_split`` and ``models.deepseek_v41.context_split`` (whose steps in a bounded decoder
replay, or capturing DSpark's features, run whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


@dataclass
class StepRows:
    """A step's tokens by rank: ``mine`` this rank's (ascending, on the device), ``every`` each rank's, ``total``."""

    mine: torch.Tensor
    every: list[torch.Tensor]
    total: int


class ContextParallel:
    """One rank's view of its context-parallel group (``group``: a ``torch.distributed`` group of ``size`` ranks,
    this one ``rank`` in it)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.steps = 0  # steps split so far

    def split(self, offsets: list[tuple[int, int]], total: int, device: torch.device | str = "cpu") -> StepRows:
        """Each rank's tokens of a step of ``total`` tokens whose chunks are ``offsets`` (module docstring:
        balanced)."""
        c = self.size
        per: list[list[np.ndarray]] = [[] for _ in range(c)]
        for j, (a, b) in enumerate(offsets):
            cuts = [a + (b - a) * p // (2 * c) for p in range(2 * c + 1)]
            for p in range(2 * c):
                if cuts[p + 1] > cuts[p]:
                    per[(min(p, 2 * c - 1 - p) + j) % c].append(np.arange(cuts[p], cuts[p + 1]))
        every = [torch.from_numpy(np.sort(np.concatenate(x)) if x else np.zeros(0, np.int64)).to(device) for x in per]
        return StepRows(every[self.rank], every, total)

    def gather(self, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """The step's rows of a per-token tensor, every rank's ``x`` (its ``rows.mine``) put in place."""
        counts = [len(r) for r in rows.every]
        pad = x.new_zeros((max(counts), *x.shape[1:]))
        pad[: x.shape[0]] = x
        parts = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(parts, pad, group=self.group)
        out = x.new_empty((rows.total, *x.shape[1:]))
        for idx, part, n in zip(rows.every, parts, counts):
            out[idx] = part[:n]
        return out

    def gather_many(self, xs: dict[str, torch.Tensor], rows: StepRows) -> dict[str, torch.Tensor]:
        """``gather`` of several per-token tensors (any dtypes) in one exchange: each token's rows of all of them
        packed as bytes side by side, gathered once, unpacked (the bits move unchanged)."""
        if not xs:
            return {}
        n = len(rows.mine)
        # (widths from the shapes: a rank may hold no token of a step, and reshape(0, -1) is ambiguous)
        flat = {k: x.contiguous().reshape(n, math.prod(x.shape[1:])).view(torch.uint8) for k, x in xs.items()}
        whole = self.gather(torch.cat(list(flat.values()), dim=1), rows)
        out, at = {}, 0
        for k, x in xs.items():
            width = flat[k].shape[1]
            out[k] = whole[:, at : at + width].contiguous().view(x.dtype).reshape(rows.total, *x.shape[1:])
            at += width
        return out


def splits(model: nn.Module, batch: object) -> bool:
    """Whether ``model``'s step ``batch`` is split over its context-parallel group: a group of several ranks, not a
    speculative verify step, not a step the decode path runs (one token per sequence), no chunk in a bounded
    decoder replay (DeepSeek-V4.1: those run whole)."""
    cp = getattr(model, "cp", None)
    if cp is None or cp.size == 1 or getattr(model, "verifying", False) or not batch.chunks:
        return False
    if any(getattr(c, "decoder_from", None) is not None for c in batch.chunks):
        return False
    return not all(c.length == 1 and c.state.replay_until <= c.start for c in batch.chunks)


__all__ = ["ContextParallel", "StepRows", "splits"]
