"""The MoE kernels' torch slot layout: the ``T·k`` slots of a routed batch sorted by expert (``moe_layout``) and
each expert's group padded to whole blocks (``padded_blocks``). ``kernels.moe`` and ``kernels.moe_align`` (which
builds the padded layout in one Triton program at decode sizes) both read it. Nothing here reads a device value on the
host, so a step never waits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoELayout:
    """The ``T·k`` slots (slot ``s`` = token ``s // k``, choice ``s % k``) ordered by expert."""

    order: torch.Tensor  # [T·k] slot ids sorted by expert (stable: token order within an expert)
    sorted_expert: torch.Tensor  # [T·k] expert of each sorted slot
    ends: torch.Tensor  # [E] int32 cumulative end of each expert's group in the sorted order


def moe_layout(idx: torch.Tensor, experts: int) -> MoELayout:
    flat = idx.reshape(-1)
    # the narrowest key that holds every expert id: a radix sort passes over the key's bits (int64 ids: 8 passes of
    # 8 bits, int16: 2), and a stable sort of the same values gives the same order
    narrow = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
    keys, order = torch.sort(flat.to(narrow), stable=True)
    sorted_expert = keys.to(flat.dtype)
    bounds = torch.arange(1, experts + 1, device=idx.device, dtype=sorted_expert.dtype)
    ends = torch.searchsorted(sorted_expert, bounds).to(torch.int32)
    return MoELayout(order, sorted_expert, ends)


def padded_blocks(layout: MoELayout, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``slots [P]``: sorted slot ids with each expert's group padded to ``block_m`` rows by the sentinel ``T·k``;
    ``block_expert [P / block_m]``: the expert of each block, ``experts`` for blocks past the last group)."""
    tk = layout.order.numel()
    dev = layout.order.device
    ends = layout.ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    pends = torch.cumsum(padded, 0)
    pstarts = pends - padded
    starts = ends - counts
    rank = torch.arange(tk, device=dev) - starts[layout.sorted_expert]
    nonempty = min(experts, tk)
    size = -(-(tk + nonempty * (block_m - 1)) // block_m) * block_m  # an upper bound of pends[-1], known on the host
    slots = torch.full((size,), tk, dtype=torch.int32, device=dev)
    slots[pstarts[layout.sorted_expert] + rank] = layout.order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(pends, block_start, right=True).to(torch.int32)
    return slots, block_expert


__all__ = ["MoELayout", "moe_layout", "padded_blocks"]
