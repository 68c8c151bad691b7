"""EPLB's placement algorithm (``parallel/eplb.py``) and the decision to move (``parallel/rebalancer.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.parallel.eplb import balanced_packing, imbalance, rank_loads, rebalance, replicate
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.rebalancer import propose


def skewed(n: int, seed: int = 0) -> np.ndarray:
    """Zipf-like loads: expert ``i`` of a random order gets ``10^5 / (i + 1)`` tokens."""
    return (1e5 / np.arange(1, n + 1))[np.random.default_rng(seed).permutation(n)]


def test_balanced_packing_fills_every_pack_evenly() -> None:
    packs = balanced_packing(np.array([9.0, 1, 8, 2, 7, 3]), 3)
    assert sorted(len(p) for p in packs) == [2, 2, 2] and sorted(i for p in packs for i in p) == list(range(6))
    assert sorted(sum([9, 1, 8, 2, 7, 3][i] for i in p) for p in packs) == [10, 10, 10]
    with pytest.raises(ValueError, match="equal packs"):
        balanced_packing(np.ones(5), 2)


def test_replicate_copies_the_busiest_per_copy() -> None:
    assert replicate(np.array([100.0, 10, 60]), 5).tolist() == [2, 1, 2]
    with pytest.raises(ValueError, match="cannot hold"):
        replicate(np.ones(4), 3)


@pytest.mark.parametrize(("ranks", "redundant", "nodes"), [(2, 0, 1), (8, 32, 1), (8, 32, 2), (16, 64, 4)])
def test_rebalance_places_every_expert_and_evens_the_ranks(ranks: int, redundant: int, nodes: int) -> None:
    e = 256
    load = skewed(e)
    p = rebalance(load, ranks, (e + redundant) // ranks, nodes)
    assert p.ranks == ranks and all(len(s) == (e + redundant) // ranks for s in p.slots)
    assert sorted({x for s in p.slots for x in s}) == list(range(e))
    before, after = imbalance(ExpertPlacement.even(e, ranks), load), imbalance(p, load)
    assert after < before and after < (1.6 if not redundant else 1.02 if nodes == 1 else 1.05)
    assert rank_loads(p, load).sum() == pytest.approx(load.sum())
    if nodes > 1:  # every host holds the same number of distinct experts, each of them on that host only
        per = ranks // nodes
        hosts = [{x for s in p.slots[h * per : (h + 1) * per] for x in s} for h in range(nodes)]
        assert all(len(h) == e // nodes for h in hosts) and len(set().union(*hosts)) == e


def test_propose_moves_only_layers_worth_it() -> None:
    e, ranks = 64, 4
    even = ExpertPlacement.even(e, ranks)
    flat, hot = np.full(e, 100.0), skewed(e)
    got = propose({0: flat, 1: hot, 2: np.zeros(e)}, {0: even, 1: even, 2: even}, e // ranks + 2)
    assert sorted(got) == [1] and imbalance(got[1], hot) < imbalance(even, hot)
