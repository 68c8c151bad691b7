"""What a verify step on the decode path (``verify_step``) saves of the state pool's rings, and how its rollback puts
it back. Shared by the DeepSeek-V4 and V4.1 verify steps: a layer's rings are what its attention registers with the
pool (``pool_specs``: its window ring, its compressors' (kv, score) rings).

A sub-step at position ``p_b + j`` writes ring row ``(p_b + j) % cap``. Two ways back to ``p_b + a_b + 1`` consumed
tokens:

* a ring of more than ``K`` rows (``K`` the step's most drafts): the rows of positions ``p_b + 1 .. p_b + K`` are
  distinct; the step saves them before its first sub-step (``K`` rows per sequence) and the rollback puts back the
  rejected ones (``p_b + a_b + 1 ..``). Where a model's ring has no other way (below), ``K`` must stay under its
  size (``ring_rows``).
* a ring of at most ``K`` rows whose rows are the step's own projections (the layer names them: ``ring_sources``,
  e.g. DeepSeek-V4.1's ratio-2 compressor ring of 2 rows): later sub-steps overwrite what kept ones wrote, so the
  step saves the ring's rows before it (all ``cap`` of them) and the projections of every sub-step; the rollback
  writes each ring row ``r`` as a plain run has it after ``p_b + a_b``: the projection of the latest kept position
  ``q <= p_b + a_b`` with ``q % cap = r`` where ``q >= p_b``, else the row saved before the step.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.models.deepseek_v4.state_pool import StatePool

Ring = tuple[object, list[torch.Tensor], tuple[str, ...] | None]  # key, its tensors, the projections written to it


def rings(attn: Any, pool: StatePool) -> list[Ring]:
    """A layer's rings that a verify step writes (its window ring, its compressors' rings), each with the names of
    the projections a sub-step writes to it where the layer says (``ring_sources``)."""
    windows, bufs = attn.pool_specs()
    sources = attn.ring_sources() if hasattr(attn, "ring_sources") else {}
    return [(k, [pool.rings[k]], sources.get(k)) for k in windows] + [
        (k, list(pool.rbufs[k]), sources.get(k)) for k in bufs
    ]


def ring_rows(model: torch.nn.Module) -> int:
    """The fewest rows of any of the model's rings restored from saved rows only (``K`` must stay below): walked
    once per model (every verify step asks)."""
    got = model.__dict__.get("_ring_rows")
    if got is None:
        caps = []
        for layer in model.layers:
            windows, bufs = layer.attn.pool_specs()
            sources = layer.attn.ring_sources() if hasattr(layer.attn, "ring_sources") else {}
            caps += [rows for k, (rows, _) in windows.items() if k not in sources]
            caps += [spec[0] for k, spec in bufs.items() if k not in sources]
        got = model.__dict__["_ring_rows"] = min(caps)
    return got


def _small(tensors: list[torch.Tensor], names: tuple[str, ...] | None, drafts: int) -> bool:
    return names is not None and tensors[0].shape[1] <= drafts


def _rows(plan: Any, cap: int) -> torch.Tensor:
    """Each row's ring rows of positions ``p_b + 1 .. p_b + K`` in a ring of ``cap`` rows viewed ``[slots·cap, d]``
    (``[S·K]``), once per step and ring size."""

    def make() -> torch.Tensor:
        k = torch.arange(1, plan.drafts + 1, device=plan.base.device)
        return (plan.slots.unsqueeze(1) * cap + (plan.base.unsqueeze(1) + k) % cap).reshape(-1)

    return plan.once(("rows", cap), make)


def _all_rows(plan: Any, cap: int) -> torch.Tensor:
    """Every row's whole ring ``[S·cap]`` (a small ring's), once per step and ring size."""

    def make() -> torch.Tensor:
        return (plan.slots.unsqueeze(1) * cap + torch.arange(cap, device=plan.slots.device)).reshape(-1)

    return plan.once(("all rows", cap), make)


def _keep(plan: Any, key: object, got: torch.Tensor) -> None:
    if key in plan.saved:
        plan.saved[key].copy_(got)
    else:
        plan.saved[key] = got


def save(attn: Any, plan: Any, t: dict[str, torch.Tensor]) -> None:
    """Keep what the rollback needs of the layer's rings (module docstring), before its first sub-step:
    ``plan.saved[key]`` ``[n, S·K, d]`` (or ``[n, S·cap, d]`` and the projections ``t`` of every row,
    ``plan.saved[(key, "new")]``, for a small ring); written into the buffers there, if any (a graphed bucket's)."""
    if plan.drafts == 0:
        return
    for key, tensors, names in rings(attn, plan.pool):
        cap = tensors[0].shape[1]
        small = _small(tensors, names, plan.drafts)
        rows = _all_rows(plan, cap) if small else _rows(plan, cap)
        _keep(plan, key, torch.stack([x.view(-1, x.shape[-1]).index_select(0, rows) for x in tensors]))
        if small:
            _keep(plan, (key, "new"), torch.stack([t[name] for name in names]))


def allocate(model: torch.nn.Module, plan: Any) -> None:
    """The buffers ``save`` writes into (a graphed bucket's, made before its capture)."""
    k1s = plan.size * (plan.drafts + 1)
    for layer in model.layers:
        for key, tensors, names in rings(layer.attn, plan.pool):
            x = tensors[0]
            small = _small(tensors, names, plan.drafts)
            n = plan.size * (x.shape[1] if small else plan.drafts)
            plan.saved[key] = torch.zeros(len(tensors), n, x.shape[-1], dtype=x.dtype, device=x.device)
            if small:
                plan.saved[(key, "new")] = torch.zeros(len(tensors), k1s, x.shape[-1], dtype=x.dtype, device=x.device)


def restore(model: torch.nn.Module, plan: Any, accepted: torch.Tensor) -> None:
    """Bring every layer's rings to ``p_b + a_b + 1`` consumed tokens (``accepted [S]`` on the device: ``a_b``; 0 for
    a row without drafts): module docstring."""
    if plan.drafts == 0:
        return
    k = torch.arange(1, plan.drafts + 1, device=accepted.device)
    reject = (k.unsqueeze(0) > accepted.unsqueeze(1)).reshape(-1, 1)
    for layer in model.layers:
        for key, tensors, names in rings(layer.attn, plan.pool):
            cap = tensors[0].shape[1]
            if _small(tensors, names, plan.drafts):
                _restore_small(plan, tensors, plan.saved[key], plan.saved[(key, "new")], accepted)
                continue
            rows = _rows(plan, cap)
            for x, old in zip(tensors, plan.saved[key]):
                flat = x.view(-1, x.shape[-1])
                flat.index_copy_(0, rows, torch.where(reject, old, flat.index_select(0, rows)))


def _restore_small(plan: Any, tensors: list[torch.Tensor], old: torch.Tensor, new: torch.Tensor,
                   accepted: torch.Tensor) -> None:  # fmt: skip
    """A small ring's rows after ``p_b + a_b``: the latest kept sub-step's projection, else the row saved before."""
    s, cap = plan.size, tensors[0].shape[1]
    dev = accepted.device
    last = (plan.base + accepted).unsqueeze(1)  # [S, 1]: the last kept position
    r = torch.arange(cap, device=dev)
    j = last - torch.remainder(last - r, cap) - plan.base.unsqueeze(1)  # [S, cap]: the sub-step that wrote row r
    mine = (j >= 0).reshape(-1, 1)
    step_rows = (j.clamp_min(0) * s + torch.arange(s, device=dev).unsqueeze(1)).reshape(-1)
    dst = _all_rows(plan, cap)
    for x, o, n in zip(tensors, old, new):  # (``o``: the saved rows in ``dst``'s order)
        x.view(-1, x.shape[-1]).index_copy_(0, dst, torch.where(mine, n.index_select(0, step_rows), o))


__all__ = ["allocate", "restore", "ring_rows", "rings", "save"]
