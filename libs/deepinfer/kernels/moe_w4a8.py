"""The MXFP4 experts' gate/up GEMM on the FP8 tensor cores (W4A8), for activations already rounded to FP8.

With the official quantisation simulation (``quant_sim``) the MoE input is ``act_quant_sim(x, 128)``: every 1×128
block of a row is an e4m3 value times a power of two. ``act_quant_fp8`` turns it back into those e4m3 codes and
scales without loss. The weights follow the official converter (``cast_e2m1fn_to_e4m3fn``, MODEL_V4.md §4.2): per
weight row and 128 columns, with ``smax`` the largest of the 4 e8m0 exponents and ``d = smax - s`` per 32-column
group, a code ``v · 2^(s - 127)`` becomes the e4m3 ``v · 2^(6 - d)`` and the block scale ``2^(smax - 133)``. Every
such cast is exact while ``d <= 11`` (``e4m3`` keeps the smallest code 0.5 · 2^-5 normal) and ``7 <= s``
(``w4a8_ready``). So each product of the GEMM is the W4A16 kernel's product, and only the order and the precision of
the accumulation differ: the FP8 MMA sums 128 columns, and the fp32 accumulator takes each 128-column partial scaled
by ``2^(smax - 133) · s_x`` (DeepSeek's fp8 GEMM promotion).

The epilogue is ``moe_mxfp4``'s: gate and up rounded to ``x.dtype``, SwiGLU with the clamp, times the routing
weight, into ``h`` for the unchanged down projection (its input is not FP8-rounded by the model). On CUDA the
code-to-e4m3 cast is PTX (``_E2M1_E4M3_ASM``); in Triton's interpreter (and with ``CAST_PTX`` off) plain Triton,
the same bytes. Its speed on a GPU is still to be measured, so ``moe_mxfp4`` takes this path only when asked
(``act_fp8`` and ``W4A8``).
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.moe_mxfp4_gemm import _scales, _swiglu_rows
from deepinfer.kernels.pdl import pdl_wait

MAX_SPREAD = 11  # d = smax - s within a row's 128 columns: the cast stays exact (module docstring)
MIN_EXP = 7  # the block scale 2^(smax - 133) stays a normal fp32
CAST_PTX = True  # on CUDA: cast the codes with _E2M1_E4M3_ASM (False: the plain Triton cast; benchmarks)

# 8 e2m1 codes (one 32-bit word, $2) → their e4m3 bytes lowered by d (d in every byte of $3): codes 2i in $0 and
# 2i+1 in $1 (byte i each). Byte lookups (prmt) of the magnitudes' e4m3 at d = 0 (0, 0.5·2^6, ..., 6·2^6) and of a
# nonzero mask, d·8 taken off the nonzero bytes' exponents (no borrow: each is ≥ 0x60, d·8 ≤ 0x58), the sign by a
# sign-replicating lookup, then the bytes reordered to codes 0, 2, 4, 6 / 1, 3, 5, 7 (the last two selectors: they
# depend on the nibble order).
_E2M1_E4M3_ASM = """{{
.reg .b32 m, mh, l0, l1, z0, z1, dd, s0, s1, qh;
and.b32 m, $2, 0x77777777;
shr.u32 mh, m, 16;
shl.b32 dd, $3, 3;
prmt.b32 l0, 0x6C686000, 0x7C787470, m;
prmt.b32 l1, 0x6C686000, 0x7C787470, mh;
prmt.b32 z0, 0xFFFFFF00, 0xFFFFFFFF, m;
prmt.b32 z1, 0xFFFFFF00, 0xFFFFFFFF, mh;
and.b32 z0, z0, dd;
and.b32 z1, z1, dd;
sub.u32 l0, l0, z0;
sub.u32 l1, l1, z1;
shr.u32 qh, $2, 16;
prmt.b32 s0, 0x80808080, 0x80808080, $2;
prmt.b32 s1, 0x80808080, 0x80808080, qh;
and.b32 s0, s0, 0x7F7F7F7F;
and.b32 s1, s1, 0x7F7F7F7F;
add.u32 s0, s0, 0x01010101;
add.u32 s1, s1, 0x01010101;
and.b32 s0, s0, 0x80808080;
and.b32 s1, s1, 0x80808080;
or.b32 l0, l0, s0;
or.b32 l1, l1, s1;
prmt.b32 $0, l0, l1, {};
prmt.b32 $1, l0, l1, {};
}}"""
_CAST_PLAIN = tl.constexpr(_E2M1_E4M3_ASM.format("0x6420", "0x7531"))  # code v in nibble v
_CAST_SHIFT = tl.constexpr(_E2M1_E4M3_ASM.format("0x0123", "0x4567"))  # codes 0..7 in nibbles 3 7 2 6 1 5 0 4
_READY: dict[int, tuple[weakref.ref, int, bool]] = {}  # id(s) -> (s, its version, the answer)


def w4a8_ready(s: torch.Tensor) -> bool:
    """Whether the e8m0 exponents ``s [E, N, K/32]`` allow the exact cast: ``K/32`` a multiple of 4, every exponent
    at least ``MIN_EXP``, and within each row's 4-exponent groups at most ``MAX_SPREAD`` apart. Read once per tensor
    version (one device sync) and remembered: pass the weight's own tensor, not a fresh view of it."""
    ref, version, ok = _READY.get(id(s), (None, -1, False))
    if ref is not None and ref() is s and version == s._version:
        return ok
    ok = s.dim() == 3 and s.shape[-1] % 4 == 0
    if ok and s.numel():
        g = s.view(torch.uint8).reshape(*s.shape[:-1], -1, 4).int()
        spread = g.amax(dim=-1) - g.amin(dim=-1)
        ok = bool((g.amin() >= MIN_EXP).item()) and bool((spread.amax() <= MAX_SPREAD).item())
    if len(_READY) > 1024:
        _READY.clear()
    _READY[id(s)] = (weakref.ref(s), s._version, ok)
    return ok


