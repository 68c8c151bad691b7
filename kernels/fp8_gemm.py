"""FP8 block-scaled dense GEMMs (Triton, tuned on an H200): ``y = x · Wᵀ``, e4m3 weight with UE8M0 block scales.

Semantics (what the tests compare against): ``fp8_linear(x, w, scale, act_quant)`` equals
``F.linear(xq, dequantize_fp8_blocks(w, scale, dtype=x.dtype))`` accumulated in fp32 and rounded to ``x.dtype`` once,
with ``xq = ReferenceOps.act_quant_sim(x, 128)`` when ``act_quant`` (per 1×128 block of K: a power-of-two scale
``s ≥ amax/448`` from ``amax`` clamped ≥ 1e-4, ``x/s`` clamped to ±448 and rounded to e4m3, nearest-even) else ``x``.
Dequantised weights, quantised activations and their products are exact, so only the order of the fp32 sums differs.

The path is picked from the shapes alone (``fp8_gemm_config.pick_config``; no host sync: CUDA-graph capturable,
deterministic):

* **W8A16** (weight-only, decode): e4m3 tiles converted in registers. Up to ``GEMV_MAX_M`` rows (``_gemv_kernel``:
  one row, or two below 16384 output columns): FMAs on CUDA cores with the weight scale folded into ``x``, each
  weight tile loaded once for every row; more rows (``_w8a16_kernel``): the tile is dequantised into the
  activation dtype and fed to ``tl.dot`` (fp32 accumulation), computed as ``yᵀ = W · xᵀ`` so the weight is the MMA's
  wide operand. ``act_quant`` quantises ``x`` inside the kernel (small M) or in a pre-pass kernel. Few output tiles
  use split-K: fp32 partials ``[S, M, N]`` summed in a fixed order, bit-reproducible eager and in graph replay alike,
  by the tile's last program in the same launch (``_split_finish``: ``small_gemm``'s tickets and counters; not yet
  run on a GPU) or, with ``SPLIT_TICKETS`` off or the counters not ready, by a second kernel. Many rows without
  ``act_quant`` (prefill): the weight is dequantised once by a kernel and multiplied by cuBLAS (2.2× the Triton W8A16
  GEMM at M = 1024 on an H200).
* **W8A8** (``_w8a8_kernel``, prefill with ``act_quant`` and a 128-wide weight K block): ``act_quant_fp8`` writes the
  e4m3 activation and its scales, then per 128-wide K block ``acc += dot(a8, w8) · (s_a ⊗ s_w)`` on FP8 tensor cores
  (fp32 promotion every block, as DeepSeek's ``fp8_gemm``), programs in grouped order for L2 reuse. From
  ``SWAP_W8A8_MIN_M`` rows up to ``W8A8_MIN_M`` (decode batches) ``_w8a8_swap_kernel`` computes ``yᵀ = W · aᵀ`` so
  that the weight's e4m3 bytes are the MMA's wide operand as loaded, split over K like W8A16 (H200, V4-Flash shapes:
  1.2-1.6x the W8A16 kernel at 16 and 64 rows). From
  ``SCALED_MM_MIN_M`` rows with 128×128 weight blocks the product goes to ``torch._scaled_mm`` instead
  (``fp8_scaled_mm``: cuBLAS / CUTLASS with the same block scales) where this torch build and GPU run it.

``fp8_grouped_linear`` (V4's ``wo_a``: ``G`` groups of weight rows, each meeting its own slice of the input, no
activation rounding) runs the gemv / W8A16 kernels with the group's input offset in the kernel (``GROUPED``), or from
``DEQUANT_MIN_M`` rows dequantises the weight once for ``torch.bmm``.

The activation quantisation is in ``fp8_quant``, the W8A8 kernels in ``fp8_w8a8``, the tile choice in
``fp8_gemm_config``.

Under ``TRITON_INTERPRET=1`` every kernel runs in Triton's interpreter (which loads e4m3 and multiplies it with
``tl.dot`` correctly, but rounds fp32→e4m3 casts wrongly: values are put on the e4m3 grid with exact fp32
arithmetic first, on every device); CPU tensors without the interpreter take a torch fallback (the reference's math).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer.kernels import fp8_gemm_config, pdl, small_gemm
from deepinfer.kernels.formats import dequantize_fp8_blocks
from deepinfer.kernels.fp8_gemm_config import (
    ACT_BLOCK,
    DEQUANT_MIN_M,
    GEMV_MAX_M,
    SCALED_MM_MIN_M,
    W8A8_MIN_M,
    GemmConfig,
    check_config,
    interpreted,
    pick_config,
    sm_count,
)
from deepinfer.kernels.fp8_quant import act_quant_fp8, act_quant_sim, act_quant_torch, quant_sim
from deepinfer.kernels.fp8_scaled_mm import block_scaled_mm
from deepinfer.kernels.fp8_w8a8 import splitk_sum_kernel, w8a8
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import is_pinned, row_slices

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPLIT_TICKETS = True  # gemv / W8A16 split-K summed in the GEMM's launch (False: by splitk_sum_kernel; benchmarks)


@triton.jit
def _dequant(w, s, dt: tl.constexpr):
    """``w · s`` in ``dt`` (exact for bf16 / fp32; fp16 rounds the fp32 product as dequantize_fp8_blocks does)."""
    if dt == tl.float16:
        return (w.to(tl.float32) * s).to(dt)
    return w.to(dt) * s.to(dt)


@triton.jit
def _split_finish(part_ptr, y_ptr, cnt_ptr, tile, offs, mask, MN, S):
    """Split-K in the GEMM's own launch (``small_gemm``'s tickets): once a program has stored its partial (at
    ``part_ptr + pid_k·MN + offs``), it takes a ticket for its output tile; the tile's last program sums the ``S``
    partials in the fixed order ``s = 0, 1, …`` (read past L1), stores ``y`` and sets the ticket back to 0."""
    tl.debug_barrier()  # every thread's partial is stored before the ticket's release
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == S - 1:
        total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, S):
            total += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_ws, k_chunk, stride_split, group_rows, y_ptr, cnt_ptr,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_X: tl.constexpr, ACT_QUANT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    GROUPED: tl.constexpr, TICKETS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GROUPED:  # as _gemv_kernel: the tile's weight rows are in one group, which reads its own K columns of x
        x_ptr += (pid_n * BLOCK_N // group_rows).to(tl.int64) * K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xrow = (rm % M).to(tl.int64) * stride_xm  # rows / columns past the end re-read valid ones (stores are masked)
    wrow = (rn % N).to(tl.int64) * K
    srow = (rn % N) // B0 * stride_ws
    stile = ws_ptr + pid_n * BLOCK_N // B0 * stride_ws  # SCALE_X: the tile's rows share one row block
    dt: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ tile: the weight is the MMA's wide operand
    k_lo = pid_k * k_chunk
    for k0 in range(k_lo, tl.minimum(k_lo + k_chunk, K), BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            xt = tl.load(x_ptr + xrow[None, :] + kk[:, None])
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :])
        else:
            xt = tl.load(x_ptr + xrow[None, :] + kk[:, None], mask=(kk < K)[:, None], other=0.0)
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        if ACT_QUANT:  # BLOCK_K == 128: each column of xt is one quantisation block
            q, s = quant_sim(xt.to(tl.float32), 0)
            xt = q * s[None, :]
        if SCALE_X:  # the weight scale on the activation: exact (powers of two)
            xt = (xt.to(tl.float32) * tl.load(stile + tl.minimum(kk, K - 1) // B1)[:, None]).to(dt)
            acc = tl.dot(w.to(dt), xt, acc, input_precision=PRECISION)
        elif BLOCK_K <= B1:  # one scale per row of the tile
            sw = tl.load(ws_ptr + srow + k0 // B1)
            acc = tl.dot(_dequant(w, sw[:, None], dt), xt.to(dt), acc, input_precision=PRECISION)
        else:  # BLOCK_K // B1 scale blocks along K, expanded to the columns
            kb = tl.minimum(k0 // B1 + tl.arange(0, BLOCK_K // B1), (K - 1) // B1)
            sw = tl.load(ws_ptr + srow[:, None] + kb[None, :])
            sw = tl.reshape(tl.broadcast_to(sw[:, :, None], (BLOCK_N, BLOCK_K // B1, B1)), (BLOCK_N, BLOCK_K))
            acc = tl.dot(_dequant(w, sw, dt), xt.to(dt), acc, input_precision=PRECISION)
    offs = rm[None, :].to(tl.int64) * N + rn[:, None]
    mask = (rm < M)[None, :] & (rn < N)[:, None]
    tl.store(out_ptr + pid_k * stride_split + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if TICKETS:
        tile = pid_m * tl.num_programs(1) + pid_n
        _split_finish(out_ptr, y_ptr, cnt_ptr, tile, offs, mask, stride_split, tl.num_programs(2))


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_ws, k_chunk, stride_split, group_rows, y_ptr, cnt_ptr,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT_QUANT: tl.constexpr, EVEN_K: tl.constexpr, GROUPED: tl.constexpr, TICKETS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Up to ``BLOCK_M`` rows: ``y[m, n] = Σ_k w[n, k] · (x[m, k] · s[n // B0, k // B1])`` with FMAs (BLOCK_N divides
    B0), each weight tile loaded once for every row. ``GROUPED``: weight rows ``[g·R, (g+1)·R)`` (``R =
    group_rows``, a multiple of BLOCK_N) read ``x[:, g·K:(g+1)·K]``."""
    pdl_wait(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if GROUPED:
        x_ptr += (pid_n * BLOCK_N // group_rows).to(tl.int64) * K
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xrow = (rm % M).to(tl.int64) * stride_xm  # rows past the end re-read valid ones (stores are masked)
    wrow = (rn % N).to(tl.int64) * K
    stile = ws_ptr + pid_n * BLOCK_N // B0 * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo = pid_k * k_chunk
    for k0 in range(k_lo, tl.minimum(k_lo + k_chunk, K), BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x = tl.load(x_ptr + xrow[:, None] + kk[None, :]).to(tl.float32)
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :])
        else:
            x = tl.load(x_ptr + xrow[:, None] + kk[None, :], mask=(kk < K)[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        if ACT_QUANT:
            q, s = quant_sim(tl.reshape(x, (BLOCK_M * BLOCK_K // 128, 128)), 1)
            x = tl.reshape(q * s[:, None], (BLOCK_M, BLOCK_K))
        xs = x * tl.load(stile + tl.minimum(kk, K - 1) // B1)[None, :]
        acc += w.to(tl.float32)[None, :, :] * xs[:, None, :]
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pid_k * stride_split + offs, tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty), mask=mask)
    if TICKETS:
        _split_finish(out_ptr, y_ptr, cnt_ptr, pid_n, offs, mask, stride_split, tl.num_programs(1))


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_s, B0: tl.constexpr, B1: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """``out = w · s`` for one ``[BLOCK_N, BLOCK_K]`` tile inside one scale block."""
    pdl_wait(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs = rn[:, None].to(tl.int64) * K + rk[None, :]
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    s = tl.load(s_ptr + pid_n * BLOCK_N // B0 * stride_s + pid_k * BLOCK_K // B1)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _dequant(w, s, out_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int]:
    if x.dtype not in _DTYPES:
        raise ValueError(f"fp8_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: w must be a 2-D float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not end in the weight's K = {k}")
    if scale.dim() != 2 or scale.dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"fp8_linear: scale must be a 2-D float32 tensor, got {scale.dtype} {tuple(scale.shape)}")
    if block is None and 0 not in scale.shape:  # as dequantize_fp8_blocks infers it
        block = (_pow2_at_least(-(-n // scale.shape[0])), _pow2_at_least(-(-k // scale.shape[1])))
    if block is None or tuple(scale.shape) != (-(-n // block[0]), -(-k // block[1])):
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} does not match weight {(n, k)} (block {block})")
    if x.device != w.device or scale.device != w.device:
        raise ValueError(f"fp8_linear: x, w and scale must share a device, got {x.device}, {w.device}, {scale.device}")
    return block


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    act_quant: bool = False,
    *,
    block: tuple[int, int] | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``F.linear(xq, dequantize_fp8_blocks(w, scale, x.dtype))`` → ``[..., N]`` in ``x.dtype`` (module docstring).

    ``block``: the weight's scale block (inferred from the shapes by default); ``config``: tiles and path to use."""
    block = _check(x, w, scale, block)
    n, k = w.shape
    if act_quant and k % ACT_BLOCK:
        raise ValueError(f"fp8_linear: act_quant needs K divisible by {ACT_BLOCK}, got {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m, dt = x2.shape[0], x.dtype
    if m == 0 or n == 0:
        return torch.zeros((*lead, n), dtype=dt, device=x.device)
    scale = scale.float().contiguous()
    if not x.is_cuda and not interpreted():  # plain CPU: the reference's math
        xq = x2.float()
        if act_quant:
            q, s = act_quant_torch(x2, ACT_BLOCK)
            xq = (q.float().unflatten(-1, (-1, ACT_BLOCK)) * s[..., None]).flatten(-2)
        return (xq @ dequantize_fp8_blocks(w, scale, torch.float32, block).t()).to(dt).view(*lead, n)
    if config is None and len(slices := row_slices(m)) > 1:  # pinned (kernels.pinning): each slice one pinned launch
        parts = [fp8_linear(x2[a:b], w, scale, act_quant, block=block) for a, b in slices]
        return torch.cat(parts).view(*lead, n)
    sms = sm_count(x.device.index or 0) if x.is_cuda else 4
    rows = fp8_gemm_config.pinned_rows(n, k) if is_pinned() else m  # (kernels.pinning)
    cfg = config or pick_config(rows, n, k, block, act_quant, sms, x2.element_size())
    check_config(cfg, m, block, act_quant, dt)
    w = w.contiguous()
    y = torch.empty((m, n), dtype=dt, device=x.device)
    if cfg.path == "w8a8":
        a, sa = act_quant_fp8(x2, ACT_BLOCK)
        if config is None and m >= SCALED_MM_MIN_M and block == (128, 128) and not interpreted() and not is_pinned():
            out = block_scaled_mm(a, sa, w, scale, dt)  # the vendor library's FP8 GEMM, where it runs
            if out is not None:
                return out.view(*lead, n)
        w8a8(a, sa, w, scale, y, cfg, block)
        return y.view(*lead, n)
    fuse = act_quant and cfg.fuse_quant and cfg.path != "dequant"
    if act_quant and not fuse:
        x2 = act_quant_sim(x2)
    if cfg.path == "dequant":
        return torch.nn.functional.linear(x2, _dequantized(w, scale, block, dt)).view(*lead, n)
    _weight_only(x2, w, scale, y, cfg, block, fuse)
    return y.view(*lead, n)


def _dequantized(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dt: torch.dtype) -> torch.Tensor:
    """``w · scale`` in ``dt`` by one kernel (CUDA or the interpreter)."""
    n, k = w.shape
    wd = torch.empty((n, k), dtype=dt, device=w.device)
    bn, bk = min(64, block[0]), min(128, block[1])
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w, scale, wd, n, k, scale.stride(0), B0=block[0], B1=block[1], BLOCK_N=bn, BLOCK_K=bk, **pdl.launch()
    )
    return wd


def _weight_only(
    x2: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    y: torch.Tensor,
    cfg: GemmConfig,
    block: tuple[int, int],
    fuse: bool,
    group_rows: int = 0,
) -> None:
    """The gemv / w8a16 paths into ``y [m, n]``: ``x2 [m, K]``, or with ``group_rows = R`` ``x2 [m, (n/R)·K]`` whose
    group ``g`` meets weight rows ``[g·R, (g+1)·R)`` (``R`` a multiple of ``cfg.block_n``)."""
    (n, k), m, dt = w.shape, x2.shape[0], x2.dtype
    steps = triton.cdiv(k, cfg.block_k)
    chunk = triton.cdiv(steps, max(1, cfg.split_k))
    split = triton.cdiv(steps, chunk)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n, cfg.block_n), split) if cfg.path == "gemv" else (
        triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)  # fmt: skip
    # split-K summed by each tile's last program (tickets) where the counters allow, else by splitk_sum_kernel
    tickets = split > 1 and SPLIT_TICKETS and math.prod(grid[:-1]) <= small_gemm.COUNTERS and small_gemm.ready(y.device)
    cnt = small_gemm.counters(y.device) if tickets else y
    common = dict(B0=block[0], B1=block[1], BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ACT_QUANT=fuse,
                  EVEN_K=k % cfg.block_k == 0, GROUPED=group_rows > 0, TICKETS=tickets, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip
    rows = max(group_rows, 1)
    if cfg.path == "gemv":
        _gemv_kernel[grid](
            x2, w, scale, out, m, n, k, x2.stride(0), scale.stride(0), chunk * cfg.block_k, m * n, rows, y, cnt,
            BLOCK_M=cfg.block_m, **common, **pdl.launch(),
        )  # fmt: skip
    else:
        _w8a16_kernel[grid](
            x2, w, scale, out, m, n, k, x2.stride(0), scale.stride(0), chunk * cfg.block_k, m * n, rows, y, cnt,
            BLOCK_M=cfg.block_m, SCALE_X=cfg.scale_x, PRECISION="ieee" if dt == torch.float32 else "tf32", **common,
            **pdl.launch(),
        )  # fmt: skip
    if split > 1 and not tickets:
        splitk_sum_kernel[(triton.cdiv(m * n, 1024),)](out, y, split, m * n, BLOCK=1024, **pdl.launch())


def fp8_grouped_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, config: GemmConfig | None = None
) -> torch.Tensor:
    """Per-group products with an FP8 weight kept as stored (V4's ``wo_a``): ``x [T, G, K]``, ``w [G·R, K]`` e4m3
    with its block ``scale`` → ``[T, G, R]`` in ``x.dtype``, ``einsum("tgk,grk->tgr", x, W)`` for ``W`` the
    dequantised weight viewed ``[G, R, K]`` (exact products, fp32 sums; no activation rounding). Few rows run the
    gemv / w8a16 kernels with each weight-row group reading its own slice of ``x``; many rows (or groups that do
    not split into the kernel's tiles) dequantise the weight once and use ``torch.bmm``."""
    if x.dim() != 3:
        raise ValueError(f"fp8_grouped_linear: x must be [T, G, K], got {tuple(x.shape)}")
    t, g, k = x.shape
    block = _check(x, w, scale, None)
    n = w.shape[0]
    if g == 0 or n % g:
        raise ValueError(f"fp8_grouped_linear: {n} weight rows do not split into {g} groups")
    r = n // g
    if t == 0 or n == 0:
        return torch.zeros((t, g, r), dtype=x.dtype, device=x.device)
    if config is None and len(slices := row_slices(t)) > 1:  # pinned (kernels.pinning): each slice one pinned launch
        return torch.cat([fp8_grouped_linear(x[a:b], w, scale) for a, b in slices])
    scale = scale.float().contiguous()
    cfg = None
    if x.is_cuda or interpreted():
        sms = sm_count(x.device.index or 0) if x.is_cuda else 4
        rows = fp8_gemm_config.pinned_rows(n, k) if is_pinned() else t  # (kernels.pinning)
        cfg = config or pick_config(rows, n, k, block, False, sms, x.element_size())
        check_config(cfg, t, block, False, x.dtype)
    if cfg is not None and is_pinned() and (cfg.path not in ("gemv", "w8a16") or r % cfg.block_n):
        # the groups' products on the fixed-tile GEMM (torch.bmm picks its kernels by the row count)
        from deepinfer.kernels.invariant import matmul_fixed

        wd = _dequantized(w.contiguous(), scale, block, x.dtype).view(g, r, k)
        return torch.stack([matmul_fixed(x[:, i], wd[i]) for i in range(g)], dim=1)
    if cfg is None or cfg.path not in ("gemv", "w8a16") or r % cfg.block_n:
        if cfg is None:
            wd = dequantize_fp8_blocks(w, scale, x.dtype, block)
        else:
            wd = _dequantized(w.contiguous(), scale, block, x.dtype)
        y = torch.empty((t, g, r), dtype=x.dtype, device=x.device)
        # written in place as [T, G, R] (cuBLAS's strided batches: row stride G·R, batch stride R), so the caller's
        # flatten to [T, G·R] is a view, not a copy of the whole product (H200, 4096 tokens of V4-Flash: 84 µs)
        torch.bmm(x.transpose(0, 1), wd.view(g, r, k).transpose(1, 2), out=y.transpose(0, 1))
        return y
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    _weight_only(x.reshape(t, g * k).contiguous(), w.contiguous(), scale, y, cfg, block, False, group_rows=r)
    return y.view(t, g, r)


__all__ = [
    "ACT_BLOCK",
    "DEQUANT_MIN_M",
    "GEMV_MAX_M",
    "SCALED_MM_MIN_M",
    "W8A8_MIN_M",
    "GemmConfig",
    "act_quant_fp8",
    "fp8_grouped_linear",
    "fp8_linear",
    "pick_config",
]
