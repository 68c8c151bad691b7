"""Expert-parallel load balancing (EPLB): where to put each MoE layer's experts, and which ones to copy, from the
tokens each expert received.

DeepSeek's published EPLB algorithm, per layer, for ``ranks`` ranks of ``slots`` expert slots each (more slots in
all than experts: the rest hold redundant copies of the busiest ones), on ``nodes`` hosts:

1. **experts to hosts** (hierarchical, when ``nodes > 1``): the experts are packed onto the hosts, the same number
   on each, balancing their load (``balanced_packing``), so that most of a token's dispatch stays on its host's
   fast links;
2. **copies** within each host: its slots are filled one at a time with another copy of the expert whose load per
   copy is the highest (``replicate``);
3. **copies to ranks** within each host: the copies, each carrying its expert's load divided by its copies, are
   packed onto the host's ranks, ``slots`` each, balancing their load.

``balanced_packing`` takes the items heaviest first and puts each on the lightest pack that has room (ties: the
lower pack). A placement's load per rank is ``rank_loads``: each expert's tokens split evenly over its copies, as
``ExpertPlacement.route`` splits them.
"""

from __future__ import annotations

import numpy as np

from deepinfer.parallel.placement import ExpertPlacement


def balanced_packing(weights: np.ndarray, packs: int) -> list[list[int]]:
    """Items ``0 .. n-1`` of ``weights`` into ``packs`` packs of ``n / packs`` items each, balancing their sums."""
    n = len(weights)
    if packs < 1 or n % packs:
        raise ValueError(f"{n} items do not split into {packs} equal packs")
    per = n // packs
    out: list[list[int]] = [[] for _ in range(packs)]
    sums = np.zeros(packs)
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        room = [p for p in range(packs) if len(out[p]) < per]
        p = min(room, key=lambda p: (sums[p], p))
        out[p].append(i)
        sums[p] += weights[i]
    return out


def replicate(load: np.ndarray, slots: int) -> np.ndarray:
    """Copies of each expert filling ``slots`` slots (at least one each): each extra slot goes to the expert with
    the most load per copy (ties: the lower id)."""
    if slots < len(load):
        raise ValueError(f"{slots} slots cannot hold {len(load)} experts")
    copies = np.ones(len(load), dtype=np.int64)
    for _ in range(slots - len(load)):
        per = load / copies
        copies[int(np.flatnonzero(per == per.max())[0])] += 1
    return copies


def rebalance(load: np.ndarray, ranks: int, slots: int, nodes: int = 1) -> ExpertPlacement:
    """One layer's placement for the expert loads ``load [E]`` (tokens received; the module docstring)."""
    load = np.asarray(load, dtype=np.float64)
    e = len(load)
    if ranks < 1 or slots < 1 or ranks * slots < e:
        raise ValueError(f"{ranks} ranks of {slots} slots cannot hold {e} experts")
    if nodes < 1 or ranks % nodes or e % nodes:
        nodes = 1  # not evenly divisible by hosts: one global packing
    per_node = ranks // nodes
    hosts = balanced_packing(load, nodes) if nodes > 1 else [list(range(e))]
    out: list[tuple[int, ...]] = []
    for experts in hosts:
        experts = sorted(experts)
        copies = replicate(load[experts], per_node * slots)
        phys = [x for x, c in zip(experts, copies) for _ in range(c)]
        weights = np.array([load[x] / copies[i] for i, c in enumerate(copies) for x in [experts[i]] * c])
        for pack in balanced_packing(weights, per_node):
            out.append(tuple(sorted(phys[i] for i in pack)))
    return ExpertPlacement(e, tuple(out))


def rank_loads(placement: ExpertPlacement, load: np.ndarray) -> np.ndarray:
    """Tokens each rank computes when expert ``x`` receives ``load[x]``, split evenly over its copies."""
    load = np.asarray(load, dtype=np.float64)
    copies = np.zeros(placement.n_experts)
    for held in placement.slots:
        for x in held:
            copies[x] += 1
    return np.array([sum(load[x] / copies[x] for x in held) for held in placement.slots])


def imbalance(placement: ExpertPlacement, load: np.ndarray) -> float:
    """max / mean of ``rank_loads`` (1: balanced)."""
    r = rank_loads(placement, load)
    return float(r.max() / r.mean()) if r.mean() > 0 else 1.0


__all__ = ["balanced_packing", "imbalance", "rank_loads", "rebalance", "replicate"]
