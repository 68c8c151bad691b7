"""A drafter that knows the answer: it proposes the target's own continuation (from a run without speculation),
each draft replaced by a wrong token with probability ``error_rate``. Random weights make real drafters useless;
this one sets the acceptance rate, for the benchmark's speed-up curve and for tests that must see drafts kept and
rejected (bench/engine/speculative.py, tests/engine/test_speculative_engine.py).

The error draw is keyed by (request, position), so a run is reproducible whatever the batch.

``judged``: the oracle, not the target, decides which drafts a verify step keeps (``keep``: its leading drafts drawn
right), and the kept drafts are the tokens emitted, as a sampled acceptance keeps drafts that are not the target's
argmax; the sequence and its state then follow the drafts. For timing only (the tokens are not the target's greedy
ones): the acceptance is the set rate in any mix of plain and verify steps. Replaying a continuation, a plain step's
rounding differs from a verify step's, so a near-tie that a plain step decides the other way leaves the oracle wrong
for the rest of the sequence (the benchmark's cost-policy runs, which mix both, saw 0.22 kept instead of 0.41).
"""

from __future__ import annotations

import hashlib


class OracleProposer:
    """``continuations[rid]``: the request's whole token list (prompt and output) of a run without speculation."""

    def __init__(
        self, continuations: dict[str, list[int]], error_rate: float = 0.0, vocab_size: int = 2, judged: bool = False
    ) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.continuations, self.error_rate, self.vocab_size = continuations, error_rate, vocab_size
        self.judged = judged
        self._proposed: dict[str, int] = {}  # request -> the position its last drafts follow

    def _wrong(self, rid: str, position: int) -> bool:
        h = hashlib.blake2b(f"{rid}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.error_rate

    def propose(self, rids: list[str], positions: list[int], counts: list[int]) -> list[list[int]]:
        """Drafts for the tokens at ``positions[b] + 1 ..`` (``positions[b]``: the sequence's last token's)."""
        out = []
        for rid, p, n in zip(rids, positions, counts):
            self._proposed[rid] = p
            truth = self.continuations.get(rid, [])[p + 1 : p + 1 + n]
            if self.judged:  # (any tokens do: the oracle judges them; the continuation's where it has them)
                truth += [(p + j) % self.vocab_size for j in range(len(truth), n)]
            out.append([(t + 1) % self.vocab_size if self._wrong(rid, p + 1 + j) else t for j, t in enumerate(truth)])
        return out

    def keep(self, rid: str, drafts: list[int]) -> int:
        """``judged``: how many of ``drafts`` (the request's last proposed) a verify step keeps."""
        p, a = self._proposed[rid], 0
        while a < len(drafts) and not self._wrong(rid, p + 1 + a):
            a += 1
        return a


__all__ = ["OracleProposer"]
