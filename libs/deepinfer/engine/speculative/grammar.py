"""Structured output with speculative decoding: the drafts a request's grammar allows, and each verify row's mask.

At launch a constrained chunk's drafts are walked through its matcher (``engine.constraints.ConstraintSet``): the
mask of row ``j`` is the grammar's allowed tokens after the drafts before it; a draft its row's mask refuses ends
the drafts there (no sample of that row could equal it, so it could never be kept), and the matcher is rolled back
to where it was. The verify rows are then sampled under those masks, so every kept draft, and the target's own
sample after the kept ones, is a token the grammar allows; the step's settle accepts the emitted tokens into the
matcher, as a plain step accepts its one token. The masks are filled on the host before the forward (a plain step
fills its rows in a background thread while the device runs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether the packed mask row ``mask`` (``ConstraintSet.fill``'s layout: bit ``t % 32`` of word ``t // 32``)
    allows ``token``."""
    if token < 0 or token >= 32 * mask.shape[-1]:
        return False
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def constrain(constraints: Any, request_id: str, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
    """The leading drafts the grammar allows and the masks of the verify rows (one more than those drafts:
    ``[len + 1, words]``); the matcher ends where it started."""
    rows: list[torch.Tensor] = []
    kept: list[int] = []
    for d in [*drafts, None]:
        mask = constraints.fill([request_id])[0]
        rows.append(mask)
        if d is None or not allows(mask, d) or constraints.failure(request_id) is not None:
            break
        constraints.accept(request_id, d)
        if constraints.failure(request_id) is not None:  # (the matcher refused what its mask allowed)
            constraints.rollback(request_id, len(kept) + 1)
            return kept, torch.stack(rows)
        kept.append(d)
    constraints.rollback(request_id, len(kept))
    return kept, torch.stack(rows)


def row_masks(
    constraints: Any, masks: tuple[list[str], Future | None, dict[str, torch.Tensor]], rids: Sequence[str]
) -> Callable[[torch.Tensor], None]:
    """The sampler's in-place masking of the constrained rows among sampled rows ``rids`` (a verify chunk's request
    once per row): a plain row's mask from the background fill (``masks[0]``: its requests, ``masks[1]``: the
    future), a verify row's from ``constrain`` (``masks[2]``, by request)."""
    constrained, future, pre = masks
    at = {rid: i for i, rid in enumerate(constrained)}
    rows, take, seen = [], [], Counter()
    for r, rid in enumerate(rids):
        if rid in pre:
            rows.append(r)
            take.append((rid, seen[rid]))
            seen[rid] += 1
        elif rid in at:
            rows.append(r)
            take.append((rid, None))

    # the common step, plain rows only: the filled masks' rows in order, gathered in one call (or taken as they are)
    plain = None if any(k is not None for _, k in take) else [at[rid] for rid, _ in take]

    def apply(logits: torch.Tensor) -> None:
        packed = future.result() if future is not None else None
        if plain is not None and packed is not None:
            same = plain == list(range(len(packed)))
            constraints.apply(logits, packed if same else packed[torch.tensor(plain, dtype=torch.long)], rows)
            return
        parts = [pre[rid][k] if k is not None else packed[at[rid]] for rid, k in take]
        if parts:
            constraints.apply(logits, torch.stack(parts), rows)

    return apply


__all__ = ["allows", "constrain", "row_masks"]
