"""Routed-expert MoE with MXFP4 expert weights, W4A16: the FP4 tiles are decoded inside the GEMM kernels.

Semantics: ``moe_mxfp4(x, idx, weights, w1, s1, w2, s2, w3, s3, limit)`` is ``moe_triton(x, idx, weights,
deq(w1, s1), deq(w2, s2), deq(w3, s3), limit)`` (``kernels.moe``, itself ``ReferenceOps.moe``) with ``deq`` =
``dequantize_experts(·, ·, x.dtype)``: the same slot layout, the same roundings (gate and up to ``x.dtype``, the
weighted SwiGLU to ``x.dtype``, each slot's down projection to ``x.dtype``, the ``k`` slots summed in fp32). Every
decoded weight (an e2m1 value times a power of two) is exact in bf16 and fp32, so only the order of the fp32
accumulation differs from the bf16 kernels run on decoded weights.

Layout (``quant.formats``' MXFP4, one expert after another): ``w1``, ``w3`` ``[E, I, D/2]`` and ``w2`` ``[E, D, I/2]``
bytes (int8 or uint8), element ``2j`` of a row in the low nibble of byte ``j`` and ``2j+1`` in the high nibble, e2m1
codes with bit 3 the sign; ``s1``, ``s3`` ``[E, I, D/32]`` and ``s2`` ``[E, D, I/32]`` uint8 e8m0 exponents (a
``float8_e8m0fnu`` tensor is read as its bits), one per 32 elements (16 bytes) of a row: value ``2^(s - 127)``.

Kernels: those of ``moe_triton`` (gate+up with the weighted SwiGLU, then down, over the same padded slot blocks; a
block past the last expert exits, so the grid depends on ``T·k`` alone and nothing reads a device value on the host:
a call can be captured in a CUDA graph). The weight tiles are read as packed codes and decoded in registers:

The tile becomes ``x.dtype`` and meets the activations in a ``tl.dot`` with fp32 accumulation (the weights as the
MMA's operand ``A`` from ``block_m = 64`` on). On CUDA in bf16 a PTX block decodes one 32-bit word (8 codes) into 4
bf16x2 and multiplies them by the bf16x2 scale: by byte lookups (``prmt``) for codes as stored, or, for codes in
the shift order (``order="shift"``, ``quant.nibble_order``) by shifts and masks, 19% fewer instructions a tile (the
kernels issue-bound at decode sizes: 1.2x at T = 16-256), and in the rotate order (``order="rotate"``, made once at
load by ``NvidiaOps.prepare_weights``) mostly by one rotation and one mask a register, 17% fewer again. The
weight tiles then come through the TMA unit when whole tiles fit (``TMA_WEIGHTS``; another 1.3x at T = 16-256:
fewer load instructions and L2 requests than per-thread copies). Otherwise (fp32, the interpreter) a code is decoded
to the fp16 ``value · 2^-14`` in plain Triton, widened to fp32 and multiplied by ``2^(s - 113)``.

Every decoded weight is exact for exponents 2 ≤ s ≤ 240 (block maxima between ``2^-124`` and ``2^114``; real
weights are far inside; the shift and rotate orders take s ≤ 128), so the results differ from ``moe_triton`` on the
decoded experts only by fp32 summation order, and the three orders give the same tiles, bit for bit. Without CUDA (or in
Triton's interpreter) the same kernels decode in plain Triton. The decode and the K loop are in
``kernels.moe_mxfp4_gemm``.

The prefill tiles of rotate-ordered experts on sm_90 run as Gluon kernels instead (``moe_mxfp4_wgmma.PREFILL``:
``DEEPINFER_MOE_PREFILL``, or ``WGMMA_PREFILL`` where set): the same blocks, sums and roundings on asynchronous
``wgmma``, by default with each thread decoding the weights of its own register operand (``kernels.moe_mxfp4_frag``;
the token rows' and hidden rows' columns permuted within each 32 to match), else with the decoded tiles through
shared memory (``kernels.moe_mxfp4_wgmma``; 1.4x the Triton tiles at 4096 tokens on an H200, the fragments
1.06-1.11x more). Should they fail to build (Gluon's API moves between Triton releases; written against 3.6), the
first failing call logs, returns the Triton tiles' result, and the process keeps to those (``WGMMA_FAILED`` says
why).

With the official FP8 activations (``act_quant``) and the weights' row references (``refs``: experts left in the
plain order by ``quant.w4a8.prepare_w4a8``, ``DEEPINFER_W4A8``), the prefill tiles run as
``kernels.moe_w4a8_wgmma``'s W4A8 kernels on the FP8 tensor cores instead: the same products, the fp32 sums in
another order and the FP8 MMA's precision within each 128 columns. A failed build falls back as above.

Split-K (``kernels.moe_mxfp4_split``): at decode sizes the grid (slot blocks × N tiles) is too small for the GPU
(6 × 32 gate/up programs at one token), so each GEMM may also be cut over K into pieces whose fp32 partials a
finishing kernel sums in a fixed order before the same epilogue (for down: the rounding of each slot to ``x.dtype``
and the fp32 sum of a token's slots, in place of ``combine``). The number of pieces comes from sizes alone
(``pick_split``, on a GPU; ``SPLIT_K`` forces it); one piece runs the unsplit kernels above. A split changes only
the order of the fp32 accumulation over K.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import moe_mxfp4_frag, moe_mxfp4_wgmma, moe_w4a8_wgmma, pdl
from deepinfer.kernels.formats import MXFP4_BLOCK, ORDERS, check_order
from deepinfer.kernels.fp8_gemm_config import ACT_BLOCK
from deepinfer.kernels.fp8_quant import act_quant_fp8, act_quant_sim
from deepinfer.kernels.moe import MoEConfig, combine
from deepinfer.kernels.moe_align import padded_slots
from deepinfer.kernels.moe_mxfp4_gemm import gemm, swiglu_rows
from deepinfer.kernels.moe_mxfp4_split import down_split, gate_up_split, pick_split, scale_align, split_steps
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import is_pinned, plan_rows

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)

# The config table (H200, V4-Flash experts, ``bench/kernels/moe_mxfp4.py --sweep``,
# bench/results/2026-11-30-moe-mxfp4.md and
# 2026-11-30-moe-mxfp4-shift.md): 16-row tiles up to 8 slots per expert (T <= 341 at top-6 of 256), 64 weight rows
# on 2 warps (8-10% ahead of 128 rows on 4 warps from T = 16 on, 4% behind at T = 1); then the smallest tile that
# holds an expert's mean slots in one block (a block decodes its weights once, whatever its padding): 32 rows on 2
# warps up to 32 slots per expert (2.1x faster than 128-row tiles at T = 1024, 24 slots), 64 rows on 4 warps up to 64
# (1.5x at T = 2048, 48 slots), 128-row tiles above (1.2x ahead of 64 rows at T = 4096); weights on the MMA's M side
# from 64 rows on (bench/results/engine/2026-11-30-pdl-moe-tiles.md). A CUDA-core path for 1-4 rows was 1.2-3.5x slower
# than 16-row tiles.
MX_DECODE = MoEConfig(block_m=16, block_n=64, block_k=128, num_warps=2, num_stages=3)
MX_MID = MoEConfig(block_m=32, block_n=64, block_k=128, num_warps=2, num_stages=3)
MX_MID64 = MoEConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
MX_PREFILL = MoEConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
MX_INTERPRET = MoEConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)

FAST_DECODE = True  # bf16 on CUDA: decode with moe_mxfp4_gemm's PTX (False: the portable decode; for benchmarks)
TMA_WEIGHTS = True  # bf16 on CUDA: the weight tiles come through the TMA unit (False: pointer loads; benchmarks)
SWAP_AB: bool | None = None  # tl.dot with the weights as its first operand; None: when block_m >= 64 (benchmarks)
SPLIT_K: int | None = None  # K pieces of each GEMM: None: ``pick_split`` on a GPU (1 in the interpreter); n: forced
# K pieces of each GEMM in a pinned call (kernels.pinning: the plan of PLAN_ROWS tokens takes no split, so one token
# ran 6 slot blocks unsplit); on every device, for every token count (a split is the same for a row in any batch); the
# value defines pinned results. H100, V4-Flash's experts (bench/kernels/pinned_plans.py): 1 / 2 / 3 / 4 / 6 pieces 79 /
# 61 / 53 / 51 / 57 µs at one token, 1037 / 1070 / 1161 / 1147 / 1347 µs at 64 (4: the one-token step's gain; the
# 64-token step's cost is weighed in docs/determinism.md)
PINNED_SPLIT = 4
WGMMA_PREFILL: bool | None = None  # rotate-order prefill tiles on sm_90 in Gluon (None: moe_mxfp4_wgmma.PREFILL)
WGMMA_FAILED: str | None = None  # why the Gluon kernels failed in this process (a Triton whose Gluon API differs)


def pick_config_mxfp4(slots: int, experts: int, interpret: bool = False) -> MoEConfig:
    if interpret:
        return MX_INTERPRET
    if slots <= 8 * experts:
        return MX_DECODE
    if slots <= 32 * experts:
        return MX_MID
    return MX_MID64 if slots <= 64 * experts else MX_PREFILL


def splits_mxfp4(
    slots: int, experts: int, inter: int, hidden: int, cfg: MoEConfig, auto: bool = True
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(pieces, steps a piece)`` (``moe_mxfp4_split.split_steps``) of the gate/up GEMM (K = ``hidden``) and of the
    down GEMM (K = ``inter``) under ``SPLIT_K``: ``n`` forces at most ``n`` pieces, ``None`` takes ``PINNED_SPLIT``
    in a pinned call (``kernels.pinning``), else ``pick_split``'s when ``auto`` and 1 otherwise. One piece: the
    unsplit kernels. Host arithmetic on sizes only."""
    if SPLIT_K is not None and SPLIT_K < 1:
        raise ValueError(f"moe_mxfp4: SPLIT_K must be None or at least 1, got {SPLIT_K}")
    if PINNED_SPLIT < 1:
        raise ValueError(f"moe_mxfp4: PINNED_SPLIT must be at least 1, got {PINNED_SPLIT}")
    forced = SPLIT_K if SPLIT_K is not None else PINNED_SPLIT if is_pinned() else None
    out = []
    for n, k in ((inter, hidden), (hidden, inter)):
        want = forced if forced is not None else pick_split(slots, experts, n, k, cfg) if auto else 1
        out.append(split_steps(k, cfg.block_k, want))
    return out[0], out[1]


