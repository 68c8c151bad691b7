"""FP8 activation quantisation for the block-scaled GEMMs (``fp8_gemm``): DeepSeek's ``act_quant`` (per 1×``block``
of K a power-of-two scale ``s ≥ amax/448``, ``amax`` clamped ≥ 1e-4, ``x/s`` clamped to ±448 and rounded to e4m3,
nearest-even), as Triton helpers for the GEMM kernels (``quant_sim``), one kernel writing e4m3 values and scales
(``act_quant_fp8``, the W8A8 path's input) or their product (``act_quant_sim``, the W8A16 path's pre-pass), and the
torch version of the same (plain CPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.formats import FP8_MAX, pow2_scale
from deepinfer.kernels.fp8_gemm_config import ACT_BLOCK, interpreted
from deepinfer.kernels.pdl import pdl_wait

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _ue8m0_scale(amax):
    """(s, 1/s): the smallest power of two with ``max(amax, 1e-4) <= 448·s`` (``pow2_scale``'s result, exactly)."""
    a = tl.maximum(amax, 1e-4)
    bits = (a / 448.0).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil to a power of two (a rounded quotient)
    e = tl.where(a > 448.0 * (e << 23).to(tl.float32, bitcast=True), e + 1, e)  # exact fix-ups
    e = tl.where(a <= 224.0 * (e << 23).to(tl.float32, bitcast=True), e - 1, e)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(v):
    """``v`` (fp32, |v| ≤ 448) rounded to the nearest e4m3 value, ties to even, sign kept (exact fp32 arithmetic)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 121)  # the ulp is 2^(e-130); below 2^-6 (subnormals) it stays 2^-9
    inv = ((257 - e) << 23).to(tl.float32, bitcast=True)
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(v) * inv + 12582912.0) - 12582912.0) * ulp  # 1.5·2^23: adding it rounds to an integer (RNE)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quant_sim(x, AXIS: tl.constexpr):
    """``act_quant_sim`` of a tile whose whole quantisation block lies along ``AXIS`` → (rounded x/s, s)."""
    s, inv = _ue8m0_scale(tl.max(tl.abs(x), axis=AXIS))
    q = _e4m3_round(tl.minimum(tl.maximum(x * tl.expand_dims(inv, AXIS), -448.0), 448.0))
    return q, s


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, NB, stride_xm, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                      DEQ: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """e4m3 values and scales, or (``DEQ``) ``act_quant_sim``'s output ``q·s`` in ``q_ptr``'s dtype."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (g < NB)[:, None]
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    q, s = quant_sim(x, 1)
    if DEQ:
        q = q * s[:, None]
    else:
        tl.store(s_ptr + row * NB + g, s, mask=g < NB)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def act_quant_torch(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    xb = x.float().unflatten(-1, (-1, block))
    s = pow2_scale(xb.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def act_quant_fp8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` → (e4m3 ``[..., K]``, fp32 power-of-two scales ``[..., K/block]``) with
    ``q.float() · s == ReferenceOps.act_quant_sim(x, block)`` (before its rounding to ``x.dtype``)."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"act_quant_fp8: x must be float32, bfloat16 or float16, got {x.dtype}")
    k = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or block < 1 or block & (block - 1) or k % block:
        raise ValueError(f"act_quant_fp8: the last dim ({k}) must be a multiple of the power-of-two block {block}")
    if not x.is_cuda and not interpreted():
        return act_quant_torch(x, block)
    x2 = x.reshape(-1, k).contiguous()
    m, nb = x2.shape[0], k // block
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    if m and k:
        groups = max(1, min(triton.next_power_of_2(nb), 2048 // block))
        _act_quant_kernel[(m, triton.cdiv(nb, groups))](
            x2, q, s, k, nb, x2.stride(0), BLOCK=block, GROUPS=groups, DEQ=False, **pdl.launch()
        )
    return q.view(x.shape), s.view(*x.shape[:-1], nb)


def act_quant_sim(x2: torch.Tensor) -> torch.Tensor:
    """``act_quant_sim(x2, 128)`` for a 2-D CUDA / interpreter tensor, in one kernel."""
    m, k = x2.shape
    out = torch.empty_like(x2)
    groups = max(1, min(triton.next_power_of_2(k // ACT_BLOCK), 16))
    _act_quant_kernel[(m, triton.cdiv(k // ACT_BLOCK, groups))](
        x2, out, out, k, k // ACT_BLOCK, x2.stride(0), BLOCK=ACT_BLOCK, GROUPS=groups, DEQ=True, **pdl.launch()
    )
    return out


__all__ = ["act_quant_fp8"]
