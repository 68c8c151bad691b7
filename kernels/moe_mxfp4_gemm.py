"""The device functions of the MXFP4 MoE kernels (``kernels.moe_mxfp4``, ``kernels.moe_mxfp4_split``): decoding a
weight tile of packed e2m1 codes and e8m0 scales, and the GEMM of activation rows against decoded weight rows over a
range of K.

``gemm(..., k_lo, k_hi, ...)`` accumulates over the bytes ``k_lo ..< k_hi`` of each weight row (columns
``2·k_lo ..< 2·k_hi``) in steps of ``BLOCK_K`` columns, in K order, in fp32: the whole row (``0, KH``) in the unsplit
kernels, one contiguous piece in the split-K kernels. A piece starts on a ``BLOCK_K`` boundary and ends on one or at
``KH``, so its tiles are the unsplit loop's tiles (the tail masks compare with ``KH`` alone, the TMA loads start on
whole tiles). The decode itself is described in ``kernels.moe_mxfp4``'s docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels.moe import silu_mul

# 8 e2m1 codes (one 32-bit word, code i in bits 4i..4i+3) → 4 bf16x2 (codes 2b, 2b+1 in register b), each times the
# bf16x2 scale $5: byte lookups (prmt) of the low and high bytes of |value|, the signs or-ed into the high bytes
_E2M1_BF16_ASM = tl.constexpr("""{
.reg .b32 m, mh, s, sh, l0, l1, h0, h1, g0, g1, p0, p1, p2, p3;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 l0, 0xC0800000, 0xC0804000, m;
prmt.b32 h0, 0x3F3F3F00, 0x40404040, m;
prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
prmt.b32 h1, 0x3F3F3F00, 0x40404040, mh;
and.b32 s, $4, 0x88888888;
shr.u32 s, s, 3;
shr.u32 sh, s, 16;
prmt.b32 g0, 0x00008000, 0, s;
prmt.b32 g1, 0x00008000, 0, sh;
or.b32 h0, h0, g0;
or.b32 h1, h1, g1;
prmt.b32 p0, l0, h0, 0x5140;
prmt.b32 p1, l0, h0, 0x7362;
prmt.b32 p2, l1, h1, 0x5140;
prmt.b32 p3, l1, h1, 0x7362;
mul.rn.bf16x2 $0, p0, $5;
mul.rn.bf16x2 $1, p1, $5;
mul.rn.bf16x2 $2, p2, $5;
mul.rn.bf16x2 $3, p3, $5;
}""")


# 8 e2m1 codes of a word in the shift order (nibble j holds code ``nibble_order.SHIFT_ORDER[j]``) → 4 bf16x2 (codes
# 2b, 2b+1 in register b) as ``value · 2^-126`` by shifts and masks (sign to bit 15, e1 e0 m to bits 8..6: the bf16
# with exponent field e, subnormal for e = 0), each times the bf16x2 scale $5 = 2^(s - 1)
_E2M1_SHIFT_ASM = tl.constexpr("""{
.reg .b32 m0, m1, m2, m3, g0, g1, g2, g3;
shr.b32 m0, $4, 6;
shr.b32 m1, $4, 2;
shl.b32 m2, $4, 2;
shl.b32 m3, $4, 6;
shl.b32 g1, $4, 4;
shl.b32 g2, $4, 8;
shl.b32 g3, $4, 12;
and.b32 m0, m0, 0x01C001C0;
and.b32 m1, m1, 0x01C001C0;
and.b32 m2, m2, 0x01C001C0;
and.b32 m3, m3, 0x01C001C0;
and.b32 g0, $4, 0x80008000;
and.b32 g1, g1, 0x80008000;
and.b32 g2, g2, 0x80008000;
and.b32 g3, g3, 0x80008000;
or.b32 m0, m0, g0;
or.b32 m1, m1, g1;
or.b32 m2, m2, g2;
or.b32 m3, m3, g3;
mul.rn.bf16x2 $0, m0, $5;
mul.rn.bf16x2 $1, m1, $5;
mul.rn.bf16x2 $2, m2, $5;
mul.rn.bf16x2 $3, m3, $5;
}""")


# 8 e2m1 codes of a word in the rotate order (``nibble_order.ROTATIONS``) → 4 bf16x2 as the shift decode gives them:
# registers 0, 1, 2 the word rotated left by 0, 4, 10 and masked, register 3 the mantissas of the word rotated by 6
# or-ed with its other bits rotated by 14, each times the bf16x2 scale $5 = 2^(s - 1)
E2M1_ROTATE_ASM = tl.constexpr("""{
.reg .b32 r1, r2, r3, r4;
and.b32 $0, $4, 0x81C081C0;
shf.l.wrap.b32 r1, $4, $4, 4;
and.b32 $1, r1, 0x81C081C0;
shf.l.wrap.b32 r2, $4, $4, 10;
and.b32 $2, r2, 0x81C081C0;
shf.l.wrap.b32 r3, $4, $4, 6;
shf.l.wrap.b32 r4, $4, $4, 14;
and.b32 r3, r3, 0x00400040;
and.b32 r4, r4, 0x81808180;
or.b32 $3, r3, r4;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $5;
mul.rn.bf16x2 $2, $2, $5;
mul.rn.bf16x2 $3, $3, $5;
}""")


@triton.jit
def _scales(s_ptr, sbase, rn, mask_n, kb0, KH, stride_sn, NB: tl.constexpr, EVEN_K: tl.constexpr):
    """The exponents of the rows ``rn`` for the ``NB`` 32-column blocks from byte ``kb0``: ``[BLOCK_N, NB, 1]`` int32,
    and the mask of the valid (row, block) pairs."""
    rb = tl.arange(0, NB)
    mask = mask_n[:, None, None]
    if not EVEN_K:
        mask = mask & (kb0 + rb * 16 < KH)[None, :, None]
    s_off = sbase + rn[:, None, None].to(tl.int64) * stride_sn + (kb0 // 16 + rb)[None, :, None]
    return tl.load(s_ptr + s_off, mask=mask, other=0).to(tl.int32), mask


@triton.jit
def _codes(w_ptr, wbase, rn, kb0, mask, stride_wn, NB: tl.constexpr, BLOCK_N: tl.constexpr, ORDER: tl.constexpr):
    """The codes of the rows ``rn`` from byte ``kb0`` (``NB`` blocks of 32) as fp32 ``value · 2^-14``, in column order:
    ``[BLOCK_N, NB, 32]`` (plain Triton: the interpreter and fp32 activations). ``w_ptr`` points to 32-bit words;
    ``ORDER`` (``quant.nibble_order``): 0 plain (code ``v`` of a word in nibble ``v``), 1 shift (in nibble
    ``SHIFT_ORDER.index(v)``), 2 rotate (bit ``b`` of code ``v`` where ``ROTATIONS`` take it from)."""
    kw = kb0 // 4 + tl.arange(0, NB)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, NB, 4] word column
    q = tl.load(w_ptr + wbase + rn[:, None, None].to(tl.int64) * stride_wn + kw, mask=mask, other=0)
    v = tl.arange(0, 8)
    if ORDER == 2:
        b = tl.arange(0, 4)[None, :]
        reg, half = (v >> 1)[:, None], (v & 1)[:, None]
        target = 16 * half + tl.where(b == 3, 15, 6 + b)  # the bit the decode gives it
        rot = tl.where(reg == 0, 0, tl.where(reg == 1, 4, tl.where(reg == 2, 10, tl.where(b == 0, 6, 14))))
        src = (target - rot + 32) % 32  # [8, 4]: where bit b of code v is stored
        bits = (q[:, :, :, None, None] >> src[None, None, None, :, :]) & 1
        c = tl.sum(bits << b[None, None, None, :, :], axis=4).to(tl.uint16)
    else:
        if ORDER == 1:
            v = 4 * (v & 1) + 3 - 2 * ((v >> 2) & 1) - ((v >> 1) & 1)
        c = ((q[:, :, :, None] >> (4 * v)[None, None, None, :]) & 0xF).to(tl.uint16)
    w = (((c & 0x8) << 12) | ((c & 0x7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(w, (BLOCK_N, NB, 32))


@triton.jit
def _mx_tile(w_ptr, s_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, DT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr,
             ORDER: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The weight rows ``rn``, columns ``2·kb0 ..+ BLOCK_K``, decoded from the 32-bit words at ``w_ptr``:
    ``[BLOCK_N, BLOCK_K]`` in ``DT``. ``FAST``: bf16 through the PTX of the words' order (``ORDER``: 0 plain, 1
    shift, 2 rotate), a word an asm call (a packed call may be handed elements that are not adjacent in memory)."""
    NB: tl.constexpr = BLOCK_K // 32
    s, mask = _scales(s_ptr, sbase, rn, mask_n, kb0, KH, stride_sn, NB, EVEN_K)
    if FAST:
        if TMA:  # w_ptr: a descriptor of the words [E·N, KH/4], wbase: the tile's first row
            q = tl.reshape(w_ptr.load([wbase, kb0 // 4]), (BLOCK_N, NB, 4))
        else:
            kw = kb0 // 4 + tl.arange(0, NB)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, NB, 4] words
            q = tl.load(w_ptr + wbase + rn[:, None, None].to(tl.int64) * stride_wn + kw, mask=mask, other=0)
        if ORDER == 2:  # the bf16x2 scale 2^(s - 1)
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                E2M1_ROTATE_ASM, "=r,=r,=r,=r,r,r", [q, (s + 126) * 0x800080], dtype=(tl.int32,) * 4, is_pure=True,
                pack=1,
            )  # fmt: skip
        elif ORDER == 1:  # the bf16x2 scale 2^(s - 1)
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _E2M1_SHIFT_ASM, "=r,=r,=r,=r,r,r", [q, (s + 126) * 0x800080], dtype=(tl.int32,) * 4, is_pure=True,
                pack=1,
            )  # fmt: skip
        else:  # the bf16x2 scale 2^(s - 127)
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r", [q, s * 0x800080], dtype=(tl.int32,) * 4, is_pure=True, pack=1
            )
        p = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N, BLOCK_K // 2))
        lo = p.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    else:
        scale = ((s + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s-127) · 2^14
        w = _codes(w_ptr, wbase, rn, kb0, mask, stride_wn, NB, BLOCK_N, ORDER) * scale
        w = tl.reshape(w.to(DT), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _mx_dot(a, w, acc, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a·wᵀ`` (``a [BLOCK_M, K]``, ``w [BLOCK_N, K]``); ``SWAP``: the accumulator is held transposed,
    ``[BLOCK_N, BLOCK_M]``, so that the weight rows fill the MMA's M dimension."""
    if SWAP:
        return tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _act(a_ptr, row, stride_am, valid, kb0, KH, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns ``2·kb0 ..+ BLOCK_K`` of the activation rows ``row``: ``[BLOCK_M, BLOCK_K]``."""
    kk = 2 * kb0 + tl.arange(0, BLOCK_K)
    mask = valid[:, None]
    if not EVEN_K:
        mask = mask & (kk < 2 * KH)[None, :]
    return tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=mask, other=0.0)


@triton.jit
def gemm(a_ptr, row, stride_am, valid, w_ptr, s_ptr, v_ptr, t_ptr, wbase, sbase, rn, mask_n, k_lo, k_hi, KH,
         stride_wn, stride_sn, dt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         EVEN_K: tl.constexpr, FAST: tl.constexpr, ORDER: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr,
         PRECISION: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """``a[row] · Wᵀ`` (and ``a[row] · Vᵀ`` if ``TWO``; V shares W's layout) over the row bytes ``k_lo ..< k_hi``
    (``k_lo`` a multiple of ``BLOCK_K / 2``; ``KH`` the bytes of a whole row) for the weight rows ``rn``:
    ``[BLOCK_M, BLOCK_N]`` fp32 each, through ``tl.dot``, both matrices in one pass over K (one load of the
    activations)."""
    shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc_w = tl.zeros(shape, dtype=tl.float32)
    acc_v = tl.zeros(shape, dtype=tl.float32)
    for kb0 in range(k_lo, k_hi, BLOCK_K // 2):
        a = _act(a_ptr, row, stride_am, valid, kb0, KH, BLOCK_K, EVEN_K)
        w = _mx_tile(w_ptr, s_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, dt, BLOCK_N,
                     BLOCK_K, EVEN_K, FAST, ORDER, TMA)  # fmt: skip
        acc_w = _mx_dot(a, w, acc_w, SWAP, PRECISION)
        if TWO:
            w = _mx_tile(v_ptr, t_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, dt, BLOCK_N,
                         BLOCK_K, EVEN_K, FAST, ORDER, TMA)  # fmt: skip
            acc_v = _mx_dot(a, w, acc_v, SWAP, PRECISION)
    if SWAP:
        acc_w = tl.trans(acc_w)
        acc_v = tl.trans(acc_v)
    return acc_w, acc_v


@triton.jit
def swiglu_rows(acc_g, acc_u, slot, valid, rn, mask_n, rw_ptr, h_ptr, stride_hm, limit, DT: tl.constexpr):
    """The gate/up kernels' epilogue: gate and up ``[BLOCK_M, BLOCK_N]`` fp32 rounded to ``DT`` (as ``moe_triton``),
    the clamped SwiGLU times each slot's routing weight, stored to the slots' rows of ``h``."""
    g = acc_g.to(DT).to(tl.float32)
    u = acc_u.to(DT).to(tl.float32)
    rw = tl.load(rw_ptr + slot, mask=valid, other=0.0)
    h = silu_mul(g, u, limit) * rw[:, None]
    h_off = slot.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(h_ptr + h_off, h.to(DT), mask=valid[:, None] & mask_n[None, :])