@triton.jit(do_not_specialize=["TK", "E"])
def _mx_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, rw_ptr, slots_ptr, bexp_ptr, h_ptr, TK, E, N, KH,
                       stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm, limit, TOPK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       FAST: tl.constexpr, ORDER: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr,
                       PRECISION: tl.constexpr, DT: tl.constexpr, SALIGN: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    stride_sn = stride_sn * SALIGN  # passed divided by SALIGN (scale_align): the scale loads vectorise
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        dt: tl.constexpr = DT  # x.dtype (x and h may be handed over in fp32)
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        tok = (slot // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        sbase = e.to(tl.int64) * stride_se
        acc_g, acc_u = gemm(x_ptr, tok, stride_xm, valid, w1_ptr, s1_ptr, w3_ptr, s3_ptr, wbase, sbase, rn, mask_n, 0,
                            KH, KH, stride_wn, stride_sn, dt, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FAST, ORDER, TMA,
                            SWAP, PRECISION, True)  # fmt: skip
        swiglu_rows(acc_g, acc_u, slot, valid, rn, mask_n, rw_ptr, h_ptr, stride_hm, limit, dt)


@triton.jit(do_not_specialize=["TK", "E"])
def _mx_down_kernel(h_ptr, w2_ptr, s2_ptr, slots_ptr, bexp_ptr, o_ptr, TK, E, N, KH, stride_hm, stride_we, stride_wn,
                    stride_se, stride_sn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr, ORDER: tl.constexpr,
                    TMA: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr,
                    SALIGN: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    stride_sn = stride_sn * SALIGN  # passed divided by SALIGN (scale_align)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        dt: tl.constexpr = DT
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        row = slot.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        acc, _ = gemm(h_ptr, row, stride_hm, valid, w2_ptr, s2_ptr, w2_ptr, s2_ptr, wbase,
                      e.to(tl.int64) * stride_se, rn, mask_n, 0, KH, KH, stride_wn, stride_sn, dt, BLOCK_M, BLOCK_N,
                      BLOCK_K, EVEN_K, FAST, ORDER, TMA, SWAP, PRECISION, False)  # fmt: skip
        o_off = row[:, None] * stride_om + rn[None, :]
        tl.store(o_ptr + o_off, acc.to(dt), mask=valid[:, None] & mask_n[None, :])


def _words(w: torch.Tensor) -> torch.Tensor:
    w = w.contiguous()
    if w.storage_offset() % 4:
        w = w.clone()
    return w.view(torch.int32)  # 8 codes a word; the strides count words


def _tma_fits(w: torch.Tensor, rows: int, cfg: MoEConfig) -> bool:
    """Whether the words ``w [E, rows, K/8]`` can be read in whole ``[block_n, block_k/8]`` tiles by the TMA unit (a
    tile never straddles two experts or a row's end; 16-byte aligned base and rows)."""
    return rows % cfg.block_n == 0 and (8 * w.shape[-1]) % cfg.block_k == 0 and w.data_ptr() % 16 == 0


def _descriptor(w: torch.Tensor, cfg: MoEConfig):  # noqa: ANN202
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [cfg.block_n, cfg.block_k // 8])


def _bits(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s


def _check(x, idx, weights, w1, s1, w2, s2, w3, s3) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"moe_mxfp4: x must be [T, D] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    t, d = x.shape
    if w1.dim() != 3 or d % MXFP4_BLOCK:
        raise ValueError(f"moe_mxfp4: w1 must be [E, I, D/2] with D a multiple of 32, got {tuple(w1.shape)}, D={d}")
    e, i = w1.shape[:2]
    want = {
        "w1": (w1, (e, i, d // 2), (torch.int8, torch.uint8)),
        "w3": (w3, (e, i, d // 2), (torch.int8, torch.uint8)),
        "w2": (w2, (e, d, i // 2), (torch.int8, torch.uint8)),
        "s1": (s1, (e, i, d // 32), (torch.uint8, torch.float8_e8m0fnu)),
        "s3": (s3, (e, i, d // 32), (torch.uint8, torch.float8_e8m0fnu)),
        "s2": (s2, (e, d, i // 32), (torch.uint8, torch.float8_e8m0fnu)),
    }
    for name, (ten, shape, dtypes) in want.items():
        if tuple(ten.shape) != shape or ten.dtype not in dtypes or i % MXFP4_BLOCK:
            raise ValueError(
                f"moe_mxfp4: {name} must be {list(shape)} of {' or '.join(map(str, dtypes))} (I={i} a multiple of "
                f"32), got {tuple(ten.shape)} {ten.dtype}"
            )
    if idx.dim() != 2 or idx.shape[0] != t or weights.shape != idx.shape:
        raise ValueError(f"moe_mxfp4: idx and weights must be [{t}, k], got {tuple(idx.shape)}, {tuple(weights.shape)}")


def moe_mxfp4(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    limit: float,
    config: MoEConfig | None = None,
    order: str = "plain",
    act_quant: bool = False,
    refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``moe_triton`` on the MXFP4 experts decoded to ``x.dtype`` (module docstring) → ``[T, D]`` fp32. ``order``: the
    nibble order of all three weights' codes (``quant.nibble_order``). ``act_quant``: the official FP8 activations,
    ``x`` and each slot's hidden row rounded as ``act_quant_sim(·, 128)`` before their GEMMs (where the width is a
    multiple of 128), one pass each; the GEMMs stay bf16 (exact on e4m3 values), except where ``refs`` (the weights'
    row references, ``quant.w4a8.row_refs``, codes as stored) lets the prefill tiles run on the FP8 tensor cores
    (``kernels.moe_w4a8_wgmma``: the same products, the sums in another order and precision)."""
    _check(x, idx, weights, w1, s1, w2, s2, w3, s3)
    check_order(order)
    t, k = idx.shape
    e, inter, dh = w1.shape
    d = 2 * dh
    if t == 0:
        return torch.zeros(0, d, dtype=torch.float32, device=x.device)
    tk = t * k
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    plan = plan_rows(t) * k  # (kernels.pinning: a pinned call plans for PLAN_ROWS tokens, on the W4A16 tiles)
    cfg = config or pick_config_mxfp4(plan, e, interpret)
    if act_quant and refs is not None and config is None and _w4a8(cfg, x, order, inter, d, interpret, s1, s2, s3):
        try:
            return _moe_w4a8(x, idx, weights, w1, s1, w2, s2, w3, s3, refs, limit)
        except Exception as exc:  # noqa: BLE001 - the W4A16 tiles below compute the same products; once per process
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise
            _gluon_failed(exc)
    if act_quant and d % ACT_BLOCK == 0:
        x = act_quant_sim(x.contiguous())
    if config is None and _wgmma(cfg, x, order, inter, d, interpret):
        try:
            return _moe_wgmma(x, idx, weights, w1, s1, w2, s2, w3, s3, limit, act_quant)
        except Exception as exc:  # noqa: BLE001 - the Triton tiles below compute the same; once per process
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise
            _gluon_failed(exc)
    if cfg.block_k % 32:
        raise ValueError(f"moe_mxfp4: block_k must be a multiple of 32, got {cfg.block_k}")
    swap = cfg.block_m >= 64 if SWAP_AB is None else SWAP_AB
    slots, bexp = padded_slots(idx, e, cfg.block_m)
    if cfg.block_m < 16:
        raise ValueError(f"moe_mxfp4: block_m must be at least 16 (tl.dot), got {cfg.block_m}")
    fast = FAST_DECODE and x.is_cuda and not interpret and x.dtype == torch.bfloat16
    xa = x.contiguous()
    w1, w2, w3 = (_words(w) for w in (w1, w2, w3))
    (sw1e, sw1n), (sw2e, sw2n) = w1.stride()[:2], w2.stride()[:2]  # w3 is laid out as w1
    s1, s2, s3 = (_bits(s).contiguous() for s in (s1, s2, s3))
    rw = weights.reshape(-1).float().contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    nblocks = bexp.numel()
    tma = fast and TMA_WEIGHTS and all(_tma_fits(w, n, cfg) for w, n in ((w1, inter), (w3, inter), (w2, d)))
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FAST=fast, SWAP=swap)
    meta.update(ORDER=ORDERS.index(order), PRECISION=prec, TMA=tma)
    if tma:  # the words as 2-D tensors [E·N, K/8] read a tile at a time by the TMA unit
        w1, w3, w2 = (_descriptor(w, cfg) for w in (w1, w3, w2))
    meta["DT"] = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32
    launch = cfg.launch()
    (split_gu, piece_gu), (split_dn, piece_dn) = splits_mxfp4(plan, e, inter, d, cfg, x.is_cuda and not interpret)
    h = torch.empty((tk, inter), dtype=x.dtype, device=x.device)
    if split_gu > 1:
        gate_up_split(xa, w1, s1, w3, s3, rw, slots, bexp, h, k, float(limit), split_gu, piece_gu, sw1e, sw1n, meta,
                      launch)  # fmt: skip
    else:
        _mx_gate_up_kernel[(nblocks, triton.cdiv(inter, cfg.block_n))](
            xa, w1, s1, w3, s3, rw, slots, bexp, h, tk, e, inter, dh,
            xa.stride(0), sw1e, sw1n, s1.stride(0), s1.stride(1) // scale_align(s1), h.stride(0), float(limit),
            TOPK=k, EVEN_K=d % cfg.block_k == 0, SALIGN=scale_align(s1), **meta, **launch, **pdl.launch(),
        )  # fmt: skip
    if act_quant and inter % ACT_BLOCK == 0:
        h = act_quant_sim(h)
    if split_dn > 1:
        return down_split(h, w2, s2, slots, bexp, t, k, split_dn, piece_dn, sw2e, sw2n, meta, launch)
    o = torch.empty((tk, d), dtype=x.dtype, device=x.device)
    _mx_down_kernel[(nblocks, triton.cdiv(d, cfg.block_n))](
        h, w2, s2, slots, bexp, o, tk, e, d, inter // 2,
        h.stride(0), sw2e, sw2n, s2.stride(0), s2.stride(1) // scale_align(s2), o.stride(0),
        EVEN_K=inter % cfg.block_k == 0, SALIGN=scale_align(s2), **meta, **launch, **pdl.launch(),
    )  # fmt: skip
    return combine(o, t, k)


def _wgmma(cfg: MoEConfig, x: torch.Tensor, order: str, inter: int, d: int, interpret: bool) -> bool:
    """Whether the prefill tiles run as ``kernels.moe_mxfp4_wgmma``'s Gluon kernels."""
    if WGMMA_PREFILL is False or WGMMA_FAILED or cfg is not MX_PREFILL or order != "rotate" or interpret:
        return False
    if WGMMA_PREFILL is None and moe_mxfp4_wgmma.PREFILL == "triton":
        return False
    return moe_mxfp4_wgmma.fits(inter, d) and moe_mxfp4_wgmma.fits(d, inter) and moe_mxfp4_wgmma.available(x)


def _w4a8(cfg: MoEConfig, x: torch.Tensor, order: str, inter: int, d: int, interpret: bool, *scales) -> bool:
    """Whether the prefill tiles run as ``kernels.moe_w4a8_wgmma``'s Gluon kernels (FP8 activations, row references,
    codes as stored). The kernels copy each row's exponents of a step as one 32-bit word, so ``scales`` off a 4-byte
    boundary (a view; the loaded modules' never are) keep the W4A16 tiles rather than a copy a call."""
    if WGMMA_PREFILL is False or WGMMA_FAILED or cfg is not MX_PREFILL or order != "plain" or interpret:
        return False
    if any(s.data_ptr() % 4 for s in scales):
        return False
    if WGMMA_PREFILL is None and moe_mxfp4_wgmma.PREFILL == "triton":
        return False
    return moe_w4a8_wgmma.usable(x, inter, d)


def _moe_w4a8(x, idx, weights, w1, s1, w2, s2, w3, s3, refs, limit: float) -> torch.Tensor:
    """``moe_mxfp4(act_quant=True)`` on the W4A8 prefill kernels: the rows rounded to e4m3 (``act_quant_fp8``), the
    hidden rows again after the gate/up kernel."""
    t, k = idx.shape
    slots, bexp, (w1, w2, w3), (s1, s2, s3), rw, h, o = _prefill_operands(
        x, idx, weights, (w1, w2, w3), (s1, s2, s3), moe_w4a8_wgmma.BLOCK_M
    )
    r1, r2, r3 = (r.contiguous() for r in refs)
    xq, xs = act_quant_fp8(x.contiguous(), ACT_BLOCK)
    moe_w4a8_wgmma.gate_up(xq, xs, w1, s1, r1, w3, s3, r3, rw, slots, bexp, h, k, float(limit))
    hq, hs = act_quant_fp8(h, ACT_BLOCK)
    moe_w4a8_wgmma.down(hq, hs, w2, s2, r2, slots, bexp, o)
    return combine(o, t, k)


def _prefill_operands(x, idx, weights, words, scales, block_m: int) -> tuple:
    """What the Gluon prefill kernels take: the padded slot blocks of ``block_m`` slots, the weights as int32 words,
    the exponents as contiguous bytes, the routing weights as fp32 a slot, and ``h [T·k, I]`` and ``o [T·k, D]``
    (``x.dtype``, unwritten)."""
    tk, (e, inter, dh) = idx.numel(), words[0].shape
    slots, bexp = padded_slots(idx, e, block_m)
    words = tuple(_words(w) for w in words)
    scales = tuple(_bits(s).contiguous() for s in scales)
    rw = weights.reshape(-1).float().contiguous()
    h = torch.empty((tk, inter), dtype=x.dtype, device=x.device)
    o = torch.empty((tk, 2 * dh), dtype=x.dtype, device=x.device)
    return slots, bexp, words, scales, rw, h, o


def _gluon_failed(exc: Exception) -> None:
    """Keep to the Triton tiles from now on: the Gluon kernels did not build or launch (their API moves between
    Triton releases; written against 3.6)."""
    global WGMMA_FAILED
    WGMMA_FAILED = f"{type(exc).__name__}: {exc}"[:500]
    log.warning("moe_mxfp4: the Gluon prefill kernels failed; using the Triton tiles: %s", WGMMA_FAILED)


def _moe_wgmma(x, idx, weights, w1, s1, w2, s2, w3, s3, limit: float, act_quant: bool) -> torch.Tensor:
    """``moe_mxfp4`` on the Gluon prefill kernels (rotate order; ``x`` already rounded where ``act_quant``)."""
    t, k = idx.shape
    slots, bexp, (w1, w2, w3), (s1, s2, s3), rw, h, o = _prefill_operands(
        x, idx, weights, (w1, w2, w3), (s1, s2, s3), moe_mxfp4_wgmma.BLOCK_M
    )
    inter, d = h.shape[1], o.shape[1]
    if _frag(inter, d, s1, s2, s3):  # h in the fragment column order (act_quant_sim's 128-column blocks kept)
        kernels, xa = moe_mxfp4_frag, moe_mxfp4_frag.permute_columns(x)
    else:
        kernels, xa = moe_mxfp4_wgmma, x.contiguous()
    kernels.gate_up(xa, w1, s1, w3, s3, rw, slots, bexp, h, k, float(limit))
    if act_quant and inter % ACT_BLOCK == 0:
        h = act_quant_sim(h)
    kernels.down(h, w2, s2, slots, bexp, o)
    return combine(o, t, k)


def _frag(inter: int, d: int, *scales: torch.Tensor) -> bool:
    """Whether ``_moe_wgmma`` runs the register-fragment kernels (``kernels.moe_mxfp4_frag``): chosen, whole steps,
    and exponent rows on 4-byte boundaries (its 32-bit exponent copies)."""
    if not moe_mxfp4_wgmma.use_frag() or any(s.data_ptr() % 4 for s in scales):
        return False
    return moe_mxfp4_frag.fits(inter, d) and moe_mxfp4_frag.fits(d, inter)


__all__ = [
    "MX_DECODE",
    "MX_INTERPRET",
    "MX_MID",
    "MX_MID64",
    "MX_PREFILL",
    "moe_mxfp4",
    "pick_config_mxfp4",
    "splits_mxfp4",
]
