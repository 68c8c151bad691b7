"""Packed token masks (xgrammar's layout: bit ``t % 32`` of word ``t // 32``, int32 words): a set of token ids as a
row, and the tokens a row refuses besides its grammar's (``engine.constraints``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Refusal:
    """Tokens refused besides a grammar's (control tokens, banned ids): the packed words they fall in and what to
    keep of each, so that a batch's rows sharing one set are cleared in one indexed update (a full-row AND per row
    took about 0.4 ms of a 64-row fill on the host, bench/results/engine/2026-12-07-mask-fill-cpu.md; the sets are a
    few tokens)."""

    def __init__(self, row: torch.Tensor) -> None:
        self.allowed = ~row  # the packed row that keeps everything else (one row: a single AND)
        self.cols = row.nonzero().flatten()
        self.keep = self.allowed[self.cols]

    @classmethod
    def of(cls, ids: Sequence[int], vocab_size: int) -> Refusal:
        return cls(pack(ids, vocab_size))

    def clear(self, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Clear the set's bits in ``rows`` of the packed ``bitmask``, in place."""
        if len(rows) == 1:
            bitmask[rows[0]] &= self.allowed
        elif len(self.cols):
            index = torch.tensor(rows, dtype=torch.long).unsqueeze(1)
            bitmask[index, self.cols] &= self.keep


def pack(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Token ids as a packed mask row ``[ceil(V/32)]`` int32 (xgrammar's layout: bit ``t % 32`` of word ``t // 32``)."""
    words = [0] * (-(-vocab_size // 32))
    for t in ids:
        words[t >> 5] |= 1 << (t & 31)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
