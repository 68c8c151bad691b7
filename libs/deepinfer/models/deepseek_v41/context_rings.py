"""DSpark's context of every sequence it drafts for, in one device tensor (``speculator.DSparkSpeculator``).

DSpark drafts from each stage's KV rows of the ``W`` positions before a sequence's anchor. They are computed once,
when the target has consumed a position and the drafter keeps it, and held here: ``rows [stages, capacity, W, d]``,
a sequence's slot ``s`` holding position ``p`` at ``rows[:, s, p % W]``, tagged in ``pos [capacity, W]`` with the
position (-1: none), so a gap (positions consumed while nothing was kept, e.g. steps run without the drafter) is
masked rather than misread. A step's windows are one gather and its kept rows one scatter, whatever the batch.
"""

from __future__ import annotations

import torch

from deepinfer.runtime.host_copy import tensor


class ContextRings:
    """Each sequence's DSpark context ring (module docstring), by request id; grows by doubling."""

    def __init__(self, stages: int, window: int, dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 8) -> None:  # fmt: skip
        self.rows = torch.zeros(stages, capacity, window, dim, dtype=dtype, device=device)
        self.pos = torch.full((capacity, window), -1, dtype=torch.long, device=device)
        self.slot: dict[str, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def window_size(self) -> int:
        return self.pos.shape[1]

    def __contains__(self, rid: str) -> bool:
        return rid in self.slot

    def slots(self, rids: list[str]) -> list[int]:
        """The slots of ``rids``; a new sequence gets an empty one."""
        out = []
        for rid in rids:
            s = self.slot.get(rid)
            if s is None:
                if not self.free:
                    self._grow()
                s = self.slot[rid] = self.free.pop()
                self.pos[s] = -1
            out.append(s)
        return out

    def release(self, rid: str) -> None:
        s = self.slot.pop(rid, None)
        if s is not None:
            self.free.append(s)

    def _grow(self) -> None:
        n, w = self.pos.shape
        rows = self.rows.new_zeros(self.rows.shape[0], 2 * n, w, self.rows.shape[-1])
        rows[:, :n] = self.rows
        pos = self.pos.new_full((2 * n, w), -1)
        pos[:n] = self.pos
        self.rows, self.pos = rows, pos
        self.free = list(range(2 * n - 1, n - 1, -1))

    def windows(self, rids: list[str], anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[stages, N, W, d]`` of positions ``anchor - W .. anchor - 1`` of each sequence, in order, and which
        exist ``[N, W]`` (``anchors [N]`` on the device)."""
        return self.gather(tensor(self.slots(rids), self.pos.device, torch.long), anchors)

    def gather(self, slots: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``windows`` of the sequences in ``slots [N]`` (on the device: what a CUDA graph captures)."""
        w = self.window_size
        s = slots.unsqueeze(1)
        j = anchors.unsqueeze(1) - w + torch.arange(w, device=anchors.device)
        at = torch.remainder(j, w)
        return self.rows[:, s, at], (self.pos[s, at] == j) & (j >= 0)

    def write(self, rids: list[str], counts: list[int], kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep ``kv [stages, n, d]`` at ``positions [n]``: the first ``counts[0]`` rows are ``rids[0]``'s, and so on
        (at most ``W`` rows a sequence, ascending)."""
        slots = [s for s, c in zip(self.slots(rids), counts) for _ in range(c)]
        self.put(tensor(slots, self.pos.device, torch.long), kv, positions)

    def put(self, slots: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """``write`` of rows whose ring ``slots [n]`` are on the device (what a CUDA graph captures; a row repeated,
        the same slot, position and values, writes the same bytes again)."""
        at = torch.remainder(positions, self.window_size)
        self.rows[:, slots, at] = kv.to(self.rows.dtype)
        self.pos[slots, at] = positions


__all__ = ["ContextRings"]
