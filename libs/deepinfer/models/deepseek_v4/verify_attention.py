"""A verify step's attention in one call per layer: every sub-step's rows at once (``verify_step``).

A verify step on the decode path runs ``K + 1`` sub-steps of the same ``S`` sequences (row ``j·S + b`` is sequence
``b``'s token at ``p_b + j``). Run one after another, each sub-step is a decode step of ``S`` rows: per layer
``K + 1`` times the same dozen small kernels, each too small to fill the device. Here the layer attends once over all
``(K + 1)·S`` rows, as a decode step of that many rows would (``stacked``: the sub-steps' plans as one, the same
kernels), except where a row's keys are the step's own rows, which a plain decode step of those rows would read from
the rings after writing them. Row ``j`` of a sequence must see positions ``p_b .. p_b + j`` and nothing later, but
its later rows' writes land on ring rows it still reads (the window's oldest ``K - j`` rows; a group's first rows). So:

* the window: every row's ``W`` ring rows are gathered before any write (the ring holds the positions before ``p_b``),
  then the rows of ``p_b .. p_b + j`` are put in from the step's projections (``window``); the ring writes follow;
* a compressor ring (``with_ring``), one of two ways, both exact:

  - at most one group completes per sequence in the step (``K + 1 <= m``): the rows up to each sequence's completing
    one are written, the groups pooled from the ring, then the rest written (a write before the completing row
    overwrites a ring row of a position before the group's first: the ring holds a group and its overlap);
  - else (a small ratio, several groups a step): the pool reads each sequence's ring as it was before the step
    followed by the step's projections (``cap + K + 1`` rows a sequence, gathered), and the ring gets each row's
    latest position only (a ring of fewer rows than the step writes: ``verify_rings``' small rings).

Everything but the gathered rows is index arithmetic on the device, once per step and ring size (``plan.once``),
so the step stays capturable as one CUDA graph. A row's keys and their order are the sub-step's, and every kernel's
work for a row is the same, so the output matches the sub-steps' (``tests/models/test_spec_verify.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from deepinfer.models.deepseek_v4 import decode_step
from deepinfer.ops import Ops

Pool = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (kv, score, cur, prev): pool, store


def stacked(plan: Any) -> Any:
    """The verify plan's sub-steps as one decode plan of ``(K + 1)·S`` rows, once per step."""
    return plan.once("stacked", lambda: type(plan.subs[0]).stacked(plan.subs))


def window(plan: Any, flat: torch.Tensor, kv: torch.Tensor, ops: Ops) -> torch.Tensor:
    """Every row's window rows ``[(K+1)·S·W, d]`` in position order, as its sub-step reads them: the ring's rows
    before the step (gathered before it writes), the step's rows ``p_b .. p_b + j`` (``kv``) in their places. Then the
    step's rows are written to the ring (``flat``: the layer's ring ``[slots·W, d]``; each ring row's latest, where
    the step has more rows than the ring: an MTP observe pass)."""
    whole, s, k1 = stacked(plan), plan.size, len(plan.subs)
    ix, w = whole.indices(ops), whole.window
    got = flat.index_select(0, ix.take)
    dst, src = plan.once(("window", w), lambda: _window_rows(s, k1, w, kv.device))
    got.index_copy_(0, dst, kv.index_select(0, src).to(got.dtype))
    put = ix.put if k1 <= w else plan.once(("latest", w), lambda: latest(plan, ix.put, w))
    ops.append_rows([flat], [put], [kv])
    return got


