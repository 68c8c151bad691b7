"""Routed-expert MoE without host syncs: token slots sorted by expert, then grouped GEMMs.

The semantics are ``ReferenceOps.moe``: for every token ``t`` and slot ``j`` with expert ``e = idx[t, j]``,
``h = w · silu(min(x·w1[e]ᵀ, limit)) · clamp(x·w3[e]ᵀ, ±limit)`` (gate and up rounded to ``x.dtype`` first, as the
reference's ``F.linear`` returns them; ``w = weights[t, j]`` applied in fp32 before the down projection), ``h`` rounded
to ``x.dtype``, ``o = h·w2[e]ᵀ`` in ``x.dtype``, and ``y[t] = Σ_j o`` accumulated in fp32.

Two implementations share the slot layout (``kernels.moe_slots.moe_layout``: one stable sort of the ``T·k`` slots
by expert id and per-expert offsets found by ``searchsorted``; nothing reads a device value on the host, so a step
never waits; at decode sizes ``kernels.moe_align`` builds the padded layout of ``moe_triton`` in one Triton
program):

* ``moe_grouped_mm``: ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper, a torch fallback elsewhere) for gate,
  up and down, and ``swiglu_weighted`` (one Triton pass on CUDA) in between;
* ``moe_triton``: two Triton kernels in the style of vLLM's fused MoE. The slots of each expert are padded to
  ``BLOCK_M`` rows; kernel 1 computes gate and up of one ``[BLOCK_M, BLOCK_N]`` tile together and writes the
  weighted SwiGLU (``h`` never exists unactivated), kernel 2 the down projection. A block whose expert id is ``E``
  (past the last padded group) exits at once, so the grid is sized on the host from ``T·k`` alone.

Both accumulate each GEMM in fp32 over K in one pass (no split-K); the combine sums a token's ``k`` slot outputs in
slot order (the reference adds them in expert-id order: results agree to fp32 rounding of that sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm_config import interpreted
from deepinfer.kernels.moe_align import padded_slots
from deepinfer.kernels.moe_slots import moe_layout
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import plan_rows
from deepinfer.kernels.shared_memory import fit_stages

_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    max_regs: int | None = None  # registers a thread (ptxas .maxnreg; the MXFP4 kernels): more programs an SM

    def launch(self) -> dict[str, int]:
        """The launch options of these tiles."""
        out = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        return out if self.max_regs is None else {**out, "maxnreg": self.max_regs}


# few slots per expert (decode): weights dominate, small M tiles; many (prefill): large tiles for the tensor cores
MOE_SMALL = MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
MOE_LARGE = MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
MOE_INTERPRET = MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def stage_bytes(cfg: MoEConfig, elem_bytes: int) -> int:
    """Shared memory of one pipeline stage of the gate/up kernel (the larger of the two): an ``x`` tile and the
    ``w1`` and ``w3`` tiles."""
    return (cfg.block_m * cfg.block_k + 2 * cfg.block_n * cfg.block_k) * elem_bytes


def pick_config(slots: int, experts: int, interpret: bool = False, elem_bytes: int = 2) -> MoEConfig:
    if interpret:
        return MOE_INTERPRET
    cfg = MOE_SMALL if slots <= 6 * experts else MOE_LARGE  # the crossing measured on an H200 (T=256 vs 1024)
    stages = fit_stages(cfg.num_stages, stage_bytes(cfg, elem_bytes))  # fp32 operands: fewer stages
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


@triton.jit
def silu_mul(g, u, limit):
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit(do_not_specialize=["TK", "E"])
def _moe_gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    rw_ptr,
    slots_ptr,
    bexp_ptr,
    h_ptr,
    TK,
    E,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    limit,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + offs_m)
        valid = slot < TK
        tok = (slot // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        rk = tl.arange(0, BLOCK_K)
        wbase = e.to(tl.int64) * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask_k = kk < K
            a_mask = valid[:, None] & mask_k[None, :]
            a = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=a_mask, other=0.0)
            w_off = wbase + rn[None, :].to(tl.int64) * stride_wn + kk[:, None]
            w_mask = mask_k[:, None] & mask_n[None, :]
            b1 = tl.load(w1_ptr + w_off, mask=w_mask, other=0.0)
            b3 = tl.load(w3_ptr + w_off, mask=w_mask, other=0.0)
            acc_g = tl.dot(a, b1, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, b3, acc_u, input_precision=PRECISION)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)  # the reference's gate/up come out of F.linear in x.dtype
        u = acc_u.to(dt).to(tl.float32)
        rw = tl.load(rw_ptr + slot, mask=valid, other=0.0)
        h = silu_mul(g, u, limit) * rw[:, None]
        h_off = slot.to(tl.int64)[:, None] * stride_hm + rn[None, :]
        tl.store(h_ptr + h_off, h.to(dt), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["TK", "E"])
def _moe_down_kernel(
    h_ptr,
    w2_ptr,
    slots_ptr,
    bexp_ptr,
    o_ptr,
    TK,
    E,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + offs_m)
        valid = slot < TK
        row = slot.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        rk = tl.arange(0, BLOCK_K)
        wbase = e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask_k = kk < K
            a_mask = valid[:, None] & mask_k[None, :]
            a = tl.load(h_ptr + row[:, None] * stride_hm + kk[None, :], mask=a_mask, other=0.0)
            b = tl.load(
                w2_ptr + wbase + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        o_off = row[:, None] * stride_om + rn[None, :]
        tl.store(o_ptr + o_off, acc.to(o_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _swiglu_weighted_kernel(g_ptr, u_ptr, w_ptr, out_ptr, N, limit, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row)
    tl.store(out_ptr + row * N + offs, (silu_mul(g, u, limit) * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, idx, weights, w1, w2, w3) -> None:
    if x.dtype not in _DTYPES or not (w1.dtype == w2.dtype == w3.dtype == x.dtype):
        raise ValueError(f"moe: x and the expert weights must share float32 or bfloat16, got {x.dtype}, {w1.dtype}")
    t, d = x.shape
    e, i, d1 = w1.shape
    if d1 != d or w3.shape != w1.shape or w2.shape != (e, d, i):
        raise ValueError(
            f"moe: expected w1/w3 [E, I, {d}] and w2 [E, {d}, I], got {tuple(w1.shape)}, {tuple(w3.shape)}, "
            f"{tuple(w2.shape)}"
        )
    if idx.dim() != 2 or idx.shape[0] != t or weights.shape != idx.shape:
        raise ValueError(f"moe: idx and weights must be [{t}, k], got {tuple(idx.shape)} and {tuple(weights.shape)}")


def swiglu_weighted(
    g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, limit: float, dtype: torch.dtype
) -> torch.Tensor:
    """``(w · silu(min(g, limit)) · clamp(u, ±limit))`` in fp32, rounded to ``dtype``: ``g, u [M, N]``, ``w [M]``."""
    m, n = g.shape
    if g.is_cuda and m and n:
        out = torch.empty((m, n), dtype=dtype, device=g.device)
        block = 1024
        _swiglu_weighted_kernel[(m, triton.cdiv(n, block))](
            g.contiguous(), u.contiguous(), w.float().contiguous(), out, n, float(limit), BLOCK=block, **pdl.launch()
        )
        return out
    gf = g.float().clamp(max=limit)
    h = torch.nn.functional.silu(gf) * u.float().clamp(-limit, limit)
    return (w.float().unsqueeze(-1) * h).to(dtype)


COMBINE_BLOCK = 1024


@triton.jit
def _combine_kernel(o_ptr, y_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.load(o_ptr + t * K * D + d, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K):
        acc += tl.load(o_ptr + (t * K + j) * D + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + d, acc, mask=mask)


def combine(o: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """``y[t] = Σ_j o[t·k + j]`` in fp32, ``j = 0 .. k-1`` in order: ``o [T·k, D]`` → ``[T, D]`` fp32. On CUDA (and in
    Triton's interpreter) one pass that reads ``o`` in its dtype (the torch form wrote an fp32 copy of it first: 1.2
    of 48 ms of a 4k prefill on an H200)."""
    d = o.shape[-1]
    if not (o.is_cuda or interpreted()) or k == 0 or t == 0:
        return o.view(t, k, d).float().sum(1)
    o = o.contiguous()
    y = torch.empty((t, d), dtype=torch.float32, device=o.device)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(d))
    _combine_kernel[(t, triton.cdiv(d, block))](o, y, d, K=k, BLOCK=block, num_warps=4, **pdl.launch())
    return y


def moe_grouped_mm(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    hidden: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``ReferenceOps.moe`` through ``torch._grouped_mm`` (module docstring) → ``[T, D]`` fp32; ``hidden``: applied to
    the weighted SwiGLU rows before ``w2`` (``act_quant``'s rounding)."""
    _check(x, idx, weights, w1, w2, w3)
    t, k = idx.shape
    if t == 0:
        return torch.zeros(0, w2.shape[1], dtype=torch.float32, device=x.device)
    lay = moe_layout(idx, w1.shape[0])
    xs = x[lay.order // k]
    g = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=lay.ends)
    u = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=lay.ends)
    h = swiglu_weighted(g, u, weights.reshape(-1)[lay.order], limit, x.dtype)
    if hidden is not None:
        h = hidden(h)
    o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=lay.ends)
    out = torch.empty_like(o)
    out[lay.order] = o  # back to slot order
    return combine(out, t, k)