@triton.jit
def _e4m3_tile(w_ptr, s_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
               SHIFT: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """The weight rows ``rn``, columns ``2·kb0 ..+ 128``, cast to e4m3 as the module docstring says: ``[BLOCK_N,
    128]`` e4m3 and the rows' block scales ``2^(smax - 133)`` ``[BLOCK_N]`` fp32. ``FAST``: the PTX cast, a word of
    8 codes per call, reading the row's bytes (``w_ptr`` viewed as bytes: ``stride_wn`` counts words)."""
    s, _ = _scales(s_ptr, sbase, rn, mask_n, kb0, KH, stride_sn, 4, True)  # [BLOCK_N, 4, 1] int32
    smax = tl.max(s, axis=1)  # [BLOCK_N, 1]
    scale = ((tl.reshape(smax, (BLOCK_N,)) - 6) << 23).to(tl.float32, bitcast=True)  # 2^(smax - 133)
    if FAST:
        kb = kb0 + tl.arange(0, 64)  # the 64 bytes: 4 groups of 16
        qb = tl.load(w_ptr.to(tl.pointer_type(tl.uint8)) + 4 * wbase + rn[:, None].to(tl.int64) * (4 * stride_wn)
                     + kb[None, :], mask=mask_n[:, None], other=0)  # fmt: skip
        db = tl.reshape(tl.broadcast_to(smax[:, None, :] - s, (BLOCK_N, 4, 16)), (BLOCK_N, 64)).to(tl.uint8)
        asm: tl.constexpr = _CAST_SHIFT if SHIFT else _CAST_PLAIN
        lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,r,r", [qb, db], dtype=(tl.uint8, tl.uint8), is_pure=True,
                                           pack=4)  # fmt: skip
        w8 = tl.reshape(tl.join(lo, hi), (BLOCK_N, 128)).to(tl.float8e4nv, bitcast=True)
        return w8, scale
    d = (smax[:, None, :] - s)[:, :, :, None]  # [BLOCK_N, 4, 1, 1]
    kw = kb0 // 4 + tl.arange(0, 4)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, 4, 4] words
    q = tl.load(w_ptr + wbase + rn[:, None, None].to(tl.int64) * stride_wn + kw, mask=mask_n[:, None, None], other=0)
    v = tl.arange(0, 8)
    if SHIFT:  # code v sits in nibble SHIFT_ORDER.index(v) (quant.nibble_order)
        v = 4 * (v & 1) + 3 - 2 * ((v >> 2) & 1) - ((v >> 1) & 1)
    c = (q[:, :, :, None] >> (4 * v)[None, None, None, :]) & 0xF  # [BLOCK_N, 4, 4, 8]
    mag = c & 7
    byte = ((((mag >> 1) + 12 - d) << 3) | ((mag & 1) << 2)) & 0x7F  # e2m1 normal: exponent e - 1, mantissa m
    byte = tl.where(mag == 1, ((12 - d) << 3) & 0x7F, byte)  # 0.5: exponent -1, mantissa 0
    byte = tl.where(mag == 0, 0, byte) | ((c & 8) << 4)  # zero; the sign to bit 7
    w8 = tl.reshape(byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True), (BLOCK_N, 128))
    return w8, scale


