"""DeepSeek-V4.1's cache round trips (``quant.cache``) as one Triton kernel each, bit for bit.

``cache_round(x, fmt)`` is ``quant.cache.fp8_window_round(x)`` (``fmt="fp8"``: FP8 E4M3, power-of-two scale per 32
channels), ``nvfp4_round(x)`` (``"nvfp4"``: E2M1, E4M3 scale per 16) or ``mxfp4_round(x)`` (``"mxfp4"``: E2M1,
power-of-two scale per 32) over the last dim of ``x``, in ``x.dtype``. The torch versions take 22-30 small kernels
a call; a decode step of V4.1 rounds its window KV and index queries every step and the compressed rows and index
keys of every group it completes, so on the GPU these were a large share of a step's kernel launches.

One program rounds ``ROWS`` rows. Every step is the torch version's, in fp32: the block's ``amax`` (a trailing
partial block zero-padded), the scale (``pow2_ceil`` from the float's bits; ``x / 6`` as an IEEE division for the
NVFP4 scale), ``x / scale`` (IEEE), the E4M3 rounding done with integer and float operations, not a conversion
instruction (ties to even, saturating at 448 as torch's cast does: the interpreter and every GPU agree), the E2M1
rounding by thresholds (ties to the even code, the sign from the sign bit) and the product with the scale, exact in
``x.dtype``.

Bit-identical to the torch round trips run on the CPU, in Triton's interpreter and on an H200
(``tests/kernels/test_cache_round.py``); ``NvidiaOps.cache_round`` calls it for CUDA tensors. (The NVFP4 scale
saturates at 448, as ``quant.cache.nvfp4_round`` now says explicitly: torch 2.11's cast to E4M3 gave NaN past it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait

FORMATS = {"fp8": (0, 32), "nvfp4": (1, 16), "mxfp4": (2, 32)}  # name -> (kind, block)
_ROWS = 4


@triton.jit
def _pow2_ceil(x):
    """The smallest power of two >= positive normal fp32 ``x``."""
    bits = x.to(tl.int32, bitcast=True)
    up = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((((bits >> 23) & 255) + up) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _signed(v, x):
    """``|v|`` with ``x``'s sign bit (``-0.0`` kept: Triton's negation is a subtraction from zero)."""
    return (v.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(x):
    """``x`` rounded to FP8 E4M3 (ties to even; saturating at ±448), as fp32."""
    a = tl.abs(x)
    small = (a + 16384.0) - 16384.0  # below 2^-6 the E4M3 grid is 2^-9: fp32's grid at 2^14
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits kept
    v = tl.minimum(tl.where(a < 0.015625, small, normal), 448.0)
    return _signed(v, x)


@triton.jit
def _e2m1(x):
    """``x`` (within ±6) rounded to the E2M1 grid (ties to the even code; the sign from the sign bit)."""
    a = tl.abs(x)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))  # fmt: skip
    v = tl.where(code <= 4, code.to(tl.float32) * 0.5, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))
    return _signed(v, x)


@triton.jit
def _round_kernel(x_ptr, out_ptr, R, N, stride_x, stride_o, KIND: tl.constexpr, BLOCK: tl.constexpr,
                  NB: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [NB, BLOCK] channel
    mask = (r < R)[:, None, None] & (c < N)[None, :, :]
    g = tl.load(x_ptr + r.to(tl.int64)[:, None, None] * stride_x + c[None, :, :], mask=mask, other=0.0)
    g = g.to(tl.float32)
    amax = tl.max(tl.abs(g), axis=2)[:, :, None]
    if KIND == 0:
        scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1 / 448))
        q = _e4m3(tl.minimum(tl.maximum(tl.math.div_rn(g, scale), -448.0), 448.0))
    elif KIND == 1:
        scale = _e4m3(tl.math.div_rn(tl.maximum(amax, 6 * 2.0**-9), tl.full(amax.shape, 6.0, tl.float32)))
        q = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(g, scale), -6.0), 6.0))
    else:
        scale = _pow2_ceil(tl.maximum(amax, 6 * 2.0**-126) * (1 / 6))
        q = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(g, scale), -6.0), 6.0))
    out = q * scale
    tl.store(out_ptr + r.to(tl.int64)[:, None, None] * stride_o + c[None, :, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def cache_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``quant.cache``'s round trip ``fmt`` (``fp8``, ``nvfp4`` or ``mxfp4``) of ``x`` over its last dim, in one
    kernel (module docstring); ``x`` on CUDA or under the Triton interpreter."""
    if fmt not in FORMATS:
        raise ValueError(f"cache_round: format must be one of {sorted(FORMATS)}, got {fmt!r}")
    kind, block = FORMATS[fmt]
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r = x2.shape[0]
    if r and n:
        nb = triton.next_power_of_2(-(-n // block))
        _round_kernel[(triton.cdiv(r, _ROWS),)](
            x2,
            out,
            r,
            n,
            x2.stride(0),
            out.stride(0),
            KIND=kind,
            BLOCK=block,
            NB=nb,
            ROWS=_ROWS,
            num_warps=4,
            **pdl.launch(),
        )
    return out.view(x.shape)


__all__ = ["FORMATS", "cache_round"]