def moe_triton(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    config: MoEConfig | None = None,
    hidden: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``ReferenceOps.moe`` in two Triton kernels (module docstring) → ``[T, D]`` fp32; ``hidden``: applied to the
    weighted SwiGLU rows before ``w2`` (``act_quant``'s rounding)."""
    _check(x, idx, weights, w1, w2, w3)
    t, k = idx.shape
    e, inter, d = w1.shape
    if t == 0:
        return torch.zeros(0, d, dtype=torch.float32, device=x.device)
    tk = t * k
    plan = plan_rows(t) * k  # (kernels.pinning: a pinned call plans for PLAN_ROWS tokens)
    cfg = config or pick_config(plan, e, interpreted(), max(x.element_size(), w1.element_size()))
    slots, bexp = padded_slots(idx, e, cfg.block_m)
    x = x.contiguous()
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    rw = weights.reshape(-1).float().contiguous()
    h = torch.empty((tk, inter), dtype=x.dtype, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    nblocks = bexp.numel()
    _moe_gate_up_kernel[(nblocks, triton.cdiv(inter, cfg.block_n))](
        x, w1, w3, rw, slots, bexp, h, tk, e, inter, d,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), float(limit),
        TOPK=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(),
    )  # fmt: skip
    if hidden is not None:
        h = hidden(h)
    o = torch.empty((tk, d), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(nblocks, triton.cdiv(d, cfg.block_n))](
        h, w2, slots, bexp, o, tk, e, d, inter,
        h.stride(0), w2.stride(0), w2.stride(1), o.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(),
    )  # fmt: skip
    return combine(o, t, k)


__all__ = ["MoEConfig", "moe_grouped_mm", "moe_triton", "swiglu_weighted"]
