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

The exchanges take one of two forms, the same for every rank of a step (``FixedBuffers``): row counts first, then
exactly the rows (the counts read on the host), or, when no rank has more than ``DEEPINFER_EP_FIXED_BUFFER_TOKENS``
tokens in the step, blocks of a fixed size from each rank to each rank, the rows at known places in them and the
empty places computed and dropped (nothing read on the host; DeepEP's low-latency mode).

With batch-invariant ops a row's expert output does not depend on which rows it was computed with, so the sharded
MoE equals the single-process one bit for bit, in either form; otherwise within fp32 rounding. Every rank must run
every MoE layer of every step, with no tokens if it has none (the exchanges are collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.parallel.all_to_all import AllToAll
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.tensor_parallel import TensorParallel
from deepinfer.quant.native import routed_experts
from deepinfer.telemetry import get_logger

log = get_logger(__name__)
_WEIGHTS = ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")


class FixedBuffers:
    """Whether a step's MoE exchanges go through fixed buffers of ``tokens`` tokens per rank (0: never), shared by a
    model's MoE layers, the same for every rank: as the rank group decided it from every rank's plan before the step
    (``decided``: ``rank_group.RankGroupRunner`` knows the most tokens any rank may have), else agreed by the first
    layer of the step (``agree``: the most tokens any rank has, over the gloo group ``control``, the ranks' control
    channel; a collective inside the forward, which a CUDA graph could not hold)."""

    def __init__(self, tokens: int, control: dist.ProcessGroup | None = None) -> None:
        self.tokens, self.control = tokens, control
        self.on = False  # this step's form: fixed buffers
        self.decided: bool | None = None  # this step's form as the rank group decided it (None: agree)
        self.steps = 0  # steps that took it
        self.agreements = 0  # steps whose form the first layer agreed over ``control``

    def agree(self, rows: int) -> None:
        """This step's form (the first MoE layer of a forward, with its ``rows`` tokens)."""
        if self.decided is not None:
            if self.decided and rows > self.tokens:  # (the group's bound is wrong: the ranks would not meet)
                raise RuntimeError(f"the step was planned for fixed buffers of {self.tokens} tokens; this rank has "
                                   f"{rows}")  # fmt: skip
            self.on = self.decided
        else:
            most = torch.tensor([rows], dtype=torch.long)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.control)
            self.on = int(most) <= self.tokens
            self.agreements += 1
        self.steps += self.on

    def check(self) -> None:
        """Raise unless every rank of the group was given the same ``tokens`` (a rank that agrees alone would
        wait forever)."""
        lo, hi = torch.tensor([self.tokens]), torch.tensor([-self.tokens])
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.control)
        dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=self.control)
        if int(lo) != -int(hi):
            raise RuntimeError(f"the ranks were given DEEPINFER_EP_FIXED_BUFFER_TOKENS from {int(lo)} to {-int(hi)}")


class ReplayGate:
    """When a sharded model's graphs may replay or capture (``runtime.decode_graphs.ReplayGate``; the model's
    ``replay_gate``, set by ``shard_model``). A replay runs the exchanges its capture recorded, in the fixed buffers'
    form (``fixed``; None: the counts form, which reads them on the host and no graph holds): a bucket replays only in
    a step that every rank takes in that form, as rank 0 decided it (``FixedBuffers.decided``), with its rows padding
    included within the buffers. Any other step runs eagerly, in the form decided. A capture runs its segments eagerly
    twice first, exchanges that no other rank would join: buckets are captured only while ``capturing``, in a warm-up
    that every rank runs alike (the same steps, the same buckets), where the forms are agreed in the forward.
    ``forwards``: the forwards every rank runs in this step, as rank 0 decided it (2 where some rank's step may run
    its verify rows apart from a prompt chunk: ``models.deepseek_v4.verify_split``; a rank with fewer runs idle
    ones); a step may run as two forwards only where it is 2."""

    def __init__(self, fixed: FixedBuffers | None) -> None:
        self.fixed = fixed
        self.capturing = False
        self.forwards = 1

    def replays(self, rows: int) -> bool:
        f = self.fixed
        if f is None or rows > f.tokens:
            return False
        return f.decided is True or (self.capturing and f.decided is None)

    def give_up(self, model: nn.Module) -> None:
        """Drop ``model``'s graphs that hold its exchanges and replay none from now on (EPLB moved experts into new
        tensors, a placement of other slot counts: every rank gives up at the same step, ``rebalancer.apply``)."""
        if self.fixed is not None:
            log.warning("eplb_graphs_dropped", reason="experts moved: decode and verify steps run eagerly")
        self.fixed = None
        for kind in ("decode", "verify", "prefill"):
            graphs = getattr(model, f"{kind}_graphs", None)
            if graphs is not None:
                graphs.reset()


