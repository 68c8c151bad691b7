"""The tiles and path of an FP8 block-scaled GEMM (``fp8_gemm.fp8_linear``), picked from the shapes alone: the same
choice inside and outside a CUDA graph, no device value read. Measured on an H200 at DeepSeek-V4-Flash's dense shapes
(``bench/kernels/gemm_fp8.py --tune``)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton

from deepinfer.kernels.pinning import PLAN_ROWS
from deepinfer.kernels.shared_memory import fit_stages

ACT_BLOCK = 128
W8A8_MIN_M = 256  # from this many rows (act_quant, 128-wide K blocks): FP8 tensor cores (H200: 1.4x W8A16 at 256)
SCALED_MM_MIN_M = 1024  # from this many rows on the W8A8 path: torch._scaled_mm (H200: 1.3-1.6x the Triton W8A8)
SWAP_W8A8_MIN_M = 16  # from this many rows up to W8A8_MIN_M (act_quant, 128-wide K blocks): w8a8 with swap_ab
DEQUANT_MIN_M = 512  # from this many rows (no act_quant): dequantise once + cuBLAS (H200: 2.2x W8A16 at 1024)
# up to this many rows below 16384 output columns: the gemv, each weight tile read once for every row (H100, V4-Flash
# shapes: 2 rows 0.70-0.95x the W8A16 tiles' time; 3-4 rows 0.92-2.2x, the FMAs on CUDA cores outgrow the bytes)
GEMV_MAX_M = 2
# up to this many rows the gemv does not take (a batch-1 verify step, a few decode rows; wq_b's from 2), at
# V4-Flash's dense shapes (N, K): the W8A16 tiles' (block_n, split_k) measured best or within 7% of it at 4, 6 and 8
# rows on an H100 (bf16 activations; 0.76-1.0x the rule's time, wo_b 0.76x;
# bench/results/kernels/2026-12-06-gemm-fp8-m4-h100.md); other shapes and more rows take the rule below
SMALL_M_MAX = 8
SMALL_M_TILES = {
    (4096, 8192): (128, 8),  # wo_b
    (2048, 4096): (64, 16),  # shared experts' w1/w3
    (4096, 2048): (64, 8),  # shared experts' w2
    (1024, 4096): (64, 8),  # wq_a
    (512, 4096): (64, 16),  # wkv
    (8192, 1024): (128, 4),  # the indexer's wq_b
    (32768, 1024): (64, 2),  # wq_b
}
_PATHS = ("gemv", "w8a16", "w8a8", "dequant")
# pinned calls (kernels.pinning, batch-invariant mode) plan their tiles as for this many rows whatever they have (more
# than GEMV_MAX_M: a plan whose programs tile the rows, any count up to PLAN_ROWS in one launch), or as for the rows
# PINNED_ROWS_BY_SHAPE gives their (N, K); these values define pinned results. On an H100 at V4-Flash's eight dense
# shapes (bench/kernels/pinned_plans.py, bench/results/kernels/2026-12-07-pinned-plans-head-h100.md) the 32-row plan
# took 160 µs at one row and 171 at 64 against the 64-row plan's 193 / 192 (the unpinned peer 92 / 192); the 8-row
# plan for the five shapes where it saves the most at one row, as shipped: 127 / 235 (the step's trade: docs/
# determinism.md)
PINNED_ROWS = 32
PINNED_ROWS_BY_SHAPE: dict[tuple[int, int], int] = {
    (512, 4096): 8,  # wkv (faster at 64 rows too)
    (1024, 4096): 8,  # wq_a
    (4096, 8192): 8,  # wo_b
    (32768, 1024): 8,  # wq_b
    (8192, 1024): 8,  # the indexer's wq_b
}


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and path of one call. ``path``: ``"gemv"`` (up to ``block_m`` rows, CUDA cores), ``"w8a16"``
    (bf16/fp32 tensor cores), ``"w8a8"`` (FP8 tensor cores: act_quant, a 128-wide weight K block, block_k 128) or
    ``"dequant"`` (the weight dequantised to ``x.dtype`` by a kernel, then ``F.linear``). ``scale_x`` (w8a16):
    multiply the weight scale into the activation tile instead of the weight tile (block_n dividing the row block;
    gemv always does)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # K chunks of gemv / w8a16 (rounded so that none is empty)
    num_warps: int = 4
    num_stages: int = 3
    path: str = "w8a16"
    scale_x: bool = False
    fuse_quant: bool = True  # act_quant on gemv / w8a16: quantise in the GEMM, else in a pre-pass
    group_m: int = 8  # w8a8 program ordering
    swap_ab: bool = False  # w8a8 for few rows: the weight as the MMA's wide operand, split-K as split_k


@functools.lru_cache(maxsize=8)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _gemv_rows(m: int, n: int) -> bool:
    """Whether ``m`` rows of ``n`` output columns take the gemv (one row always; up to ``GEMV_MAX_M`` below 16384)."""
    return m == 1 or (m <= GEMV_MAX_M and n < 16384)


def pick_config(
    m: int, n: int, k: int, block: tuple[int, int], act_quant: bool, sms: int = 132, elem_bytes: int = 2
) -> GemmConfig:
    """The tiles for ``[m, k] × [n, k]ᵀ`` from the shapes only (the same choice inside and outside a CUDA graph);
    measured on an H200 at V4-Flash's shapes (``bench/kernels/gemm_fp8.py --tune``). ``elem_bytes``: of the
    activations (fp32 ones take fewer w8a16 stages: the tiles are sized for bf16)."""
    w8a8 = act_quant and block[1] == ACT_BLOCK and m >= W8A8_MIN_M
    if interpreted():
        gemv = not w8a8 and _gemv_rows(m, n)
        cfg = GemmConfig(triton.next_power_of_2(m) if gemv else 16, 32, 128, num_stages=1,
                         path="w8a8" if w8a8 else "gemv" if gemv else "w8a16")  # fmt: skip
        return replace(cfg, split_k=2 if n <= 64 and k >= 512 else 1)
    if w8a8:
        return GemmConfig(64, 64 if m <= 512 else 128, 128, num_warps=4, num_stages=4, path="w8a8")
    if act_quant and block[1] == ACT_BLOCK and SWAP_W8A8_MIN_M <= m:  # few rows: FP8 MMA, weights on the wide side
        bm = min(128, max(16, triton.next_power_of_2(m)))
        tiles, steps, split = triton.cdiv(m, bm) * triton.cdiv(n, 128), k // ACT_BLOCK, 1
        while tiles * split < sms and steps >= 8 * split:
            split *= 2
        return GemmConfig(bm, 128, 128, split_k=split, num_warps=4, num_stages=4, path="w8a8", swap_ab=True)
    if m >= DEQUANT_MIN_M and not act_quant:
        return GemmConfig(64, 128, 128, path="dequant")
    if block[0] % 16 == 0 and _gemv_rows(m, n):  # CUDA cores; ~1.5 waves of programs
        bn, bk, warps = (32, 256, 4) if n >= 16384 and block[0] % 32 == 0 else (16, 512, 4)
        if bn == 16 and k >= 2048 and n >= 16 * sms and m == 1:
            bk, warps = 1024, 8
        bm = triton.next_power_of_2(m)
        tiles, steps, split = triton.cdiv(n, bn), triton.cdiv(k, bk), 1
        while 2 * tiles * split < 3 * sms and 2 * split <= steps:
            split *= 2
        return GemmConfig(bm, bn, bk, split_k=split, num_warps=warps, num_stages=1, path="gemv")
    small = SMALL_M_TILES.get((n, k)) if m <= SMALL_M_MAX else None
    if small is not None:
        bn, split = small
        stages = fit_stages(3, (16 * elem_bytes + bn) * 128)
        return GemmConfig(16, bn, 128, split_k=split, num_warps=4, num_stages=stages, fuse_quant=True)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bn = 64 if m <= 16 else 128
    tiles, steps, split = triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, 128), 1
    while (
        (tiles * split < sms and steps >= 8 * split) if bm <= 16 else (2 * tiles * split <= sms and steps >= 4 * split)
    ):
        split *= 2  # fill the SMs, keeping several K steps per chunk
    warps = 4 if bm * bn < 64 * 128 else 8
    stages = fit_stages(3, (bm * elem_bytes + bn) * 128)  # an activation tile and an FP8 weight tile a stage
    return GemmConfig(bm, bn, 128, split_k=split, num_warps=warps, num_stages=stages, fuse_quant=bm <= 16)


def pinned_rows(n: int, k: int) -> int:
    """The rows a pinned ``[·, k] × [n, k]ᵀ`` plans for (``PINNED_ROWS_BY_SHAPE``, else ``PINNED_ROWS``), checked:
    a tensor-core plan (more than ``GEMV_MAX_M`` rows) of at most ``PLAN_ROWS``."""
    rows = PINNED_ROWS_BY_SHAPE.get((n, k), PINNED_ROWS)
    if not GEMV_MAX_M < rows <= PLAN_ROWS:
        raise ValueError(f"fp8_gemm_config: pinned rows of ({n}, {k}) must be in ({GEMV_MAX_M}, {PLAN_ROWS}]: {rows}")
    return rows


def check_config(cfg: GemmConfig, m: int, block: tuple[int, int], act_quant: bool, dt: torch.dtype) -> None:
    bad = None
    if cfg.path == "w8a8" and (not act_quant or block[1] != ACT_BLOCK or cfg.block_k != ACT_BLOCK):
        bad = "w8a8 needs act_quant, a 128-wide weight K block and block_k 128"
    elif cfg.path in ("gemv", "w8a16") and act_quant and cfg.fuse_quant and cfg.block_k % ACT_BLOCK:
        bad = f"a fused act_quant needs block_k a multiple of {ACT_BLOCK}"
    elif cfg.path == "w8a16" and act_quant and cfg.fuse_quant and cfg.block_k != ACT_BLOCK:
        bad = f"w8a16 with a fused act_quant needs block_k {ACT_BLOCK}"
    elif cfg.path == "gemv" and (m > cfg.block_m or block[0] % cfg.block_n):
        bad = "gemv needs at most block_m rows and block_n dividing the weight's row block"
    elif cfg.path == "w8a16" and cfg.scale_x and (block[0] % cfg.block_n or dt == torch.float16):
        bad = "scale_x needs block_n dividing the weight's row block and bf16 / fp32 activations"
    elif cfg.path not in _PATHS:
        bad = f"unknown path {cfg.path!r}"
    if bad:
        raise ValueError(f"fp8_linear: config {cfg}: {bad}")


__all__ = [
    "ACT_BLOCK",
    "DEQUANT_MIN_M",
    "GEMV_MAX_M",
    "PINNED_ROWS",
    "PINNED_ROWS_BY_SHAPE",
    "SCALED_MM_MIN_M",
    "SMALL_M_MAX",
    "SMALL_M_TILES",
    "SWAP_W8A8_MIN_M",
    "W8A8_MIN_M",
    "GemmConfig",
    "pick_config",
    "pinned_rows",
]
