"""Expert parallelism for the MoE layers: routed experts sharded across ranks, tokens dispatched to them and their
outputs combined back, through an ``AllToAll``.

Every rank routes its own tokens (the router and the shared expert are replicated), then:

1. **dispatch**: each ``(token, choice)`` goes to a rank holding a copy of its expert (``ExpertPlacement.route``),
   with the slot there and the routing weight, sorted by destination: one exchange of the row counts, one of the
   rows, one of the slots and weights;
2. **experts**: each rank runs its slots over the rows it received, one choice per row (``routed_experts`` with
   ``k = 1``: the weight applied before the down projection, as the single-process MoE does);
3. **combine**: the outputs go back the way they came, and each token sums its choices' outputs in fp32 in the
   order the single-process reference sums them (experts by ascending id, from zero).

With batch-invariant ops a row's expert output does not depend on which rows it was computed with, so the sharded
MoE equals the single-process one bit for bit; otherwise within fp32 rounding. Every rank must run every MoE layer
of every step, with no tokens if it has none (the exchanges are collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.parallel.all_to_all import AllToAll
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.quant.native import routed_experts

_WEIGHTS = ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")


class ExpertParallel:
    """One rank's view of an expert-parallel group: the ``placement`` of a layer's experts, this ``rank``'s slots,
    the exchange (``a2a``)."""

    def __init__(self, placement: ExpertPlacement, a2a: AllToAll) -> None:
        if placement.ranks != a2a.size:
            raise ValueError(f"a placement over {placement.ranks} ranks in a group of {a2a.size}")
        self.placement, self.a2a, self.rank = placement, a2a, a2a.rank
        self.held = placement.slots[self.rank]

    def run(self, m: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float, ops: Any,
            act_quant: bool = False) -> torch.Tensor:  # fmt: skip
        """The routed experts' output ``[T, D]`` (fp32) of this rank's tokens ``x [T, D]`` routed to ``idx [T, k]``
        with weights ``w [T, k]``; ``m`` holds this rank's slots (``shard``)."""
        t, k = idx.shape
        dest, slot = self.placement.route(idx, self.rank)
        order = torch.argsort(dest, stable=True)
        send_n = torch.bincount(dest, minlength=self.a2a.size)
        recv_n = self.a2a.counts(send_n)
        send, recv = send_n.tolist(), recv_n.tolist()
        token = order // k
        rows = self.a2a.exchange(x.index_select(0, token), send, recv)
        meta = torch.stack([slot.index_select(0, order).to(torch.float32), w.reshape(-1).index_select(0, order)], 1)
        meta = self.a2a.exchange(meta.float(), send, recv)  # (slots < 2**24: exact in fp32)
        out = routed_experts(m, rows, meta[:, :1].long(), meta[:, 1:], limit, ops, act_quant)
        back = self.a2a.exchange(out.float(), recv, send)
        parts = torch.empty_like(back).index_copy_(0, order, back).view(t, k, -1)
        asc = torch.argsort(idx, dim=1, stable=True).unsqueeze(-1).expand(-1, -1, parts.shape[-1])
        parts = parts.gather(1, asc)
        y = torch.zeros(t, parts.shape[-1], dtype=torch.float32, device=x.device)
        for j in range(k):  # the reference's order: y = ((0 + e_0) + e_1) + ..., experts ascending
            y = y + parts[:, j]
        return y


def routed(m: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float, ops: Any,
           act_quant: bool = False) -> torch.Tensor:  # fmt: skip
    """A MoE module's routed experts over ``x``: across its expert-parallel group where it has one (``m.ep``),
    else its own experts (``routed_experts``)."""
    ep = getattr(m, "ep", None)
    if ep is None:
        return routed_experts(m, x, idx, w, limit, ops, act_quant)
    return ep.run(m, x, idx, w, limit, ops, act_quant)


def shard(moe: nn.Module, ep: ExpertParallel) -> None:
    """Keep only this rank's slots of ``moe``'s stacked routed experts (``w1``, ``w2``, ``w3`` and their scales:
    ``[E, ...]`` to ``[slots, ...]``, slot ``s`` holding logical expert ``ep.held[s]``) and route through ``ep``.
    Before loading: the checkpoint loader fills the slots (``held_experts``)."""
    n = ep.placement.n_experts
    held = torch.tensor(ep.held, dtype=torch.long)
    for name in _WEIGHTS:
        p = getattr(moe, name, None)
        if p is None:
            continue
        if p.shape[0] != n:
            raise ValueError(f"{name} holds {p.shape[0]} experts, the placement {n}")
        local = p.data.index_select(0, held.to(p.device)) if p.numel() else p.data.new_empty((len(held), *p.shape[1:]))
        if isinstance(p, nn.Parameter):
            setattr(moe, name, nn.Parameter(local, requires_grad=False))
        else:
            setattr(moe, name, local)
    moe.ep = ep


def shard_model(model: nn.Module, ep: ExpertParallel) -> None:
    """``shard`` every MoE layer of the model's trunk (``model.layers[i].ffn``; the drafters' blocks keep every
    expert: each rank drafts for its own sequences)."""
    for layer in model.layers:
        shard(layer.ffn, ep)


def held_experts(moe: nn.Module) -> tuple[int, ...] | None:
    """The logical expert of each slot of a sharded MoE module, or None (every expert, in order)."""
    ep = getattr(moe, "ep", None)
    return None if ep is None else ep.held


__all__ = ["ExpertParallel", "held_experts", "routed", "shard", "shard_model"]