@triton.jit(do_not_specialize=["TK", "E"])
def _w4a8_gate_up_kernel(xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, rw_ptr, slots_ptr, bexp_ptr, h_ptr, TK, E,
                         N, KH, stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_hm, limit,
                         TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHIFT: tl.constexpr,
                         SWAP: tl.constexpr, DT: tl.constexpr, SALIGN: tl.constexpr, FAST: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    stride_sn = stride_sn * SALIGN  # passed divided by SALIGN (moe_mxfp4_split.scale_align)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < TK
        tok = (slot // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        wbase = e.to(tl.int64) * stride_we
        sbase = e.to(tl.int64) * stride_se
        shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        acc_g = tl.zeros(shape, dtype=tl.float32)
        acc_u = tl.zeros(shape, dtype=tl.float32)
        kk = tl.arange(0, 128)
        for kb0 in range(0, KH, 64):  # 64 bytes of a weight row: 128 columns, one activation scale block
            a = tl.load(xq_ptr + tok[:, None] * stride_xm + 2 * kb0 + kk[None, :], mask=valid[:, None], other=0.0)
            sa = tl.load(xs_ptr + tok * stride_xs + kb0 // 64, mask=valid, other=0.0)
            wg, sg = _e4m3_tile(w1_ptr, s1_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, BLOCK_N, SHIFT,
                                FAST)  # fmt: skip
            wu, su = _e4m3_tile(w3_ptr, s3_ptr, wbase, sbase, rn, mask_n, kb0, KH, stride_wn, stride_sn, BLOCK_N, SHIFT,
                                FAST)  # fmt: skip
            if SWAP:  # the weight rows on the MMA's M side
                acc_g += tl.dot(wg, tl.trans(a)) * (sg[:, None] * sa[None, :])
                acc_u += tl.dot(wu, tl.trans(a)) * (su[:, None] * sa[None, :])
            else:
                acc_g += tl.dot(a, tl.trans(wg)) * (sa[:, None] * sg[None, :])
                acc_u += tl.dot(a, tl.trans(wu)) * (sa[:, None] * su[None, :])
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        _swiglu_rows(acc_g, acc_u, slot, valid, rn, mask_n, rw_ptr, h_ptr, stride_hm, limit, DT)


def gate_up_w4a8(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                 rw: torch.Tensor, slots: torch.Tensor, bexp: torch.Tensor, h: torch.Tensor, topk: int, limit: float,
                 meta: dict, launch: dict) -> None:  # fmt: skip
    """Gate/up with the weighted SwiGLU into ``h [T·k, I]`` on the FP8 tensor cores. ``x [T, D]`` holds FP8-rounded
    values (``act_quant_sim(·, 128)``); ``w1``/``w3`` the words ``[E, I, D/8]`` int32, ``s1``/``s3`` the exponents
    as ``uint8`` (``w4a8_ready``); ``meta``/``launch``: ``moe_mxfp4``'s constexprs and launch options (its
    ``BLOCK_K`` is ignored: a step is one 128-column scale block)."""
    from deepinfer.kernels.fp8_quant import act_quant_fp8
    from deepinfer.kernels.moe_mxfp4_split import scale_align

    fast = x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"  # inline PTX: not in the interpreter
    xq, xs = act_quant_fp8(x, 128)
    tk, n = h.shape
    kh = x.shape[1] // 2
    _w4a8_gate_up_kernel[(bexp.numel(), triton.cdiv(n, meta["BLOCK_N"]))](
        xq, xs, w1, s1, w3, s3, rw, slots, bexp, h, tk, s1.shape[0], n, kh,
        xq.stride(0), xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1) // scale_align(s1),
        h.stride(0), float(limit), TOPK=topk, BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], SHIFT=meta["SHIFT"],
        SWAP=meta["SWAP"], DT=meta["DT"], SALIGN=scale_align(s1), FAST=CAST_PTX and fast, **launch, **pdl.launch(),
    )  # fmt: skip


__all__ = ["CAST_PTX", "MAX_SPREAD", "MIN_EXP", "gate_up_w4a8", "w4a8_ready"]
