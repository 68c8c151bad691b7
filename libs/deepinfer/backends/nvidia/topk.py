"""Top-k and row selection without full-width sorts, bit-identical to the reference's stable sorts: unique int64 keys
(``packed_keys``) and one ``torch.topk`` (``NvidiaOps.topk_indices`` / ``select_rows`` over wide rows). Any device, no
host sync, no Triton."""

from __future__ import annotations

import torch

_NAN_MAGNITUDE = 0x7F800001  # one past the bits of +inf: the magnitude every NaN is given in packed_keys
_COLUMN_MAX = (1 << 32) - 1  # the low 32 bits of a packed key: _COLUMN_MAX - column


def packed_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ``[..., W]`` of ``scores [..., W]`` (float32 / bfloat16 / float16, compared in fp32, which holds them
    exactly), unique within a row and ordered as the reference's stable descending sort orders the scores: a higher
    score has the larger key and, among equal scores, the lower column has the larger key.

    ``key = v · 2³² + (2³² − 1 − column)`` with ``v`` the order-preserving int32 of the score: ``+bits(|s|)`` for
    ``s ≥ 0``, ``−bits(|s|)`` for ``s < 0``. So ``−0.0`` and ``+0.0`` get the same ``v = 0`` (a sort compares them
    equal: they tie and the lower column wins), ``±inf`` get ``±0x7f800000``, and every NaN, whatever its sign and
    payload, gets ``0x7f800001``: above ``+inf`` and tied with the other NaNs, as the CPU's ``torch.sort`` orders NaN
    (larger than every number, equal to each other; CUDA's radix-sort path of ``torch.sort`` may place negative-sign
    NaNs elsewhere, pytorch#190781 — the CPU order is the one followed here). Scores are never NaN in practice.
    Element-wise ops only: no host sync, no data-dependent shape (CUDA-graph capturable)."""
    s = scores.float()
    magnitude = s.abs().view(torch.int32).clamp_(max=_NAN_MAGNITUDE)
    value = torch.where(s < 0, -magnitude, magnitude)
    low = torch.arange(_COLUMN_MAX, _COLUMN_MAX - s.shape[-1], -1, dtype=torch.int64, device=s.device)
    return torch.add(low, value, alpha=1 << 32)  # int64 arithmetic (the int32 operand is promoted)


def packed_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``ReferenceOps.topk_indices`` (the first ``k`` of a stable descending sort over the last dim) as one
    ``torch.topk`` of ``packed_keys``: the keys are unique, so the selection and its order are fully determined and
    equal the stable sort's first ``min(k, W)`` columns exactly, in the same order. Any device (the tests run it on
    the CPU); ``scores`` in float32 / bfloat16 / float16."""
    k = min(k, scores.shape[-1])
    return torch.topk(packed_keys(scores), k, dim=-1, largest=True, sorted=True).indices


def packed_select_rows(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceOps.select_rows`` without full-width sorts: the top ``min(k, W)`` columns by ``packed_keys``
    (unordered), then one sort of those ``k`` indices with the invisible ones pushed after the visible ones.
    ``rows[..., :count]`` (the chosen visible rows, ascending) and ``count`` equal the reference's exactly; the entries
    past ``count`` are the chosen invisible rows, ascending (the reference lists the rows it did not choose there):
    valid row indices in ``[0, W)``, never read by the callers. Any device; no host sync."""
    width = scores.shape[-1]
    k = min(k, width)
    if k == 0:
        rows = torch.zeros(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
        return rows, rows.sum(-1)
    top = torch.topk(packed_keys(scores), k, dim=-1, largest=True, sorted=False).indices
    shown = visible.gather(-1, top)
    # visible rows shifted to [-W, 0) sort before the invisible ones in [0, W); the remainder undoes the shift
    rows = torch.add(top, shown, alpha=-width).sort(dim=-1).values.remainder(width)
    return rows, shown.sum(-1)


__all__ = ["packed_keys", "packed_select_rows", "packed_topk_indices"]
