"""The MoE kernels' slot layout in one Triton program (decode sizes): what ``padded_blocks(moe_layout(idx, E), E,
block_m)`` computes with about a dozen torch kernels (sort, searchsorted, diff, cumsum, scatter, ...).

``padded_slots(idx, experts, block_m) -> (slots [P], block_expert [P / block_m])``: the ``T·k`` slots sorted by
expert (stable: slot order within an expert), each expert's group padded to ``block_m`` rows with the sentinel
``T·k``; ``block_expert`` the expert of each block, ``experts`` for blocks past the last group. ``P`` is the host's
upper bound of ``padded_blocks``, so the grid of the kernels that read the layout depends on ``T·k`` alone and the
call can be captured in a CUDA graph.

One program of the kernel holds every slot: a histogram of the experts gives each group's padded start (a cumsum),
one in-register sort of the keys ``expert · S + slot`` gives each slot its rank in its group, a scatter writes the
slots after the sentinel fill, and each expert writes its id into its blocks after a fill with ``experts`` (what
``searchsorted(ends, start, right=True)`` gives: a block inside an expert's group is preceded by the groups of the
lower experts, empty ones included; one past the last group by all of them). At T = 1 an MXFP4 MoE call spent about
48 of its 114 µs in the torch layout (bench/results/kernels/2026-11-30-moe-mxfp4-shift.md). Above ``MAX_SLOTS`` slots or
``MAX_EXPERTS`` experts (prefill) the torch layout runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.moe_slots import moe_layout, padded_blocks
from deepinfer.kernels.pdl import pdl_wait

MAX_SLOTS = 2048  # T·k of one program (a bitonic sort in registers); decode steps of up to 341 tokens at top-6
MAX_EXPERTS = 512


@triton.jit
def _align_kernel(idx_ptr, slots_ptr, bexp_ptr, TK, E, P, NBLK, BLOCK_M: tl.constexpr, S: tl.constexpr,
                  EB: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    s = tl.arange(0, S)
    e = tl.load(idx_ptr + s, mask=s < TK, other=E).to(tl.int32)  # slots past T·k: expert E, sorted last
    eb = tl.arange(0, EB)
    counts = tl.where(eb < E, tl.histogram(e, EB), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pends = tl.cumsum(padded, 0)
    pstarts = pends - padded
    starts = tl.cumsum(counts, 0) - counts
    key = tl.sort(e * S + s)  # expert-major, slot order within an expert (the keys are distinct)
    se, slot = key // S, key % S
    sec = tl.minimum(se, E - 1)
    dest = tl.gather(pstarts, sec, 0) + s - tl.gather(starts, sec, 0)
    for off in range(0, P, S):
        tl.store(slots_ptr + off + s, tl.full((S,), 0, tl.int32) + TK, mask=off + s < P)
    for off in range(0, NBLK, S):  # blocks past the last group: expert E
        tl.store(bexp_ptr + off + s, tl.full((S,), 0, tl.int32) + E, mask=off + s < NBLK)
    tl.debug_barrier()  # the fills before the scatters
    tl.store(slots_ptr + dest, slot, mask=se < E)
    nblk = padded // BLOCK_M  # each expert's blocks, from its padded start: its id
    first = pstarts // BLOCK_M
    for r in range(0, tl.max(nblk, 0)):
        tl.store(bexp_ptr + first + r, eb, mask=r < nblk)


def padded_slots(idx: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``padded_blocks(moe_layout(idx, experts), experts, block_m)`` (module docstring): int32 ``slots`` and
    ``block_expert``; one Triton program for up to ``MAX_SLOTS`` slots and ``MAX_EXPERTS`` experts on CUDA (or in
    the interpreter), the torch layout otherwise."""
    tk = idx.numel()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if tk == 0 or tk > MAX_SLOTS or experts > MAX_EXPERTS or not (idx.is_cuda or interpret):
        return padded_blocks(moe_layout(idx, experts), experts, block_m)
    nonempty = min(experts, tk)
    size = -(-(tk + nonempty * (block_m - 1)) // block_m) * block_m  # padded_blocks' bound
    slots = torch.empty(size, dtype=torch.int32, device=idx.device)
    bexp = torch.empty(size // block_m, dtype=torch.int32, device=idx.device)
    s, eb = triton.next_power_of_2(tk), triton.next_power_of_2(experts + 1)
    _align_kernel[(1,)](
        idx.reshape(-1).contiguous(), slots, bexp, tk, experts, size, size // block_m, BLOCK_M=block_m, S=s, EB=eb,
        num_warps=8 if s >= 1024 else 4, **pdl.launch(),
    )  # fmt: skip
    return slots, bexp


__all__ = ["MAX_EXPERTS", "MAX_SLOTS", "padded_slots"]
