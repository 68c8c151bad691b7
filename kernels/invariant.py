"""Batch-invariant Triton kernels: a row's result is bit-identical whatever else is in the batch.

``deepinfer.ops`` uses these on CUDA when ``DEEPINFER_BATCH_INVARIANT=1``, in place of cuBLAS and torch's
reductions, whose algorithm (tile shape, split-K, reduction tree) is picked per call from the problem size, so
the same sequence can round differently in a batch of 1 and in a batch of 37.

The invariance holds by construction, not by tuning:

* ``matmul_fixed``: one fixed tile config per operand dtype (``MATMUL_PLAN``, ``MATMUL_PLAN_FP32``: block M / N / K,
  warps, stages), no autotuning and no split-K. Output element ``(m, n)`` is computed by the program owning its
  tile, which walks K from 0 upward in block-K steps, each step one ``tl.dot`` of a fixed shape accumulated into
  fp32. That order depends only on K and the tile constants, never on M nor on which row of the tile ``m`` falls
  in (every lane of a ``tl.dot`` reduces the same way), and rows past M are masked to zero without touching the
  others. The kernel is also compiled with ``do_not_specialize=["M"]``, so every M runs the same binary.
* ``rowsum``: one program per row (``INTERPRET_ROWS`` rows in Triton's interpreter, each with its own lanes), a
  ``ROWSUM_BLOCK``-lane fp32 accumulator that takes the row in chunks from 0
  upward, then one fixed-shape ``tl.sum`` over the lanes. The result depends only on the row's values. Appending
  zeros does not change it bit-for-bit either: the extra chunks add +0.0 to each lane, which is exact (a lane
  starts at +0.0 and never becomes -0.0, since an IEEE sum is -0.0 only when both terms are), and the final
  ``tl.sum`` sees the same lanes.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait

# matmul_fixed's one plan: block M, block N, block K, warps, stages. The block K sets the order of a row's sums, so the
# value defines its results (batch-invariant mode's name carries it); candidates: bench/kernels/pinned_plans.py's
# ``head`` family (V4's output head, 129280 x 4096 bf16 weights). On an H100 this plan took 350 µs at one row and 372
# at 64, cuBLAS 380 / 423, the earlier 64x64x32x4x3 464 / 568 (the weight over the copy bandwidth: 361)
MATMUL_PLAN = (64, 128, 128, 8, 3)
MATMUL_PLAN_FP32 = (64, 64, 32, 4, 3)  # fp32 operands (IEEE products): twice the bytes a tile, in 3 stages of SMEM
# Triton's interpreter runs a program at a time in Python (numpy vectorises a program, not a grid): wider tiles there
# (the order of a row's sums is set by BLOCK_K alone, which stays; the tests' fp32 heads have 129280 columns)
INTERPRET_BLOCK_N = 4096
INTERPRET_ROWS = 256  # rowsum's rows per program there (on a GPU one row a program: one lane accumulator set each)
ROWSUM_BLOCK = 128
ROWSUM_NUM_WARPS = 4

_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["L", "stride_row", "R"])
def _rowsum_kernel(x_ptr, y_ptr, L, stride_row, R, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = row < R
    base = x_ptr + row[:, None] * stride_row
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK_R, BLOCK), dtype=tl.float32)
    for start in range(0, L, BLOCK):
        idx = start + offs
        acc += tl.load(base + idx[None, :], mask=mr[:, None] & (idx < L)[None, :], other=0.0).to(tl.float32)
    tl.store(y_ptr + row, tl.sum(acc, axis=1), mask=mr)


def matmul_fixed(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` (the ``F.linear`` layout, no bias) with one fixed tile config, accumulated in fp32.

    ``x`` is ``[..., K]``, ``w`` is ``[N, K]``, both float32 or both bfloat16 on the same device; the result is
    ``[..., N]`` in ``out_dtype`` (default ``x.dtype``). fp32 inputs use IEEE fp32 products (no TF32). Row ``m`` of
    the result is bit-identical whatever the other rows of ``x`` are and however many there are.
    """
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"matmul_fixed: x and w must both be float32 or both bfloat16, got x {x.dtype} and w {w.dtype}"
        )
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"matmul_fixed: expected x [..., K] and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}"
        )
    if x.device != w.device:
        raise ValueError(f"matmul_fixed: x is on {x.device} but w is on {w.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"matmul_fixed: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    lead = x.shape[:-1]
    N, K = w.shape
    x2 = x.reshape(math.prod(lead), K).contiguous()
    w = w.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y.reshape(*lead, N)
    if K == 0:
        return y.zero_().reshape(*lead, N)
    block_m, block_n, block_k, warps, stages = MATMUL_PLAN_FP32 if x.dtype == torch.float32 else MATMUL_PLAN
    block_n = INTERPRET_BLOCK_N if os.environ.get("TRITON_INTERPRET") == "1" else block_n
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _matmul_kernel[grid](
        x2,
        w,
        y,
        M,
        N,
        K,
        x2.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch(),
    )
    return y.reshape(*lead, N)


def rowsum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim of a ``[..., L]`` float32 or bfloat16 tensor; the result is ``[...]`` fp32.

    The result for a row depends only on that row's values (not on the number of rows nor on the row's position),
    and appending zeros to the end of a row (padding L to any larger length) leaves it unchanged bit-for-bit.
    An empty row (L == 0) sums to 0.
    """
    if x.dtype not in _DTYPES:
        raise ValueError(f"rowsum: x must be float32 or bfloat16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("rowsum: x must have at least one dim")
    lead = x.shape[:-1]
    L = x.shape[-1]
    x2 = x.reshape(math.prod(lead), L).contiguous()
    rows = x2.shape[0]
    y = torch.zeros(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or L == 0:
        return y.reshape(lead)
    br = INTERPRET_ROWS if os.environ.get("TRITON_INTERPRET") == "1" else 1
    _rowsum_kernel[(triton.cdiv(rows, br),)](x2, y, L, x2.stride(0), rows, BLOCK=ROWSUM_BLOCK, BLOCK_R=br,
                                             num_warps=ROWSUM_NUM_WARPS, **pdl.launch())  # fmt: skip
    return y.reshape(lead)


__all__ = ["matmul_fixed", "rowsum"]
