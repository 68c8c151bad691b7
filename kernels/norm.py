"""RMSNorm and interleaved RoPE in one Triton launch each (the reference takes ~7 and ~10 small launches).

The semantics are ``ReferenceOps.rms_norm`` and ``ReferenceOps.rope`` (``deepinfer.backends.reference``):

* ``rms_norm(x, weight, eps)``: ``w · x · rsqrt(mean(x²) + eps)`` over the last dim in fp32, ``x.dtype`` out.
* ``rope(x, cos, sin, inverse)``: the GPT-J pair rotation of the last ``2 · cos.shape[-1]`` dims of ``x`` (``sin``
  negated for the inverse), the other dims copied. ``cos`` / ``sin`` hold one row per group of ``G`` consecutive
  rows of ``x`` (``[T, 1, r]`` against ``x [T, H, d]``: ``G = H``); other broadcasts are left to the reference
  (``rope_supported``).

A program takes as many rows as fit ``ROW_ELEMS`` elements (``INTERPRET_ELEMS`` in Triton's interpreter). Results
agree with the reference to fp32 rounding (reduction order, fused multiply-adds); nothing reads a device value on the
host, so both are safe to capture in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import plan_rows

ROW_ELEMS = 4096  # a program takes rows of up to this many elements together (one row when wider)
INTERPRET_ELEMS = 1 << 16  # in Triton's interpreter (numpy vectorises a program, not a grid)


def _rows_per_program(width: int, rows: int) -> int:
    """Rows a program takes (a pinned call, ``kernels.pinning``: as for ``PLAN_ROWS`` rows)."""
    budget = INTERPRET_ELEMS if os.environ.get("TRITON_INTERPRET") == "1" else ROW_ELEMS
    return max(1, min(budget // triton.next_power_of_2(max(width, 1)), triton.next_power_of_2(plan_rows(rows))))


@triton.jit(do_not_specialize=["R"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, D, stride_x, eps, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    m = (r < R)[:, None] & (d < D)[None, :]
    off = r[:, None] * D + d[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=m, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if HAS_W:
        y = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :] * y
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R", "G"])
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    R,
    D,
    G,
    sign,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPLACE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < R
    c_row = r // G
    nope = D - 2 * HALF
    if not INPLACE:  # out is x: the dims that are not rotated are already there
        d = tl.arange(0, BLOCK_D)
        md = mr[:, None] & (d < nope)[None, :]
        off = r[:, None] * D + d[None, :]
        tl.store(out_ptr + off, tl.load(x_ptr + off, mask=md, other=0.0), mask=md)
    # the rotated columns as loaded, pairs side by side (contiguous, vectorised), split into even and odd lanes
    j = tl.arange(0, 2 * BLOCK_H)
    mj = mr[:, None] & (j < 2 * HALF)[None, :]
    at = r[:, None] * D + nope + j[None, :]
    even, odd = tl.split(tl.reshape(tl.load(x_ptr + at, mask=mj, other=0.0).to(tl.float32), (BLOCK_R, BLOCK_H, 2)))
    p = tl.arange(0, BLOCK_H)
    mp = mr[:, None] & (p < HALF)[None, :]
    cs = c_row[:, None] * HALF + p[None, :]
    c = tl.load(cos_ptr + cs, mask=mp, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=mp, other=0.0).to(tl.float32) * sign
    y = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (BLOCK_R, 2 * BLOCK_H))
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mj)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``ReferenceOps.rms_norm`` (module docstring); rows of ``x`` may be strided (a column slice of a joined GEMM's
    output), the result is contiguous."""
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    x2 = x.reshape(rows, d) if x.stride(-1) == 1 else x.contiguous().view(rows, d)  # a view where the rows allow
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        w = weight.contiguous() if weight is not None else x2
        br = _rows_per_program(d, rows)
        _rms_norm_kernel[(triton.cdiv(rows, br),)](
            x2, w, out, rows, d, x2.stride(0), float(eps), HAS_W=weight is not None, BLOCK_R=br,
            BLOCK_D=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8, **pdl.launch(),
        )  # fmt: skip
    return out


def rope_group(x: torch.Tensor, cos: torch.Tensor) -> int | None:
    """Rows of ``x`` per row of ``cos`` when ``cos`` broadcasts as this kernel reads it (leading dims of ``x``, then
    size-1 dims), else None."""
    lead, clead = x.shape[:-1], cos.shape[:-1]
    if len(clead) != len(lead):
        return None
    k = 0
    while k < len(lead) and clead[k] == lead[k]:
        k += 1
    if any(s != 1 for s in clead[k:]):
        return None
    g = 1
    for s in lead[k:]:
        g *= s
    return g


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope`` takes these shapes (else the caller uses the reference)."""
    return (
        cos.shape == sin.shape
        and 2 * cos.shape[-1] <= x.shape[-1]
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and rope_group(x, cos) is not None
    )


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    """``ReferenceOps.rope`` (module docstring); the shapes must pass ``rope_supported``. ``inplace`` (the caller no
    longer needs ``x``): a contiguous ``x`` is rotated where it is, the other dims neither read nor written."""
    d, half = x.shape[-1], cos.shape[-1]
    g = rope_group(x, cos)
    xc = x.contiguous()
    inplace = inplace and xc is x
    out = xc if inplace else torch.empty_like(xc)
    rows = xc.numel() // d if d else 0
    if rows:
        br = _rows_per_program(d, rows)
        _rope_kernel[(triton.cdiv(rows, br),)](
            xc, cos.contiguous(), sin.contiguous(), out, rows, d, g, -1.0 if inverse else 1.0,
            HALF=half, BLOCK_R=br, BLOCK_H=triton.next_power_of_2(max(half, 1)),
            BLOCK_D=triton.next_power_of_2(max(d - 2 * half, 1)), INPLACE=inplace, num_warps=4, **pdl.launch(),
        )  # fmt: skip
    return out


__all__ = ["rms_norm", "rope", "rope_supported"]