def _window_rows(s: int, k1: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the step's own rows go in the gathered windows: row ``(j, b)``'s entry ``W - 1 - (j - i)`` is the step's
    row ``(i, b)``, ``j - W < i <= j`` (the other pairs repeat the nearest of those: the same value written twice)."""
    j = torch.arange(k1, device=device).view(-1, 1, 1)
    b = torch.arange(s, device=device).view(1, -1, 1)
    i = torch.minimum(torch.maximum(torch.arange(k1, device=device).view(1, 1, -1), j - w + 1), j)
    return ((j * s + b) * w + w - 1 - (j - i)).reshape(-1), (i * s + b).reshape(-1)


def latest(plan: Any, at: torch.Tensor, cap: int) -> torch.Tensor:
    """Ring rows ``at`` of a ring of ``cap`` rows where the row's position is the latest the step writes there (one
    of each sequence's last ``cap``), else the scratch slot's first row."""
    whole, s, k1 = stacked(plan), plan.size, len(plan.subs)
    pos = whole.meta[1]
    end = pos.view(k1, s)[-1].repeat(k1)  # each sequence's last position (its dead rows repeat it)
    return torch.where(pos > end - cap, at, plan.pool.scratch * cap)


@dataclass(frozen=True)
class RingStep:
    """How a verify step pools and writes one compressor ring size (module docstring): ``cur``, ``prev [R, m]`` the
    groups' rows in the pool's source; with ``first`` / ``then`` (ring rows, the other rows at the scratch slot's) the
    two writes around the pool; else ``old`` (each sequence's ring rows, ``[S·cap]``) and ``last`` (each row's ring
    row where it is its ring row's latest write, else the scratch slot's)."""

    cur: torch.Tensor
    prev: torch.Tensor
    first: torch.Tensor | None = None
    then: torch.Tensor | None = None
    old: torch.Tensor | None = None
    last: torch.Tensor | None = None


def ring_step(plan: Any, m: int, cap: int, ops: Ops) -> RingStep:
    """The ``RingStep`` of rings of ratio ``m`` and ``cap`` rows, once per step."""

    def make() -> RingStep:
        whole = stacked(plan)
        at, cur, prev, _, g, done, _, _ = whole.indices(ops).rings[(m, cap)]
        s, k1 = plan.size, len(plan.subs)
        scratch = plan.pool.scratch * cap
        dev = at.device
        if k1 <= m:  # at most one completing row per sequence: write up to it, pool, write the rest
            j = torch.arange(k1, device=dev).view(-1, 1)
            upto = torch.where(done.view(k1, s), j, k1).amin(0)  # each sequence's completing sub-step (none: k1)
            before = (j <= upto).reshape(-1)
            return RingStep(cur, prev, first=torch.where(before, at, scratch), then=torch.where(before, scratch, at))
        floor = whole.meta[2]
        base = plan.base.repeat(k1).unsqueeze(1)
        e = cap + k1
        row0 = (torch.arange(k1 * s, device=dev) % s * e).unsqueeze(1)

        def source(q: torch.Tensor) -> torch.Tensor:  # position -> row of the ring-then-step source
            return row0 + torch.where(q >= base, cap + q - base, q % cap)

        lo, i = floor.unsqueeze(1), torch.arange(m, device=dev)
        g = g.unsqueeze(1)
        cur_q, prev_q = torch.maximum(g * m + i, lo), torch.maximum((g - 1) * m + i, lo)
        old = (plan.slots.unsqueeze(1) * cap + torch.arange(cap, device=dev)).reshape(-1)
        return RingStep(source(cur_q), source(prev_q), old=old, last=latest(plan, at, cap))

    return plan.once(("ring", m, cap), make)


def with_ring(plan: Any, ring: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], m: int,
              ops: Ops, pool: Pool) -> None:  # fmt: skip
    """Pool the groups the step's rows complete (``pool(kv, score, cur, prev)``: pools and stores them) and write the
    step's projections ``new`` (``[(K+1)·S, D]`` each) to the compressor ``ring`` (``[slots, cap, D]`` each)."""
    flat = [x.view(-1, x.shape[-1]) for x in ring]
    rs = ring_step(plan, m, ring[0].shape[1], ops)
    if rs.old is None:
        ops.append_rows(flat, [rs.first, rs.first], list(new))
        pool(flat[0], flat[1], rs.cur, rs.prev)
        ops.append_rows(flat, [rs.then, rs.then], list(new))
        return
    s, k1 = plan.size, len(plan.subs)

    def source(f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d = f.shape[-1]
        before = f.index_select(0, rs.old).view(s, -1, d)
        return torch.cat([before, x.to(f.dtype).view(k1, s, d).transpose(0, 1)], 1).view(-1, d)

    pool(source(flat[0], new[0]), source(flat[1], new[1]), rs.cur, rs.prev)
    ops.append_rows(flat, [rs.last, rs.last], list(new))


def attend(attn: Any, t: dict[str, torch.Tensor], plan: Any, rope: Any, ops: Ops) -> torch.Tensor:
    """DeepSeek-V4's attention output ``[(K+1)·S, H, d]`` of a layer for the verify step ``plan``: the window
    (``window``), the compressors' groups (``with_ring``), then ``decode_step.read`` of the stacked rows."""
    whole, kv, pool = stacked(plan), t["kv"], plan.pool
    ring = pool.rings[attn.layer_id]
    got = window(plan, ring.view(-1, ring.shape[-1]), kv, ops)
    for name, comp in decode_step.compressors(attn):
        pooled = partial(_compress, comp, attn.layer_id, name, whole, rope, ops, kv.dtype)
        new = (t[f"{name}_kv"], t[f"{name}_score"])
        with_ring(plan, pool.rbufs[(attn.layer_id, name)], new, comp.ratio, ops, pooled)
    return decode_step.read(attn, t, whole, got, ops)


def _compress(comp: Any, layer: int, name: str, whole: Any, rope: Any, ops: Ops, dtype: torch.dtype,
              fk: torch.Tensor, fs: torch.Tensor, cur: torch.Tensor, prev: torch.Tensor) -> None:  # fmt: skip
    decode_step.compress(comp, layer, name, whole, rope, ops, dtype, source=(fk, fs, cur, prev))


__all__ = ["RingStep", "attend", "latest", "ring_step", "stacked", "window", "with_ring"]
