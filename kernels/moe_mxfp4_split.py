"""Split-K for the MXFP4 MoE kernels (``kernels.moe_mxfp4``) at decode sizes.

At one token the unsplit kernels run (slot blocks × N tiles) programs, 6 × 32 for gate/up and 6 × 64 for down at
V4-Flash's shapes (top-6, I = 2048, D = 4096, 64-row tiles): 1.5-3 programs of 2 warps an SM of an H200, too few warps
to issue the decode's instructions and keep HBM busy. Here each GEMM is also split over K into ``SPLIT`` contiguous
pieces, one program per (block, N tile, piece):

* ``_mx_gate_up_split_kernel`` (grid ``(blocks, N tiles, SPLIT)``): program ``s`` accumulates gate and up in fp32
  over the ``BLOCK_K`` steps ``s·C ..< min((s + 1)·C, steps)`` of K = D (``C = cdiv(steps, SPLIT)``, so only the last
  piece may be shorter, and none is empty) and stores the partials ``p[0, s, slot, n]`` (gate), ``p[1, s, slot, n]``
  (up), fp32;
* ``_gate_up_finish_kernel`` (one program per slot and ``FINISH_BLOCK`` columns): gate and up are the sums of their
  partials in the fixed order ``s = 0, 1, ...``, then exactly the unsplit epilogue: gate and up rounded to
  ``x.dtype``, ``h = w · silu(min(gate, limit)) · clamp(up, ±limit)`` in fp32 (``w`` the slot's routing weight),
  rounded to ``x.dtype``;
* ``_mx_down_split_kernel``: the same over K = I for the down projection, partials ``q[s, slot, n]`` fp32;
* ``_down_finish_kernel`` (one program per token and ``FINISH_BLOCK`` columns): each slot's down projection is the sum
  of its partials in order ``s = 0, 1, ...`` rounded to ``x.dtype`` (as the unsplit kernel stores it), and
  ``y[t] = Σ_j o[t·k + j]`` in fp32, ``j = 0 .. k-1`` in order (``moe.py``'s ``combine`` folded in) → ``[T, D]``.

So a split call differs from the unsplit one only in the order of the fp32 accumulation over K, and is deterministic
(a fixed order, no atomics). Each piece starts on a ``BLOCK_K`` boundary: its tiles are tiles of the unsplit loop,
decoded by the same code (``moe_mxfp4_gemm.gemm``) with the same masks, the same PTX and the same TMA descriptors.

``pick_split`` chooses ``SPLIT`` on the host from the slot count ``T·k``, the number of experts, the GEMM's shape and
the tile config (no device value: a call stays capturable in a CUDA graph); ``split_steps`` turns a requested split
into the pieces' length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.moe import MoEConfig, silu_mul
from deepinfer.kernels.moe_mxfp4_gemm import gemm
from deepinfer.kernels.pdl import pdl_wait

# The auto rule (``pick_split``): aim for PROGRAMS_PER_SM programs on each of SMS SMs (an H200: 132 SMs; a decode
# tile's 3 stages of 16×128 activations and 2 × 64×128 codes take 36 KB of shared memory, so about 6 gate/up programs
# are resident on an SM at once), every piece at least MIN_STEPS BLOCK_K steps long, at most MAX_SPLIT pieces.
SMS = 132
PROGRAMS_PER_SM = 6
MIN_STEPS = 4
MAX_SPLIT = 16
FINISH_BLOCK = 256  # columns of a finishing program
FINISH_WARPS = 2


def split_steps(k: int, block_k: int, split: int) -> tuple[int, int]:
    """``(pieces, C)``: the K = ``k`` columns in ``cdiv(k, block_k)`` steps of ``block_k`` cut into at most ``split``
    pieces of ``C = cdiv(steps, split)`` steps each (the last one shorter when ``C`` does not divide the steps; no
    piece empty, so ``pieces = cdiv(steps, C)``)."""
    steps = triton.cdiv(k, block_k)
    chunk = triton.cdiv(steps, max(1, min(split, steps)))
    return triton.cdiv(steps, chunk), chunk


def pick_split(slots: int, experts: int, n: int, k: int, cfg: MoEConfig, sms: int = SMS) -> int:
    """The auto split-K of a GEMM with ``n`` output columns and K = ``k`` over ``slots = T·k`` slots of ``experts``
    experts: ``round(PROGRAMS_PER_SM · sms / programs)`` pieces, where ``programs`` = the expected slot blocks (the
    distinct experts of a uniform top-k routing, at least ``slots / block_m``) × the N tiles, capped at ``MAX_SPLIT``
    and so that a piece keeps ``MIN_STEPS`` steps of ``block_k``; 1 when the grid is large enough or K too short.
    Host arithmetic on sizes alone; returns the number of pieces ``split_steps`` makes of it."""
    steps = triton.cdiv(k, cfg.block_k)
    most = min(steps // MIN_STEPS, MAX_SPLIT)
    if most < 2 or slots <= 0 or experts <= 0:
        return 1
    distinct = experts * (1.0 - (1.0 - 1.0 / experts) ** slots)
    programs = max(distinct, slots / cfg.block_m) * triton.cdiv(n, cfg.block_n)
    want = int(PROGRAMS_PER_SM * sms / programs + 0.5)
    return split_steps(k, cfg.block_k, max(1, min(want, most)))[0]


def scale_align(s: torch.Tensor) -> int:
    """The largest power of two (at most 16) dividing the row stride of the scales ``s [E, N, K/32]``. The kernels
    take the stride divided by it and multiply it back, so Triton knows the alignment of a row's 4 exponent bytes
    per 128 columns and reads them in one 32-bit load. Triton itself only proves divisibility by 16, which V4.1's
    72-byte rows (K = 2304) lack: with byte loads its down projection kept the memory pipes 90% busy at 24% of DRAM
    bandwidth (ncu, T = 64), and a whole MoE call at V4.1's widths took 2433 µs at T = 64 and 96 µs at T = 1, against
    1679 and 67 µs with this (H200, bench/results/engine/2026-11-30-pdl-moe-tiles.md)."""
    stride = s.stride(1)
    return min(16, stride & -stride) if stride > 0 else 1


@triton.jit(do_not_specialize=["TK", "E"])
def _mx_gate_up_split_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, slots_ptr, bexp_ptr, p_ptr, TK, E, N, KH, KS,
                             stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_pu, stride_ps, stride_pm,
                             TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, FAST: tl.constexpr, ORDER: tl.constexpr, TMA: tl.constexpr,
                             SWAP: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr, SALIGN: tl.constexpr,
                             PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    stride_sn = stride_sn * SALIGN  # passed divided by SALIGN (scale_align)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        tok = (slot // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        k_lo = pid_s * KS * (BLOCK_K // 2)  # bytes of a packed row (a multiple of the step, seen by the compiler)
        k_hi = tl.minimum(k_lo + KS * (BLOCK_K // 2), KH)
        acc_g, acc_u = gemm(x_ptr, tok, stride_xm, valid, w1_ptr, s1_ptr, w3_ptr, s3_ptr, wbase,
                            e.to(tl.int64) * stride_se, rn, mask_n, k_lo, k_hi, KH, stride_wn, stride_sn, DT, BLOCK_M,
                            BLOCK_N, BLOCK_K, EVEN_K, FAST, ORDER, TMA, SWAP, PRECISION, True)  # fmt: skip
        off = pid_s.to(tl.int64) * stride_ps + slot.to(tl.int64)[:, None] * stride_pm + rn[None, :]
        mask = valid[:, None] & mask_n[None, :]
        tl.store(p_ptr + off, acc_g, mask=mask)
        tl.store(p_ptr + stride_pu + off, acc_u, mask=mask)


@triton.jit(do_not_specialize=["TK", "E"])
def _mx_down_split_kernel(h_ptr, w2_ptr, s2_ptr, slots_ptr, bexp_ptr, q_ptr, TK, E, N, KH, KS, stride_hm, stride_we,
                          stride_wn, stride_se, stride_sn, stride_qs, stride_qm, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr,
                          ORDER: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr,
                          DT: tl.constexpr, SALIGN: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    stride_sn = stride_sn * SALIGN  # passed divided by SALIGN (scale_align)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        row = slot.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        k_lo = pid_s * KS * (BLOCK_K // 2)
        k_hi = tl.minimum(k_lo + KS * (BLOCK_K // 2), KH)
        acc, _ = gemm(h_ptr, row, stride_hm, valid, w2_ptr, s2_ptr, w2_ptr, s2_ptr, wbase, e.to(tl.int64) * stride_se,
                      rn, mask_n, k_lo, k_hi, KH, stride_wn, stride_sn, DT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FAST,
                      ORDER, TMA, SWAP, PRECISION, False)  # fmt: skip
        off = pid_s.to(tl.int64) * stride_qs + row[:, None] * stride_qm + rn[None, :]
        tl.store(q_ptr + off, acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _gate_up_finish_kernel(p_ptr, rw_ptr, h_ptr, N, stride_pu, stride_ps, stride_pm, stride_hm, limit,
                           SPLIT: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                           PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    slot = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    base = p_ptr + slot * stride_pm + cols
    g = tl.load(base, mask=mask, other=0.0)
    u = tl.load(base + stride_pu, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):  # the pieces in order
        g += tl.load(base + s * stride_ps, mask=mask, other=0.0)
        u += tl.load(base + stride_pu + s * stride_ps, mask=mask, other=0.0)
    g = g.to(DT).to(tl.float32)  # gate/up rounded to x.dtype, as the unsplit epilogue
    u = u.to(DT).to(tl.float32)
    h = silu_mul(g, u, limit) * tl.load(rw_ptr + slot)
    tl.store(h_ptr + slot * stride_hm + cols, h.to(DT), mask=mask)


@triton.jit
def _down_finish_kernel(q_ptr, y_ptr, N, stride_qs, stride_qm, stride_ym, TOPK: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # the token's slots in order
        base = q_ptr + (tok * TOPK + j) * stride_qm + cols
        o = tl.load(base, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            o += tl.load(base + s * stride_qs, mask=mask, other=0.0)
        y += o.to(DT).to(tl.float32)  # the slot's down projection in x.dtype, as the unsplit kernel stores it
    tl.store(y_ptr + tok * stride_ym + cols, y, mask=mask)


def gate_up_split(x: torch.Tensor, w1: object, s1: torch.Tensor, w3: object, s3: torch.Tensor, rw: torch.Tensor,
                  slots: torch.Tensor, bexp: torch.Tensor, h: torch.Tensor, topk: int, limit: float, split: int,
                  piece: int, stride_we: int, stride_wn: int, meta: dict, launch: dict) -> None:  # fmt: skip
    """Gate/up with the weighted SwiGLU into ``h [T·k, I]`` in ``split`` pieces of ``piece`` steps of ``BLOCK_K``
    (``split_steps``): the split kernel, then the finishing kernel. ``w1``/``w3``: the words
    (``stride_we``, ``stride_wn`` their strides) or their TMA descriptors; ``meta``/``launch``: the unsplit kernel's
    constexprs and launch options."""
    tk, n = h.shape
    kh = x.shape[1] // 2
    p = torch.empty((2, split, tk, n), dtype=torch.float32, device=x.device)
    _mx_gate_up_split_kernel[(bexp.numel(), triton.cdiv(n, meta["BLOCK_N"]), split)](
        x, w1, s1, w3, s3, slots, bexp, p, tk, s1.shape[0], n, kh, piece,
        x.stride(0), stride_we, stride_wn, s1.stride(0), s1.stride(1) // scale_align(s1), p.stride(0), p.stride(1),
        p.stride(2), TOPK=topk, EVEN_K=x.shape[1] % meta["BLOCK_K"] == 0, SALIGN=scale_align(s1), **meta, **launch,
        **pdl.launch(),
    )  # fmt: skip
    _gate_up_finish_kernel[(tk, triton.cdiv(n, FINISH_BLOCK))](
        p, rw, h, n, p.stride(0), p.stride(1), p.stride(2), h.stride(0), limit,
        SPLIT=split, BLOCK=FINISH_BLOCK, DT=meta["DT"], num_warps=FINISH_WARPS, **pdl.launch(),
    )  # fmt: skip


def down_split(h: torch.Tensor, w2: object, s2: torch.Tensor, slots: torch.Tensor, bexp: torch.Tensor, t: int,
               topk: int, split: int, piece: int, stride_we: int, stride_wn: int, meta: dict,
               launch: dict) -> torch.Tensor:  # fmt: skip
    """The down projection of ``h [T·k, I]`` in ``split`` pieces of ``piece`` steps of ``BLOCK_K``, each slot's
    result rounded to ``h.dtype`` and the ``k`` slots of a token summed in fp32 → ``[T, D]`` fp32."""
    tk, inter = h.shape
    d = s2.shape[1]
    q = torch.empty((split, tk, d), dtype=torch.float32, device=h.device)
    _mx_down_split_kernel[(bexp.numel(), triton.cdiv(d, meta["BLOCK_N"]), split)](
        h, w2, s2, slots, bexp, q, tk, s2.shape[0], d, inter // 2, piece,
        h.stride(0), stride_we, stride_wn, s2.stride(0), s2.stride(1) // scale_align(s2), q.stride(0), q.stride(1),
        EVEN_K=inter % meta["BLOCK_K"] == 0, SALIGN=scale_align(s2), **meta, **launch, **pdl.launch(),
    )  # fmt: skip
    y = torch.empty((t, d), dtype=torch.float32, device=h.device)
    _down_finish_kernel[(t, triton.cdiv(d, FINISH_BLOCK))](
        q, y, d, q.stride(0), q.stride(1), y.stride(0),
        TOPK=topk, SPLIT=split, BLOCK=FINISH_BLOCK, DT=meta["DT"], num_warps=FINISH_WARPS, **pdl.launch(),
    )  # fmt: skip
    return y


__all__ = ["MAX_SPLIT", "MIN_STEPS", "PROGRAMS_PER_SM", "SMS", "down_split", "gate_up_split", "pick_split",
           "scale_align", "split_steps"]  # fmt: skip
