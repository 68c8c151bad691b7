"""EPLB's decision: which MoE layers of a worker to re-place, from the expert loads its ranks reported
(``events.experts.ExpertLoadView``), and the ranks' side of it: the loads each rank hands to its reporter, and the
move itself between steps (``expert_parallel.move_experts``, on every rank at once).

A layer is re-placed when the new placement (``eplb.rebalance`` of the measured loads) brings its ranks' max / mean
load down by at least ``min_gain`` (relative) from the current placement's under the same loads: a move costs an
exchange of expert weights, so small gains are not worth it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from torch import nn

from deepinfer.parallel import eplb
from deepinfer.parallel.expert_parallel import move_experts
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.quant.native import REFS_ATTR, stored_experts


def propose(loads: Mapping[int, np.ndarray], current: Mapping[int, ExpertPlacement], slots: int, nodes: int = 1,
            min_gain: float = 0.05) -> dict[int, ExpertPlacement]:  # fmt: skip
    """New placements of the layers worth moving (module docstring): ``loads`` and ``current`` by layer, ``slots``
    per rank in the new placements, ``nodes`` hosts."""
    out = {}
    for layer, load in loads.items():
        now = current.get(layer)
        if now is None or load.sum() == 0:
            continue
        new = eplb.rebalance(load, now.ranks, slots, nodes)
        before, after = eplb.imbalance(now, load), eplb.imbalance(new, load)
        if after < before * (1 - min_gain):
            out[layer] = new
    return out


def taken_loads(model: nn.Module) -> dict[int, list[int]]:
    """This rank's tokens per expert of each sharded MoE layer since the last call (the reporter's supplier)."""
    return {i: layer.ffn.ep.take_load().tolist() for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "ep")}


def placements(model: nn.Module) -> dict[int, ExpertPlacement]:
    """The current placement of each sharded MoE layer."""
    return {i: layer.ffn.ep.placement for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "ep")}


def apply(model: nn.Module, new: Mapping[int, ExpertPlacement]) -> None:
    """Move the experts of the layers in ``new`` (between steps; every rank of the group calls it with the same
    placements, in the same order). What the op set derived from a layer's expert weights for its kernels (the
    NVIDIA op set's code order and W4A8 row references) is undone before the move, so that rows of the stored
    format travel, and derived again after it (``model.ops.prepare_weights`` of the layer). Every tensor stays where
    it was (captured graphs hold them) when the slots per rank do not change (``ExpertPlacement.even``'s ``slots``
    from the start); otherwise the model's graphs over the exchanges are given up (``ReplayGate.give_up``)."""
    kept = True
    for i in sorted(new):
        moe = model.layers[i].ffn
        refs = getattr(moe, REFS_ATTR, None)
        stored_experts(moe)
        kept &= move_experts(moe, new[i])
        model.ops.prepare_weights(moe)
        kept &= _keep_refs(moe, refs)
    gate = getattr(model, "replay_gate", None)
    if not kept and gate is not None:
        gate.give_up(model)


def _keep_refs(moe: nn.Module, old: tuple | None) -> bool:
    """The layer's W4A8 row references derived again into the tensors they were in; False: they cannot be."""
    got = getattr(moe, REFS_ATTR, None)
    if old is None or got is None:
        return old is None and got is None
    if len(old) != len(got) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(old, got)):
        return False
    for a, b in zip(old, got):
        a.copy_(b)
    setattr(moe, REFS_ATTR, old)
    return True


__all__ = ["apply", "placements", "propose", "taken_loads"]