class ExpertParallel:
    """One rank's view of an expert-parallel group: the ``placement`` of a layer's experts, this ``rank``'s slots,
    the exchange (``a2a``); ``fixed``: the model's ``FixedBuffers`` (None: counts always), ``agrees``: this layer
    is the first of the step (it agrees on the form)."""

    def __init__(self, placement: ExpertPlacement, a2a: AllToAll, tp: TensorParallel | None = None,
                 fixed: FixedBuffers | None = None, agrees: bool = False) -> None:  # fmt: skip
        if placement.ranks != a2a.size:
            raise ValueError(f"a placement over {placement.ranks} ranks in a group of {a2a.size}")
        self.placement, self.a2a, self.rank = placement, a2a, a2a.rank
        # this rank's tensor-parallel group (``tensor_parallel``): its ranks hold the same tokens, each sends its
        # share of them to the experts, and the group's outputs are put back together
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.cp: Any = None  # this rank's context-parallel group (``context_parallel``; the model's, set at launch)
        self.held = placement.slots[self.rank]
        self.load: torch.Tensor | None = None  # tokens this rank routed to each expert since ``take_load`` (EPLB)
        self.calls = 0  # exchanges run eagerly (a replayed graph's are not counted: ``rank_group`` counts forwards)
        self.host_key: str | None = None  # what the group's ranks share on their host (``launch.expert_group``)
        self.fixed = fixed if fixed is not None and fixed.tokens > 0 else None
        self.agrees = agrees
        self.tables: tuple[torch.Tensor, ...] | None = None  # the routing tables on the device (``place``)

    def place(self, new: ExpertPlacement) -> bool:
        """Route by ``new`` from the next step on (EPLB); True: its routing tables went into the tensors the old
        ones were in, which captured graphs hold (the same slots in all: ``ExpertPlacement.most_copies``)."""
        old, self.placement, self.held = self.tables, new, new.slots[self.rank]
        if old is None:
            return True
        fresh = new.tables(old[0].device, new.most_copies)
        if any(a.shape != b.shape for a, b in zip(old, fresh)):
            self.tables = tuple(t.clone() for t in fresh)
            return False
        for a, b in zip(old, fresh):
            a.copy_(b)
        return True

    def take_load(self) -> torch.Tensor:
        """The tokens this rank's tokens routed to each logical expert ``[E]`` since the last call, and start over.
        The counts stay in one device tensor, zeroed here, never replaced: a CUDA graph that counts into it keeps
        counting into the same memory."""
        got = self.load
        if got is None:
            return torch.zeros(self.placement.n_experts, dtype=torch.long)
        out = got.clone()
        got.zero_()
        return out

    def _count(self, idx: torch.Tensor) -> None:
        if self.load is None:
            self.load = torch.zeros(self.placement.n_experts, dtype=torch.long, device=idx.device)
        self.load.index_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))

    def run(self, m: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float, ops: Any,
            act_quant: bool = False) -> torch.Tensor:  # fmt: skip
        """The routed experts' output ``[T, D]`` (fp32) of this rank's tokens ``x [T, D]`` routed to ``idx [T, k]``
        with weights ``w [T, k]``; ``m`` holds this rank's slots (``shard``)."""
        if self.tp is not None:  # the group's tokens: this rank's share of them, then every rank's outputs
            n = idx.shape[0]
            a, b = self.tp.rows(n)
            return self.tp.gather_rows(self._run(m, x[a:b], idx[a:b], w[a:b], limit, ops, act_quant), n)
        return self._run(m, x, idx, w, limit, ops, act_quant)

    def _run(self, m: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float, ops: Any,
             act_quant: bool) -> torch.Tensor:  # fmt: skip
        t, k = idx.shape
        self.calls += 1
        self._count(idx)
        if self.fixed is not None and self.agrees:
            self.fixed.agree(t)
        if self.tables is None or self.tables[0].device != idx.device:  # (its own: ``place`` writes into them)
            self.tables = tuple(t.clone() for t in self.placement.tables(idx.device, self.placement.most_copies))
        dest, slot = self.placement.route(idx, self.rank, self.tables)
        meta = torch.stack([slot.to(torch.float32), w.reshape(-1).float()], 1)  # (slots < 2**24: exact in fp32)
        token = torch.arange(t * k, device=x.device) // k
        if self.fixed is not None and self.fixed.on:
            back, at = self._exchange_fixed(m, x.index_select(0, token), dest, meta, k, limit, ops, act_quant)
            parts = back.index_select(0, at).view(t, k, back.shape[-1])
        else:
            order = torch.argsort(dest, stable=True)
            send = torch.bincount(dest, minlength=self.a2a.size)
            send_n, recv_n = send.tolist(), self.a2a.counts(send).tolist()
            rows = self.a2a.exchange(x.index_select(0, token.index_select(0, order)), send_n, recv_n)
            got = self.a2a.exchange(meta.index_select(0, order), send_n, recv_n)
            out = routed_experts(m, rows, got[:, :1].long(), got[:, 1:], limit, ops, act_quant)
            back = self.a2a.exchange(out.float(), recv_n, send_n)
            parts = torch.empty_like(back).index_copy_(0, order, back).view(t, k, back.shape[-1])
        asc = torch.argsort(idx, dim=1, stable=True).unsqueeze(-1).expand(-1, -1, parts.shape[-1])
        parts = parts.gather(1, asc)
        y = torch.zeros(t, parts.shape[-1], dtype=torch.float32, device=x.device)
        for j in range(k):  # the reference's order: y = ((0 + e_0) + e_1) + ..., experts ascending
            y = y + parts[:, j]
        return y

    def _exchange_fixed(self, m: nn.Module, rows: torch.Tensor, dest: torch.Tensor, meta: torch.Tensor, k: int,
                        limit: float, ops: Any, act_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The experts' outputs of ``rows`` (one per choice) through fixed buffers: ``(back, at)``, the output of
        row ``i`` at ``back[at[i]]``. Row ``i`` goes to block ``dest[i]``, after the rows before it with the same
        destination; the empty places carry zeros to slot 0 with weight 0."""
        n, size = self.a2a.size, self.fixed.tokens * k  # a block: the most rows one rank may send to another
        if rows.shape[0] > size:
            raise RuntimeError(f"{rows.shape[0]} rows overrun the fixed buffers of {size} a rank")
        order = torch.argsort(dest, stable=True)
        counts = torch.zeros(n, dtype=dest.dtype, device=dest.device).index_add_(0, dest, torch.ones_like(dest))
        first = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(dest)
        sorted_dest = dest.index_select(0, order)
        pos[order] = torch.arange(dest.shape[0], device=dest.device) - first.index_select(0, sorted_dest)
        at = dest * size + pos
        send = rows.new_zeros((n * size, rows.shape[1])).index_copy_(0, at, rows)
        info = meta.new_zeros((n * size, 2)).index_copy_(0, at, meta)
        got = self.a2a.exchange_fixed(send.view(n, size, -1)).view(n * size, -1)
        info = self.a2a.exchange_fixed(info.view(n, size, 2)).view(n * size, 2)
        out = routed_experts(m, got, info[:, :1].long(), info[:, 1:], limit, ops, act_quant)
        back = self.a2a.exchange_fixed(out.float().view(n, size, -1)).view(n * size, -1)
        return back, at


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
    Before loading: the checkpoint loader fills the slots (``ExpertSlots``)."""
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
    """``shard`` every MoE layer of the model's trunk (``model.layers[i].ffn``, each with its own ``ExpertParallel``
    of ``ep``'s placement and group: EPLB moves each layer's experts apart; the drafters' blocks keep every expert:
    each rank drafts for its own sequences)."""
    for i, layer in enumerate(model.layers):
        shard(layer.ffn, ExpertParallel(ep.placement, ep.a2a, ep.tp, ep.fixed, agrees=i == 0))
    groups = ep.tp is not None or getattr(ep, "cp", None) is not None  # (graphs of such groups' steps: not yet)
    model.replay_gate = ReplayGate(None if groups else ep.fixed)


def move_experts(moe: nn.Module, new: ExpertPlacement) -> bool:
    """Re-place a sharded MoE layer's experts (EPLB, between steps, on every rank of the group at once): each new
    slot gets its expert from this rank's old slots when it held it, else from the lowest rank that did, through
    the group's exchange; the routing follows ``new`` from the next step on. True: the weights and routing tables
    went into the tensors they were in (as many slots as before), which captured graphs hold."""
    ep: ExpertParallel = moe.ep
    old, a2a, me, kept = ep.placement, ep.a2a, ep.rank, True
    if new.n_experts != old.n_experts or new.ranks != old.ranks:
        raise ValueError(f"a placement of {new.n_experts} experts on {new.ranks} ranks replaces one of "
                         f"{old.n_experts} on {old.ranks}")  # fmt: skip
    first = {}  # expert -> (rank, slot) of its first old copy
    for r, held in enumerate(old.slots):
        for s, x in enumerate(held):
            first.setdefault(x, (r, s))
    local = {x: s for s, x in enumerate(old.slots[me])}

    def source(rank: int, x: int) -> tuple[int, int]:
        mine = [s for s, y in enumerate(old.slots[rank]) if y == x]
        return (rank, mine[0]) if mine else first[x]

    sends = [
        [source(d, x)[1] for x in new.slots[d] if source(d, x)[0] == me] if d != me else [] for d in range(a2a.size)
    ]
    recv_from = [source(me, x)[0] for x in new.slots[me]]
    send_n = [len(s) for s in sends]
    recv_n = [sum(1 for q in recv_from if q == r) if r != me else 0 for r in range(a2a.size)]
    order = sorted(range(len(recv_from)), key=lambda s: (recv_from[s], s))  # received rows: by source, slot order
    got_at = [s for s in order if recv_from[s] != me]
    rows = torch.tensor([i for s in sends for i in s], dtype=torch.long)
    for name in _WEIGHTS:
        p = getattr(moe, name, None)
        if p is None:
            continue
        recv = a2a.exchange(p.data.index_select(0, rows.to(p.device)), send_n, recv_n)
        out = p.data.new_empty((len(new.slots[me]), *p.shape[1:]))
        for s, x in enumerate(new.slots[me]):
            if recv_from[s] == me:
                out[s] = p.data[local[x]]
        if got_at:
            out[torch.tensor(got_at, device=p.device)] = recv
        if out.shape == p.shape:  # into the tensor a captured graph holds
            p.data.copy_(out)
        else:
            setattr(moe, name, nn.Parameter(out, requires_grad=False) if isinstance(p, nn.Parameter) else out)
            kept = False
    return ep.place(new) and kept


class ExpertSlots:
    """Where a checkpoint loader puts each routed expert of a model's stacked expert weights (``w1``, ``w2``,
    ``w3`` of a MoE module): the slots holding it in a sharded MoE (``shard``: none, another rank's expert), else
    its own row."""

    def __init__(self, model: nn.Module) -> None:
        self.sharded: dict[str, tuple[dict[int, list[int]], int]] = {}  # target -> (expert -> slots, experts)
        for prefix, mod in model.named_modules():
            ep = getattr(mod, "ep", None)
            if isinstance(ep, ExpertParallel):
                by_expert: dict[int, list[int]] = {}
                for s, x in enumerate(ep.held):
                    by_expert.setdefault(x, []).append(s)
                for w in ("w1", "w2", "w3"):
                    self.sharded[f"{prefix}.{w}"] = (by_expert, ep.placement.n_experts)

    def holds(self, target: str, expert: int) -> bool:
        """Whether this model holds ``expert`` of the stacked parameter ``target`` (an unsharded one: all)."""
        got = self.sharded.get(target)
        return got is None or expert in got[0]

    def rows(self, target: str, expert: int, n: int) -> list[int]:
        """The rows of ``target`` that hold ``expert`` (``n``: the experts of an unsharded target; none: not held,
        or out of range)."""
        got = self.sharded.get(target)
        if got is None:
            return [expert] if 0 <= expert < n else []
        return got[0].get(expert, [])

    def experts(self, target: str, n: int) -> int:
        """The logical experts of ``target`` (``n``: an unsharded target's rows)."""
        got = self.sharded.get(target)
        return n if got is None else got[1]

    def expected(self, target: str, n: int) -> list[int]:
        """The experts a complete load fills in ``target``, ascending."""
        got = self.sharded.get(target)
        return list(range(n)) if got is None else sorted(got[0])


__all__ = ["ExpertParallel", "ExpertSlots", "FixedBuffers", "move_experts", "routed", "shard", "shard_model"]
