"""Where a MoE layer's routed experts live across the ranks of an expert-parallel group.

Each rank holds some physical expert slots; each slot holds one logical expert's weights. Without redundancy every
logical expert has one slot (``ExpertPlacement.even``: contiguous blocks, sizes differing by at most one). EPLB
adds redundant copies of hot experts, so a logical expert may have several slots on several ranks; a token routed
to it goes to one of them (``route``: a fixed rule of the token's index and its source rank, so the choice needs no
communication and is the same on every run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """``slots[r]``: the logical expert of each of rank ``r``'s physical slots, in slot order."""

    n_experts: int
    slots: tuple[tuple[int, ...], ...]
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("an expert placement needs at least one rank")
        seen = {e for rank in self.slots for e in rank}
        bad = [e for e in seen if not 0 <= e < self.n_experts]
        if bad:
            raise ValueError(f"expert ids {sorted(bad)[:5]} outside 0..{self.n_experts - 1}")
        if len(seen) != self.n_experts:
            missing = sorted(set(range(self.n_experts)) - seen)
            raise ValueError(f"experts {missing[:5]} have no slot on any rank")

    @classmethod
    def even(cls, n_experts: int, ranks: int, slots: int = 0) -> ExpertPlacement:
        """Contiguous blocks, one slot per expert: rank ``r`` holds ``n_experts / ranks`` experts (the first
        ``n_experts % ranks`` ranks one more). ``slots`` (0: as many as that): every rank that many, the slots past
        its block holding copies of the next rank's experts (EPLB's slot count from the start: its moves then keep
        every tensor's shape)."""
        if ranks < 1 or n_experts < ranks:
            raise ValueError(f"cannot place {n_experts} experts on {ranks} ranks (each rank needs one)")
        base, extra = divmod(n_experts, ranks)
        if slots and slots < base + (extra > 0):
            raise ValueError(f"{slots} slots a rank cannot hold {n_experts} experts on {ranks} ranks")
        out, lo = [], 0
        for r in range(ranks):
            n = base + (1 if r < extra else 0)
            out.append(tuple(range(lo, lo + n)))
            lo += n
        if slots:
            out = [own + tuple(out[(r + 1) % ranks][j % len(out[(r + 1) % ranks])] for j in range(slots - len(own)))
                   for r, own in enumerate(out)]  # fmt: skip
        return cls(n_experts, tuple(out))

    @property
    def ranks(self) -> int:
        return len(self.slots)

    def copies(self, expert: int) -> list[tuple[int, int]]:
        """The ``(rank, slot)`` of each copy of ``expert``, rank by rank."""
        return [(r, s) for r, held in enumerate(self.slots) for s, e in enumerate(held) if e == expert]

    @property
    def most_copies(self) -> int:
        """The most copies any expert could have with this many slots (every other expert in one)."""
        return sum(map(len, self.slots)) - self.n_experts + 1

    def tables(self, device: torch.device, width: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """``rank_of [E, C]``, ``slot_of [E, C]`` (copy ``c`` of each expert; rows padded with the first copy) and
        ``count [E]`` (copies per expert), on ``device``, made once per device. ``width``: ``C`` (default the most
        copies an expert has)."""
        got = self._tables.get((device, width))
        if got is None:
            copies = [self.copies(e) for e in range(self.n_experts)]
            w = width or max(len(c) for c in copies)
            rank_of = torch.tensor([[c[min(j, len(c) - 1)][0] for j in range(w)] for c in copies])
            slot_of = torch.tensor([[c[min(j, len(c) - 1)][1] for j in range(w)] for c in copies])
            count = torch.tensor([len(c) for c in copies])
            got = self._tables[(device, width)] = (rank_of.to(device), slot_of.to(device), count.to(device))
        return got

    def route(self, idx: torch.Tensor, source: int, tables: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For expert ids ``idx [T, k]`` of rank ``source``'s tokens: the rank and slot each ``(token, choice)``
        goes to, flat ``[T·k]``; a replicated expert's copy is ``(token + source) % copies``. ``tables``: this
        placement's (``tables``) where the caller keeps them."""
        rank_of, slot_of, count = tables if tables is not None else self.tables(idx.device)
        e = idx.reshape(-1)
        token = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx.shape[1])
        c = (token + source) % count[e]
        return rank_of[e, c], slot_of[e, c]


def routed_experts_of(config: object) -> int:
    """A model config's routed experts per MoE layer (V4.1: its text config's)."""
    return getattr(config, "text_config", config).n_routed_experts


__all__ = ["ExpertPlacement", "routed_experts_of"]
