"""Routed-expert MoE with MXFP4 experts on the FP8 tensor cores (W4A8): DeepSeek-V4's official expert numerics
(MODEL_V4.md §2.12, §4.2), the path of ``moe_mxfp4(act_quant=True)`` at prefill sizes.

Semantics: ``moe_mxfp4`` with ``act_quant``. The input rows and each slot's weighted SwiGLU (rounded to ``x.dtype``)
are rounded as ``act_quant_sim(·, 128)`` (e4m3, one power-of-two scale per 128 columns) before their GEMMs, so they
are e4m3 values times powers of two. So are the weights once cast as the official converter casts them
(``cast_e2m1fn_to_e4m3fn``): per row and 128 columns, with ``r`` the largest of the four 32-column exponents ``s``,
a code ``v`` becomes the e4m3 ``v · 2^(6 + s - r)`` and the block's scale ``2^(r - 133)``. That is exact while
``s >= r - 11`` (the code 0.5 stays a normal e4m3) and ``r >= 7`` (the scale a normal fp32):
``nibble_order.fp8_cast_fits`` checks it once at load. Every product is then exact, and the result differs from the
W4A16 kernels with ``act_quant`` only in the order and precision of the fp32 sums: each 128-column partial sum
leaves the MMA and is scaled into an fp32 accumulator (``acc += part · s_x · s_w``, DeepGEMM's promotion).

Layout: the codes in the shift order (``quant.nibble_order``). A PTX block turns one word of 8 codes into 8 e4m3
bytes in the word's nibble order (the codes of columns 6 4 2 0 7 5 3 1 of its 8): byte lookups (``prmt``) of the
magnitudes in a table offset by the word's ``s - r``, and two more lookups that move the signs to bit 7. The FP8
activations are stored in the same column order (``act_quant_fp8(perm=True)`` for the input, the gate/up
epilogue's stores for the hidden rows), so weight and activation tiles meet with no shuffle. Without CUDA (Triton's
interpreter) the weights are decoded to the same e4m3 values in fp32 in plain Triton and the dots run in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_quant import _quant_sim, act_quant_fp8, perm_columns
from deepinfer.kernels.moe import MoEConfig, _combine, _silu_mul
from deepinfer.kernels.moe_align import padded_slots
from deepinfer.kernels.moe_mxfp4_gemm import _codes
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.quant.nibble_order import MIN_SHIFT, fp8_cast_fits

BLOCK_K = 128  # one activation scale block per K step
# prefill tiles (H200, bench/moe_mxfp4.py --w4a8); the weights on the MMA's M side (``swap``) when block_m >= 64
W8_PREFILL = MoEConfig(block_m=128, block_n=64, block_k=BLOCK_K, num_warps=8, num_stages=3)
W8_MID = MoEConfig(block_m=64, block_n=64, block_k=BLOCK_K, num_warps=4, num_stages=3)
W8_INTERPRET = MoEConfig(block_m=16, block_n=64, block_k=BLOCK_K, num_warps=4, num_stages=1)
SWAP_AB: bool | None = None  # None: weights as the dot's first operand when block_m >= 64 (benchmarks force it)

# 8 e2m1 codes (the word $2, nibble j holding code SHIFT_ORDER[j]) → 8 e4m3 bytes in nibble order, $0 = nibbles
# 0..3, $1 = nibbles 4..7, each code's value times 2^(6 + $3) ($3 = s - r in [-11, 0]). Tables of the magnitudes
# 0, .5, 1, 1.5, 2, 3, 4, 6 times 2^6: e4m3 bytes 00 60 68 6C | 70 74 78 7C, every non-zero byte lowered by 8·d
# (no borrow: each stays >= 8). Signs: nibble j's bit 3 is word bit 4j+3; bytes of $2 and $2 << 4 hold them on
# bit 7 (nibble 0: byte 0 of $2<<4, nibble 1: byte 0 of $2, ...).
_E2M1_E4M3_ASM = tl.constexpr("""{
.reg .b32 k0, k1, b0, b1, t0, t1, m, mh, q4, g0, g1;
mov.b32 k0, 0x08080800;
mov.b32 k1, 0x08080808;
mov.b32 b0, 0x6C686000;
mov.b32 b1, 0x7C787470;
mad.lo.s32 t0, $3, k0, b0;
mad.lo.s32 t1, $3, k1, b1;
and.b32 m, $2, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 $0, t0, t1, m;
prmt.b32 $1, t0, t1, mh;
shl.b32 q4, $2, 4;
prmt.b32 g0, $2, q4, 0x1504;
prmt.b32 g1, $2, q4, 0x3726;
and.b32 g0, g0, 0x80808080;
and.b32 g1, g1, 0x80808080;
or.b32 $0, $0, g0;
or.b32 $1, $1, g1;
}""")


@triton.jit
def _bytes(r, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """int32 ``[BLOCK_N, W]`` → its bytes, little-endian: int8 ``[BLOCK_N, 4W]``."""
    b0 = r.to(tl.int8)
    b1 = (r >> 8).to(tl.int8)
    b2 = (r >> 16).to(tl.int8)
    b3 = (r >> 24).to(tl.int8)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, 4 * W))


@triton.jit
def _w8_tile(w_ptr, s_ptr, wbase, sbase, rn, mask_n, kb0, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
             FAST: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Weight rows ``rn``, the 128 columns from byte ``kb0``, cast to e4m3 (module docstring) in nibble order:
    ``[BLOCK_N, 128]`` e4m3 (``FAST``) or their values in fp32, and the rows' block scales ``2^(r - 133)``."""
    rb = tl.arange(0, 4)
    s = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + (kb0 // 16 + rb)[None, :],
                mask=mask_n[:, None], other=127).to(tl.int32)  # fmt: skip
    r = tl.max(s, axis=1)
    d = tl.maximum(s - r[:, None], -11)  # nibble_order.MIN_SHIFT
    sw = ((r - 6) << 23).to(tl.float32, bitcast=True)
    if FAST:
        if TMA:  # w_ptr: a descriptor of the words [E·N, KH/4], wbase: the tile's first row
            q = w_ptr.load([wbase, kb0 // 4])
        else:
            kw = kb0 // 4 + tl.arange(0, 16)
            q = tl.load(w_ptr + wbase + rn[:, None].to(tl.int64) * stride_wn + kw[None, :], mask=mask_n[:, None],
                        other=0)  # fmt: skip
        dw = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK_N, 4, 4)), (BLOCK_N, 16))
        r0, r1 = tl.inline_asm_elementwise(
            _E2M1_E4M3_ASM, "=r,=r,r,r", [q, dw], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
        )
        w = _bytes(tl.reshape(tl.join(r0, r1), (BLOCK_N, 32)), BLOCK_N, 32).to(tl.float8e4nv, bitcast=True)
    else:  # value · 2^-14 in nibble order, times 2^(20 + d)
        c = _codes(w_ptr, wbase, rn, kb0, mask_n[:, None, None], stride_wn, 4, BLOCK_N, False)
        w = tl.reshape(c * (((d + 147) << 23).to(tl.float32, bitcast=True))[:, :, None], (BLOCK_N, 128))
    return w, sw


