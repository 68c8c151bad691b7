"""EPLB in a running worker of several ranks: every ``DEEPINFER_EPLB_INTERVAL_STEPS`` steps, between two steps,
rank 0 gathers every rank's expert loads, decides which MoE layers to re-place (``rebalancer.propose``) and has
every rank move their experts (``rebalancer.apply``); the loads also go out on NATS, rank by rank
(``events.experts.ExpertLoadReporter``, fed by ``take``).

The ranks run it in the order rank 0 gives (``rank_group``: an ``EXPERTS`` message ahead of the next step's plan),
each in the same three collective calls on the group:

1. ``gather_loads``: each rank's tokens per expert of each sharded layer since the last time (``[layers, experts]``,
   int64), gathered on rank 0 over the control channel's gloo group;
2. ``share_placements``: rank 0's decision broadcast: a header ``[layers moved, slots per rank, experts]``, the
   layer indices, then each moved layer's ``[ranks, slots]`` experts (tensors only; nothing is pickled);
3. the move itself (``move_experts``: the experts' weights through the MoE layers' exchange).

A move happens between steps in stream order: the steps already launched read the weights they were launched with
(the move's copies queue behind them on the device), the next step reads the new ones; no request is dropped. A new
placement gives each rank ``ceil(experts / ranks) + DEEPINFER_EPLB_EXTRA_SLOTS`` slots (the extra ones hold copies
of hot experts), so the first move grows each layer's expert memory by that much.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deepinfer.parallel import rebalancer
from deepinfer.parallel.placement import ExpertPlacement


def gather_loads(model: nn.Module, group: dist.ProcessGroup | None) -> list[dict[int, np.ndarray]] | None:
    """This rank's loads (``rebalancer.taken_loads``) gathered on rank 0: every rank's there, by rank, else None."""
    loads = rebalancer.taken_loads(model)
    layers = sorted(loads)
    mine = torch.tensor([loads[i] for i in layers], dtype=torch.long)
    rank, world = dist.get_rank(), dist.get_world_size()
    got = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, got, dst=0, group=group)
    if got is None:
        return None
    return [{i: t[k].numpy() for k, i in enumerate(layers)} for t in got]


def share_placements(new: dict[int, ExpertPlacement] | None, group: dist.ProcessGroup | None
                     ) -> dict[int, ExpertPlacement]:  # fmt: skip
    """Rank 0's ``new`` placements, on every rank (the others pass None)."""
    world = dist.get_world_size()
    head = torch.zeros(3, dtype=torch.long)
    if new is not None:
        slots = {len(s) for p in new.values() for s in p.slots}
        if len(slots) > 1:
            raise ValueError(f"new placements with different slot counts per rank: {sorted(slots)}")
        n_experts = next(iter(new.values())).n_experts if new else 0
        head = torch.tensor([len(new), slots.pop() if slots else 0, n_experts])
    dist.broadcast(head, src=0, group=group)
    n, slots, n_experts = (int(x) for x in head)
    if n == 0:
        return {}
    layers = torch.tensor(sorted(new), dtype=torch.long) if new is not None else torch.empty(n, dtype=torch.long)
    table = torch.empty(n, world, slots, dtype=torch.long)
    if new is not None:
        table = torch.tensor([[list(s) for s in new[i].slots] for i in sorted(new)], dtype=torch.long)
    dist.broadcast(layers, src=0, group=group)
    dist.broadcast(table, src=0, group=group)
    return {int(i): ExpertPlacement(n_experts, tuple(tuple(r) for r in t.tolist())) for i, t in zip(layers, table)}


def follow_rebalance(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """A follower's side of one rebalance (module docstring)."""
    gather_loads(model, group)
    rebalancer.apply(model, share_placements(None, group))


class ExpertBalancer:
    """Rank 0's side: counts steps, runs a rebalance every ``every`` of them (``tick``), keeps the loads gathered
    since the last rebalance (the decision's window) and, per rank, those not reported yet (``take``)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, every: int, extra_slots: int,
                 min_gain: float = 0.05) -> None:  # fmt: skip
        self.model, self.group, self.every, self.min_gain = model, group, every, min_gain
        self.world = dist.get_world_size()
        n_experts = next(iter(rebalancer.placements(model).values())).n_experts
        self.slots = -(-n_experts // self.world) + extra_slots
        self.steps = self.rebalances = self.layers_moved = 0
        self._unreported: list[dict[int, np.ndarray]] = [{} for _ in range(self.world)]
        self._lock = threading.Lock()  # the reporters take from the event loop's thread

    def due(self) -> bool:
        """Count a step; whether a rebalance runs before it."""
        self.steps += 1
        return self.every > 0 and self.steps % self.every == 0

    def rebalance(self) -> dict[int, ExpertPlacement]:
        """Gather, decide, share and move (every follower must be in ``follow_rebalance``); the new placements."""
        per_rank = gather_loads(self.model, self.group)
        window: dict[int, np.ndarray] = {}
        with self._lock:
            for mine, loads in zip(self._unreported, per_rank):
                for i, load in loads.items():
                    mine[i] = mine[i] + load if i in mine else load.copy()
                    window[i] = window[i] + load if i in window else load.copy()
        new = rebalancer.propose(window, rebalancer.placements(self.model), self.slots, min_gain=self.min_gain)
        rebalancer.apply(self.model, share_placements(new, self.group))
        self.rebalances += 1
        self.layers_moved += len(new)
        return new

    def take(self, rank: int) -> dict[int, list[int]]:
        """Rank ``rank``'s tokens per expert by layer, gathered since the last call (its reporter's supplier)."""
        with self._lock:
            got, self._unreported[rank] = self._unreported[rank], {}
        return {i: v.tolist() for i, v in got.items()}


__all__ = ["ExpertBalancer", "follow_rebalance", "gather_loads", "share_placements"]
