"""A drafter that knows the answer: it proposes the target's own continuation (from a run without speculation),
each draft replaced by a wrong token with probability ``error_rate``. Random weights make real drafters useless;
this one sets the acceptance rate, for the benchmark's speed-up curve and for tests that must see drafts kept and
rejected (bench/engine/speculative.py, tests/engine/test_speculative_engine.py).

The error draw is keyed by (request, position), so a run is reproducible whatever the batch.
"""

from __future__ import annotations

import hashlib


class OracleProposer:
    """``continuations[rid]``: the request's whole token list (prompt and output) of a run without speculation."""

    def __init__(self, continuations: dict[str, list[int]], error_rate: float = 0.0, vocab_size: int = 2) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.continuations, self.error_rate, self.vocab_size = continuations, error_rate, vocab_size

    def _wrong(self, rid: str, position: int) -> bool:
        h = hashlib.blake2b(f"{rid}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.error_rate

    def propose(self, rids: list[str], positions: list[int], counts: list[int]) -> list[list[int]]:
        """Drafts for the tokens at ``positions[b] + 1 ..`` (``positions[b]``: the sequence's last token's)."""
        out = []
        for rid, p, n in zip(rids, positions, counts):
            truth = self.continuations.get(rid, [])[p + 1 : p + 1 + n]
            out.append([(t + 1) % self.vocab_size if self._wrong(rid, p + 1 + j) else t for j, t in enumerate(truth)])
        return out


__all__ = ["OracleProposer"]
