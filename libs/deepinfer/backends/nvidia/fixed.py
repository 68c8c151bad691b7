"""The nvidia op set's products in batch-invariant mode (``NvidiaOps(invariant=True)``: DEEPINFER_BATCH_INVARIANT=1).

The default op set runs its bf16 / fp32 linears, the head and the grouped products through cuBLAS (``F.linear``,
``torch.mm``, ``torch.bmm``), which picks kernel, tiles and split-K by the number of rows: a row rounds differently
alone and in a batch. In batch-invariant mode they run on the kernels whose plans ``kernels.pinning`` pins instead:

* half-precision operands: ``kernels.small_gemm.small_mm_fp32`` (fp32 accumulation and output, the weight on the
  MMA's wide side, a split-K summed in a fixed order, planned for ``PLAN_ROWS`` rows whatever the call has); from
  ``WIDE`` output columns (the head) ``kernels.invariant.matmul_fixed`` (64-row tiles, no split-K);
* fp32 operands (the tests' fp32 models): ``kernels.invariant.matmul_fixed`` (fixed tiles, IEEE fp32 products, no
  split-K);
* an fp32 input against a bf16 head (V4.1): the same products as ``bf16_parts.linear_by_parts`` (three exact bf16
  parts of the input, each against the weight on ``small_mm_fp32``, added in a fixed order).

Each equals the reference's product up to the order of its fp32 sums, and that order depends only on the shapes of
the weight. Importing this module imports no Triton.
"""

from __future__ import annotations

import torch

from deepinfer.backends.nvidia.bf16_parts import bf16_parts

_HALF = (torch.bfloat16, torch.float16)
# from this many output columns (the output head) a half-precision product takes matmul_fixed's 64-row tiles, which
# read the weight once for up to 64 rows, in place of small_mm_fp32's 16-row ones (4 reads of a 1 GB head at 64 rows)
WIDE = 16384


def fixed_mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., K] · w [N, K]ᵀ`` → ``[..., N]`` in ``out_dtype`` on a kernel of one plan for every row count."""
    from deepinfer.kernels.invariant import matmul_fixed
    from deepinfer.kernels.small_gemm import small_mm_fp32

    x2 = x.reshape(-1, x.shape[-1])
    wide = w.shape[0] >= WIDE and w.dtype == torch.bfloat16
    if x2.dtype == w.dtype and x2.dtype in _HALF and not wide:
        y = small_mm_fp32(x2, w)
    elif x2.dtype == w.dtype and wide:  # the head: one 64-row tile reads the weight once for a batch
        y = matmul_fixed(x2, w, torch.float32)
    else:
        y = matmul_fixed(x2.float(), w.float())  # fp32 (or mixed) operands: IEEE fp32 products
    return y.to(out_dtype).view(*x.shape[:-1], w.shape[0])


def fixed_logits(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The head's fp32 logits ``y · wᵀ``: an fp32 ``y`` against a bf16 ``w`` by its three exact bf16 parts (the
    products of ``bf16_parts.linear_by_parts``, added ``hi + mid`` then ``+ lo``), otherwise :func:`fixed_mm`."""
    if y.dtype == torch.float32 and w.dtype == torch.bfloat16:
        x = y.reshape(-1, y.shape[-1])
        parts = [fixed_mm(p, w, torch.float32) for p in bf16_parts(x)]
        return torch.add(parts[0], parts[1]).add_(parts[2]).view(*y.shape[:-1], -1)
    return fixed_mm(y, w, torch.float32)


def fixed_grouped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("ngk,grk->ngr", x, w)`` as one :func:`fixed_mm` a group, in ``x.dtype``."""
    return torch.stack([fixed_mm(x[:, g], w[g], x.dtype) for g in range(w.shape[0])], dim=1)


__all__ = ["fixed_grouped", "fixed_logits", "fixed_mm"]
