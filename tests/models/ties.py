"""Tie-aware parity: the reference's top-k selections, their margins per position, and a replay of them on our side.

A top-k selection (the sparse-attention indexer's rows, the candidate blocks, the MoE router's experts) is a
discontinuous function of its scores: where the k-th and the (k+1)-th score of a row are within float rounding of each
other, op-order differences of ~1e-7 between two correct implementations can pick different rows, and that position's
output (and, through attention, every later position's) moves by far more than rounding. The protocol:

- ``record_topk(seq_len)`` runs the reference with ``torch.topk`` / ``Tensor.topk`` instrumented: every call whose
  rows are one sequence's positions is logged with its scores, k and selected indices.
- ``TopkLog.margins()``: per position, the smallest relative margin ``(s_k - s_{k+1}) / max(|s_k|, |s_{k+1}|)`` over
  every logged call (inf where a row has no competitor). Exactly equal scores (ReLU's exact zeros) that the reference
  broke by the documented rule (equal scores to the lower index, ours) are not near-ties; broken otherwise, margin 0.
- ``split_at_first_tie``: positions before the first near-tie (margin < ``TIE_RTOL``) are held to the parity tolerance;
  positions at and after it are reported (count, first position, margin, deviation) but not held to it.
- ``replay_on(ops, log)``: our ``ops.topk_indices`` returns the reference's selected indices, call by call (the calls
  come in the same order and shapes for a single whole-sequence forward): a deviation that comes from a near-tie
  broken differently disappears under the replay; a real difference does not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

TIE_RTOL = 1e-4  # a relative top-k margin below this is a near-tie


@dataclass
class TopkCall:
    scores: torch.Tensor  # [positions, width] (fp32 copy of what the reference ranked)
    k: int
    indices: torch.Tensor  # [positions, k]: the reference's choice

    def margins(self) -> torch.Tensor:
        """Relative margin between the k-th and (k+1)-th score per position: inf where a row has no competitor or an
        exact tie the reference broke by the documented rule (the lower index), 0 for one it broke otherwise."""
        n, width = self.scores.shape
        if width <= self.k:
            return torch.full((n,), math.inf)
        order = self.scores.double().sort(dim=-1, descending=True, stable=True)
        a, b = order.values[:, self.k - 1], order.values[:, self.k]
        gap = (a - b) / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
        by_rule = (order.indices[:, : self.k].sort(-1).values == self.indices.sort(-1).values).all(-1)
        gap = torch.where(a == b, torch.where(by_rule, math.inf, 0.0).double(), gap)
        return torch.where(torch.isfinite(a) & torch.isfinite(b), gap, math.inf).float()


@dataclass
class TopkLog:
    seq_len: int
    calls: list[TopkCall] = field(default_factory=list)

    def margins(self) -> torch.Tensor:
        """Per position, the smallest relative top-k margin over all logged calls."""
        out = torch.full((self.seq_len,), math.inf)
        for c in self.calls:
            out = torch.minimum(out, c.margins())
        return out


def _recording(fn, log: TopkLog):
    def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's signature
        res = fn(x, k, dim=dim, largest=largest, sorted=sorted)
        last = dim in (-1, x.dim() - 1)
        if last and largest and x.dim() >= 1 and x.shape[-1] > 0 and x.numel() == log.seq_len * x.shape[-1]:
            log.calls.append(
                TopkCall(x.detach().reshape(log.seq_len, -1).float(), k, res.indices.reshape(log.seq_len, k))
            )
        return res

    return topk


@contextlib.contextmanager
def record_topk(seq_len: int) -> Iterator[TopkLog]:
    """Log every ``torch.topk`` / ``Tensor.topk`` call over the ``seq_len`` positions of one sequence (whatever
    ``Tensor.topk`` is on entry, e.g. ``reference_rules``' stable one, keeps doing the selecting)."""
    log = TopkLog(seq_len)
    saved_fn, saved_method = torch.topk, torch.Tensor.topk
    try:
        torch.topk = _recording(saved_fn, log)
        torch.Tensor.topk = _recording(saved_method, log)
        yield log
    finally:
        torch.topk, torch.Tensor.topk = saved_fn, saved_method


@dataclass
class TieSplit:
    first: int  # first near-tie position (seq_len: none)
    ties: int  # positions with a near-tie
    margin: float  # the smallest margin at a near-tie (inf: none)
    before: float  # max |Δ logprob| before ``first``
    after: float  # max |Δ logprob| at and after ``first`` (0: none)

    def __str__(self) -> str:
        if self.ties == 0:
            return f"no near-tie, max |Δ| {self.before:.2e}"
        return (
            f"{self.ties} near-tie positions, first {self.first} (margin {self.margin:.1e}): "
            f"max |Δ| {self.before:.2e} before, {self.after:.2e} at/after"
        )


def logprob_diffs(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position, max |Δ logprob| over the vocabulary."""
    return (got.float().log_softmax(-1) - ref.float().log_softmax(-1)).abs().amax(-1)


def split_at_first_tie(diffs: torch.Tensor, margins: torch.Tensor, rtol: float = TIE_RTOL) -> TieSplit:
    tie = margins < rtol
    n = len(diffs)
    first = int(tie.nonzero()[0, 0]) if bool(tie.any()) else n
    return TieSplit(
        first=first,
        ties=int(tie.sum()),
        margin=float(margins[tie].min()) if bool(tie.any()) else math.inf,
        before=float(diffs[:first].max()) if first else 0.0,
        after=float(diffs[first:].max()) if first < n else 0.0,
    )


@contextlib.contextmanager
def replay_on(ops, log: TopkLog) -> Iterator[list[int]]:
    """Our ``ops.topk_indices`` returns the logged reference selections in order (shapes checked); yields the list
    of replayed call numbers, complete once the forward is done."""
    pending = list(log.calls)
    done: list[int] = []
    own = vars(ops).get("topk_indices")

    def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
        if not pending:
            raise AssertionError(f"our forward makes more top-k calls than the reference's {len(log.calls)}")
        call = pending.pop(0)
        if (scores.shape[0], k) != (call.scores.shape[0], call.k) or scores.shape[-1] != call.scores.shape[-1]:
            raise AssertionError(
                f"top-k call {len(done)}: ours {tuple(scores.shape)} k={k}, the reference's "
                f"{tuple(call.scores.shape)} k={call.k}"
            )
        done.append(len(done))
        return call.indices.to(scores.device)

    ops.topk_indices = topk_indices
    try:
        yield done
    finally:
        if own is None:
            del ops.topk_indices
        else:
            ops.topk_indices = own
        if pending:
            raise AssertionError(f"{len(pending)} reference top-k calls were not replayed")