@triton.jit
def _a8_tile(a_ptr, as_ptr, row, stride_am, stride_as, valid, kb0, FAST: tl.constexpr):
    """The FP8 activation rows ``row``, 128 columns from column ``2·kb0``, and their scales."""
    kk = 2 * kb0 + tl.arange(0, 128)
    a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=valid[:, None], other=0.0)
    sa = tl.load(as_ptr + row * stride_as + kb0 // 64, mask=valid, other=0.0)
    if not FAST:
        a = a.to(tl.float32)
    return a, sa


@triton.jit
def _a16_tile(a_ptr, row, stride_am, valid, kb0, FAST: tl.constexpr):
    """The hidden rows ``row`` (``x.dtype``, columns in nibble order), 128 columns from column ``2·kb0``, rounded as
    ``act_quant_sim(·, 128)`` on load: e4m3 (``FAST``, else their values in fp32) and the rows' scales."""
    kk = 2 * kb0 + tl.arange(0, 128)
    a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    q, sa = _quant_sim(a, 1)
    if FAST:
        q = q.to(tl.float8e4nv)
    return q, sa


@triton.jit
def _promote(acc, a, sa, w, sw, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + (a·wᵀ) · sa ⊗ sw``; ``SWAP``: the accumulator held transposed, the weights the dot's first operand."""
    if SWAP:
        return acc + tl.dot(w, tl.trans(a), input_precision=PRECISION) * (sw[:, None] * sa[None, :])
    else:
        return acc + tl.dot(a, tl.trans(w), input_precision=PRECISION) * (sa[:, None] * sw[None, :])


@triton.jit(do_not_specialize=["TK", "E"])
def _w8_gate_up_kernel(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, rw_ptr, slots_ptr, bexp_ptr, h_ptr, TK, E, N,
                       KH, stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_hm, limit,
                       TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
                       TMA: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr,
                       PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        tok = (slot // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        sbase = e.to(tl.int64) * stride_se
        shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        acc_g = tl.zeros(shape, dtype=tl.float32)
        acc_u = tl.zeros(shape, dtype=tl.float32)
        for kb0 in range(0, KH, 64):
            a, sa = _a8_tile(x_ptr, xs_ptr, tok, stride_xm, stride_xs, valid, kb0, FAST)
            w, sw = _w8_tile(w1_ptr, s1_ptr, wbase, sbase, rn, mask_n, kb0, stride_wn, stride_sn, BLOCK_N, FAST, TMA)
            acc_g = _promote(acc_g, a, sa, w, sw, SWAP, PRECISION)
            w, sw = _w8_tile(w3_ptr, s3_ptr, wbase, sbase, rn, mask_n, kb0, stride_wn, stride_sn, BLOCK_N, FAST, TMA)
            acc_u = _promote(acc_u, a, sa, w, sw, SWAP, PRECISION)
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        # the W4A16 epilogue's roundings (gate, up and the weighted SwiGLU to x.dtype), then w2's act_quant
        g = acc_g.to(DT).to(tl.float32)
        u = acc_u.to(DT).to(tl.float32)
        rw = tl.load(rw_ptr + slot, mask=valid, other=0.0)
        h = _silu_mul(g, u, limit) * rw[:, None]
        cols = perm_columns(rn)  # in nibble order: the down kernel rounds 128 of them to e4m3 as it loads them
        out = valid[:, None] & mask_n[None, :]
        tl.store(h_ptr + slot.to(tl.int64)[:, None] * stride_hm + cols[None, :], h.to(DT), mask=out)


@triton.jit(do_not_specialize=["TK", "E"])
def _w8_down_kernel(h_ptr, w2_ptr, s2_ptr, slots_ptr, bexp_ptr, o_ptr, TK, E, N, KH, stride_hm, stride_we, stride_wn,
                    stride_se, stride_sn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
                    TMA: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr,
                    PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        row = slot.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e * N + pid_n * BLOCK_N if TMA else e.to(tl.int64) * stride_we
        sbase = e.to(tl.int64) * stride_se
        shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        acc = tl.zeros(shape, dtype=tl.float32)
        for kb0 in range(0, KH, 64):
            a, sa = _a16_tile(h_ptr, row, stride_hm, valid, kb0, FAST)
            w, sw = _w8_tile(w2_ptr, s2_ptr, wbase, sbase, rn, mask_n, kb0, stride_wn, stride_sn, BLOCK_N, FAST, TMA)
            acc = _promote(acc, a, sa, w, sw, SWAP, PRECISION)
        if SWAP:
            acc = tl.trans(acc)
        o_off = row[:, None] * stride_om + rn[None, :]
        tl.store(o_ptr + o_off, acc.to(DT), mask=valid[:, None] & mask_n[None, :])


def w4a8_shapes_fit(inter: int, hidden: int) -> bool:
    """Whether experts ``[E, inter, hidden]`` take the W4A8 kernels: both widths whole 128-column blocks."""
    return inter % BLOCK_K == 0 and hidden % BLOCK_K == 0


def pick_config_w4a8(slots: int, experts: int, interpret: bool = False) -> MoEConfig:
    if interpret:
        return W8_INTERPRET
    return W8_MID if slots <= 64 * experts else W8_PREFILL


def _tma_fits(w: torch.Tensor, rows: int, block_n: int) -> bool:
    return rows % block_n == 0 and w.data_ptr() % 16 == 0 and (w.shape[-1] * 4) % 16 == 0


def moe_w4a8(
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
    down_block_n: int | None = None,
) -> torch.Tensor:
    """``moe_mxfp4(..., act_quant=True)`` on the FP8 tensor cores → ``[T, D]`` fp32. The experts' codes in the shift
    order, their exponents within ``fp8_cast_fits``, both widths multiples of 128 (``moe_mxfp4`` checks the rest).
    ``config``: the tiles (the gate/up kernel's ``block_n``; ``block_k`` 128); ``down_block_n``: the down kernel's
    (default: ``DOWN_BLOCK_N``)."""
    from deepinfer.kernels.moe_mxfp4 import _bits, _words

    t, k = idx.shape
    e, inter, dh = w1.shape
    d = 2 * dh
    if not w4a8_shapes_fit(inter, d):
        raise ValueError(f"moe_w4a8: the expert widths must be multiples of {BLOCK_K}, got I={inter}, D={d}")
    tk = t * k
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = config or pick_config_w4a8(tk, e, interpret)
    dn = down_block_n or cfg.block_n
    if cfg.block_k != BLOCK_K or BLOCK_K % cfg.block_n or BLOCK_K % dn:
        raise ValueError(f"moe_w4a8: block_k must be {BLOCK_K} and block_n divide it, got {cfg}, down {dn}")
    swap = cfg.block_m >= 64 if SWAP_AB is None else SWAP_AB
    fast = x.is_cuda and not interpret
    slots, bexp = padded_slots(idx, e, cfg.block_m)
    xq, xs = act_quant_fp8(x.contiguous(), BLOCK_K, perm=True)
    w1, w2, w3 = (_words(w) for w in (w1, w2, w3))
    (sw1e, sw1n), (sw2e, sw2n) = w1.stride()[:2], w2.stride()[:2]
    s1, s2, s3 = (_bits(s).contiguous() for s in (s1, s2, s3))
    tma = fast and all(_tma_fits(w, n, bn) for w, n, bn in ((w1, inter, cfg.block_n), (w3, inter, cfg.block_n),
                                                               (w2, d, dn)))  # fmt: skip
    if tma:
        w1, w3, w2 = _descriptor(w1, cfg.block_n), _descriptor(w3, cfg.block_n), _descriptor(w2, dn)
    dt = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32
    meta = dict(BLOCK_M=cfg.block_m, FAST=fast, TMA=tma, SWAP=swap, DT=dt, PRECISION="ieee")
    meta.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch())
    rw = weights.reshape(-1).float().contiguous()
    h = torch.empty((tk, inter), dtype=x.dtype, device=x.device)
    nblocks = bexp.numel()
    kern = _w8_gate_up_kernel[(nblocks, inter // cfg.block_n)](
        xq, xs, w1, s1, w3, s3, rw, slots, bexp, h, tk, e, inter, dh, xq.stride(0), xs.stride(0), sw1e, sw1n,
        s1.stride(0), s1.stride(1), h.stride(0), float(limit), TOPK=k, BLOCK_N=cfg.block_n, **meta,
    )  # fmt: skip
    _stats("gate_up", kern)
    o = torch.empty((tk, d), dtype=x.dtype, device=x.device)
    kern = _w8_down_kernel[(nblocks, d // dn)](
        h, w2, s2, slots, bexp, o, tk, e, d, inter // 2, h.stride(0), sw2e, sw2n, s2.stride(0), s2.stride(1),
        o.stride(0), BLOCK_N=dn, **meta,
    )  # fmt: skip
    _stats("down", kern)
    return _combine(o, t, k)


STATS: dict[str, tuple[int, int]] = {}  # kernel → (registers, spills) of its last launch (benchmarks)


def _stats(name: str, kern: object) -> None:
    regs, spills = getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)
    if regs is not None:
        STATS[name] = (regs, spills)


def _descriptor(w: torch.Tensor, rows: int):  # noqa: ANN202
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [rows, BLOCK_K // 8])


__all__ = ["MIN_SHIFT", "W8_MID", "W8_PREFILL", "fp8_cast_fits", "moe_w4a8", "pick_config_w4a8", "w4a8_shapes_fit"]
