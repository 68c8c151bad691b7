"""The mHC mixes GEMM: ``mixes [T, M] = flatten(h) · fnᵀ`` in fp32, read straight from ``h`` in its own dtype.

``mixes_gemm(h, fn)`` computes ``h.view(T, K).float() @ fn.float().T`` (``K = N · D``) without the fp32 copy of the
streams the reference makes: ``h [T, N, D]`` (or ``[T, K]``) in bf16 / fp16 / fp32 and ``fn [M, K]`` (fp32 parameters:
``M = (2 + N) · N`` for a layer, ``M = N`` for the head) are loaded in their own dtype and cast to fp32 in registers,
and every product is taken and accumulated in fp32 (``tl.dot`` with ``input_precision="ieee"``: fp32 FMAs on a GPU,
never TF32), so the result is the reference's fp32 GEMM up to the order of the fp32 sums.

* ``_mixes_partial_kernel``, grid ``(cdiv(T, BLOCK_T), S)``: program ``(b, s)`` takes tokens ``[b · BLOCK_T,
  (b + 1) · BLOCK_T)`` and the K range ``[s · CHUNK, (s + 1) · CHUNK) ∩ [0, K)`` (``CHUNK`` a multiple of
  ``BLOCK_K``), walks it from its low end upward in ``BLOCK_K`` steps, one ``[BLOCK_T, BLOCK_K] × [BLOCK_K, MP]``
  dot per step into an fp32 ``[BLOCK_T, MP]`` accumulator (``MP = next_power_of_2(M)``; padded rows and columns,
  tokens past ``T`` and the tail of the last K block are masked to exact zeros), so ``fn`` is read (from L2) once
  per block of ``BLOCK_T`` tokens. With ``S == 1`` it stores ``mixes`` itself; otherwise its partial sum goes to
  fp32 scratch ``[S, T, M]``.
* ``_mixes_sum_kernel`` (split-K only), grid ``cdiv(T · M, SUM_BLOCK)``: ``mixes = Σ_s partial_s`` lane-wise, ``s``
  from 0 upward: a fixed order, so the result is deterministic.

The split ``S`` is chosen on the host from ``T`` and ``K`` alone (``split_for``): enough programs to fill the GPU when
there are few tokens (decode), none when there are many. No device value is read on the host, so a call can be
captured in a CUDA graph. A token's mixes depend on ``S`` only through the summation order (fp32 rounding).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import plan_rows

BLOCK_T_MAX = 64  # tokens per program (``fn`` is re-read from L2 once per block of tokens)
BLOCK_T_MIN = 16
BLOCK_K = 64  # K elements per step of a program's K loop
NUM_WARPS = 4
NUM_STAGES = 3
TARGET_PROGRAMS = 256  # split K until the first pass has about this many programs …
MIN_CHUNK = 128  # … but keep at least this many K elements per split (a multiple of BLOCK_K)
SUM_BLOCK = 1024  # elements per program of the split-K sum
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["T", "CHUNK"])
def _mixes_partial_kernel(
    h_ptr,
    fn_ptr,
    out_ptr,
    T,
    K,
    CHUNK,
    M: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    mt = t < T
    j = tl.arange(0, MP)
    mj = j < M
    offs = tl.arange(0, BLOCK_K)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, K)
    acc = tl.zeros((BLOCK_T, MP), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + offs
        mk = k < K  # chunks are BLOCK_K-aligned: only the last block of K is partial
        hv = tl.load(h_ptr + t[:, None] * K + k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        fv = tl.load(fn_ptr + j[None, :] * K + k[:, None], mask=mk[:, None] & mj[None, :], other=0.0)
        acc = tl.dot(hv.to(tl.float32), fv.to(tl.float32), acc, input_precision="ieee")
    dst = out_ptr + split.to(tl.int64) * T * M + t[:, None] * M + j[None, :]
    tl.store(dst, acc, mask=mt[:, None] & mj[None, :])


@triton.jit(do_not_specialize=["TM", "S"])
def _mixes_sum_kernel(part_ptr, out_ptr, TM, S, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < TM
    p = part_ptr + i
    acc = tl.load(p, mask=m, other=0.0)
    for _ in range(1, S):  # s = 1, 2, …, S - 1 in order
        p += TM
        acc += tl.load(p, mask=m, other=0.0)
    tl.store(out_ptr + i, acc, mask=m)


def block_t_for(t: int) -> int:
    """Tokens per program for ``t`` tokens: ``next_power_of_2(t)`` within ``[BLOCK_T_MIN, BLOCK_T_MAX]``."""
    return max(BLOCK_T_MIN, min(BLOCK_T_MAX, triton.next_power_of_2(max(t, 1))))


def split_for(t: int, k: int) -> int:
    """The number of K splits for ``t`` tokens and ``K = k``, from the shapes alone: 1 when the token blocks already
    give ``TARGET_PROGRAMS`` programs, else up to ``TARGET_PROGRAMS // blocks`` splits of at least ``MIN_CHUNK``."""
    blocks = triton.cdiv(max(t, 1), block_t_for(t))
    return max(1, min(TARGET_PROGRAMS // blocks, k // MIN_CHUNK))


def mixes_gemm(h: torch.Tensor, fn: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """``h.view(T, K).float() @ fn.float().T`` → ``[T, M]`` fp32 (module docstring): ``h [T, N, D]`` or ``[T, K]``
    (bf16 / fp16 / fp32), ``fn [M, K]`` (any of those, normally fp32). ``split`` overrides ``split_for(T, K)`` (it is
    reduced so that no split is empty); results differ between splits only by fp32 summation order."""
    t, k = h.shape[0], math.prod(h.shape[1:])
    h2 = h.contiguous().view(t, k)
    m = fn.shape[0]
    if fn.dim() != 2 or fn.shape[1] != k:
        raise ValueError(f"fn {tuple(fn.shape)} does not match streams {tuple(h.shape)}")
    if h2.dtype not in _FLOATS or fn.dtype not in _FLOATS:
        raise TypeError(f"mixes_gemm takes {_FLOATS}, got {h2.dtype} and {fn.dtype}")
    fn = fn.contiguous()
    out = torch.empty((t, m), dtype=torch.float32, device=h.device)
    if t == 0 or m == 0:
        return out
    if k == 0:
        return out.zero_()
    bt = block_t_for(plan_rows(t))  # (kernels.pinning: a pinned call plans for PLAN_ROWS tokens)
    s = split_for(plan_rows(t), k) if split is None else max(1, int(split))
    chunk = triton.cdiv(triton.cdiv(k, s), BLOCK_K) * BLOCK_K
    s = triton.cdiv(k, chunk)  # no empty split
    dst = out if s == 1 else torch.empty((s, t, m), dtype=torch.float32, device=h.device)
    _mixes_partial_kernel[(triton.cdiv(t, bt), s)](
        h2, fn, dst, t, k, chunk,
        M=m, MP=triton.next_power_of_2(m), BLOCK_T=bt, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **pdl.launch(),
    )  # fmt: skip
    if s > 1:
        _mixes_sum_kernel[(triton.cdiv(t * m, SUM_BLOCK),)](
            dst, out, t * m, s, BLOCK=SUM_BLOCK, num_warps=4, **pdl.launch()
        )
    return out


__all__ = ["block_t_for", "mixes_gemm", "split_for"]
