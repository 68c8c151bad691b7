"""W8A8 FP8 block-scaled GEMMs (``fp8_gemm``'s ``act_quant`` path): e4m3 activations with power-of-two scales per
1×128 block (``fp8_quant.act_quant_fp8``) times an e4m3 weight with its block scales, per 128-wide K block
``acc += dot(a8, w8) · (s_a ⊗ s_w)`` on the FP8 tensor cores (fp32 promotion once a block, as DeepSeek's ``fp8_gemm``).

* ``_w8a8_kernel`` (many rows): tokens on the MMA's M side, programs in grouped order for L2 reuse;
* ``_w8a8_swap_kernel`` (``GemmConfig.swap_ab``, decode batches): ``yᵀ = W · aᵀ``, the weight's e4m3 bytes the MMA's
  wide operand as loaded, split over K into fp32 partials that ``splitk_sum_kernel`` sums in a fixed order (also
  the W8A16 kernels' split-K sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm_config import ACT_BLOCK, GemmConfig
from deepinfer.kernels.pdl import pdl_wait


@triton.jit
def splitk_sum_kernel(p_ptr, y_ptr, S, MN, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):  # a fixed order: bit-reproducible
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_ws,
    B0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % gsize
    pid_n = (pid % (GROUP_M * num_n)) // gsize
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nkb = K // BLOCK_K  # BLOCK_K == 128 == both scale blocks along K, K % 128 == 0
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * K + rk[:, None]
    as_ptrs = as_ptr + (rm % M).to(tl.int64) * nkb
    ws_ptrs = ws_ptr + (rn % N) // B0 * stride_ws
    ws_tile = ws_ptr + pid_n * BLOCK_N // B0 * stride_ws  # the tile's rows in one row block (BLOCK_N divides B0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, nkb):
        a = tl.load(a_ptrs + kb * BLOCK_K)
        b = tl.load(w_ptrs + kb * BLOCK_K)
        sa = tl.load(as_ptrs + kb)
        if B0 % BLOCK_N == 0:
            acc += tl.dot(a, b) * (sa * tl.load(ws_tile + kb))[:, None]
        else:
            acc += tl.dot(a, b) * (sa[:, None] * tl.load(ws_ptrs + kb)[None, :])
    y = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a8_swap_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_ws, kb_chunk, stride_split,
    B0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``_w8a8_kernel`` for few rows: the tile is ``yᵀ [BLOCK_N, BLOCK_M]``, the weight the FP8 MMA's wide operand
    (its e4m3 bytes straight from memory) and the tokens its narrow one; split over K in chunks of ``kb_chunk``
    128-wide blocks, the fp32 partials summed by ``splitk_sum_kernel``."""
    pdl_wait(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nkb = K // BLOCK_K  # BLOCK_K == 128 == both scale blocks along K, K % 128 == 0
    at_ptrs = a_ptr + (rm % M).to(tl.int64)[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_M]: K-major
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[:, None] * K + rk[None, :]
    as_ptrs = as_ptr + (rm % M).to(tl.int64) * nkb
    ws_rows = ws_ptr + (rn % N) // B0 * stride_ws
    ws_tile = ws_ptr + pid_n * BLOCK_N // B0 * stride_ws  # the tile's rows in one row block (BLOCK_N divides B0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    kb_lo = pid_k * kb_chunk
    for kb in range(kb_lo, tl.minimum(kb_lo + kb_chunk, nkb)):
        w = tl.load(w_ptrs + kb * BLOCK_K)
        at = tl.load(at_ptrs + kb * BLOCK_K)
        sa = tl.load(as_ptrs + kb)
        if B0 % BLOCK_N == 0:
            acc += tl.dot(w, at) * (sa * tl.load(ws_tile + kb))[None, :]
        else:
            acc += tl.dot(w, at) * (sa[None, :] * tl.load(ws_rows + kb)[:, None])
    o = out_ptr + pid_k * stride_split + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[None, :] & (rn < N)[:, None])


def w8a8(
    a: torch.Tensor,
    sa: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    y: torch.Tensor,
    cfg: GemmConfig,
    block: tuple[int, int],
) -> None:
    """``y [m, n] = (a · sa) · (w · scale)ᵀ``: ``a [m, K]`` e4m3 and ``sa [m, K/128]`` fp32 (``act_quant_fp8``), ``w``
    ``[n, K]`` e4m3 with its float32 block ``scale`` (``block[1] == 128``), on ``cfg``'s tiles."""
    (m, k), n = a.shape, w.shape[0]
    if cfg.swap_ab:
        nkb = k // ACT_BLOCK
        chunk = triton.cdiv(nkb, max(1, cfg.split_k))
        split = triton.cdiv(nkb, chunk)
        out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _w8a8_swap_kernel[grid](
            a, sa, w, scale, out, m, n, k, scale.stride(0), chunk, m * n,
            B0=block[0], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(),
        )  # fmt: skip
        if split > 1:
            splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](out, y, split, m * n, BLOCK=1024, **pdl.launch())
        return
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w8a8_kernel[grid](
        a, sa, w, scale, y, m, n, k, scale.stride(0),
        B0=block[0], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(),
    )  # fmt: skip


__all__ = ["w8a8"]
