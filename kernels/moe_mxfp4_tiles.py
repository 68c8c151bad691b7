"""The Gluon building blocks (sm_90) of the prefill MXFP4 expert kernels: ``kernels.moe_mxfp4_wgmma``'s kernel and
its warp-specialised variant ``kernels.moe_mxfp4_ws`` (and ``kernels.moe_mxfp4_frag``'s epilogue) share them. See
``kernels.moe_mxfp4_wgmma`` for the tiles, the ring of ``cp.async`` copies and the epilogue. ``HAVE_GLUON``: whether
this Triton build has Gluon's Hopper module; the kernels exist only where it does.
"""

from __future__ import annotations

try:  # Gluon's Hopper module (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,  # noqa: F401  (the kernels built on these use it: part of HAVE_GLUON's check)
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

from deepinfer.kernels.moe_mxfp4_gemm import E2M1_ROTATE_ASM

if HAVE_GLUON:

    @gluon.jit
    def decode(q, s):
        """Words ``q [R, B, 4]`` (rotate order; B blocks of 32 columns) and their blocks' exponents ``s [R, B, 1]``
        (int32) → the bf16 tile ``[R, 32·B]``, each word's 8 codes in column order."""
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            E2M1_ROTATE_ASM, "=r,=r,=r,=r,r,r", [q, gl.broadcast((s + 126) * 0x800080, q)[0]], dtype=(gl.int32,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
        p = gl.join(gl.join(p0, p2), gl.join(p1, p3))  # [R, B, 4, 2, 2]: a word's pair 2i + j at [..., i, j]
        lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.join(lo, hi)
        return gl.reshape(w, (q.shape[0], 32 * q.shape[1]))

    @gluon.jit
    def issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW: gl.constexpr, step, a_smem, w_smem, v_smem, slot,
              AL: gl.constexpr, WL: gl.constexpr, TWO: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
        """``cp.async`` of step ``step``'s activation columns and weight words into ring slot ``slot``."""
        kk = step * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, AL))
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptr + arow[:, None] * stride_am + kk[None, :])
        kw = step * (BLOCK_K // 8) + gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, WL))
        off = wrow[:, None] * KW + kw[None, :]
        async_copy.async_copy_global_to_shared(w_smem.index(slot), w_ptr + off)
        if TWO:
            async_copy.async_copy_global_to_shared(v_smem.index(slot), v_ptr + off)

    @gluon.jit
    def step_scales(s_ptr, srow, KS: gl.constexpr, step, SL: gl.constexpr, BLOCK_K: gl.constexpr):
        """The exponents of step ``step``'s blocks, ``[BLOCK_N, BLOCK_K/32, 1]`` int32 (one a thread: its words')."""
        kb = step * (BLOCK_K // 32) + gl.arange(0, BLOCK_K // 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        return gl.load(s_ptr + srow[:, None, None] * KS + kb[None, :, None]).to(gl.int32)

    @gluon.jit
    def scale_group(s_ptr, srow, KS: gl.constexpr, group, SL: gl.constexpr, WPL: gl.constexpr):
        """Words ``group·WPL ..+ WPL`` of each row's exponents (a word: the 4 blocks of 2 K steps) by one
        ``4·WPL``-byte load a thread: ``[BLOCK_N, BLOCK_K/32, WPL]`` int32 in ``SL`` (the threads of a row's two
        blocks load the same words; a byte a step per thread was 2 of every 32 bytes of its sector)."""
        s32 = s_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        w = gl.arange(0, WPL, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        off = srow[:, None, None] * (KS // 4) + group * WPL + w[None, None, :] + 0 * j[None, :, None]
        return gl.load(s32 + off)

    @gluon.jit
    def scale_of(words, step, SL: gl.constexpr, WPL: gl.constexpr):
        """Step ``step``'s exponents ``[BLOCK_N, 2, 1]`` int32 in ``SL`` (``step_scales``') from its group's words."""
        w = gl.arange(0, WPL, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        word = gl.sum(gl.where(w[None, None, :] == (step % (2 * WPL)) // 2, words, 0), axis=2)
        byte = (word >> (8 * ((step % 2) * 2 + j))[None, :]) & 0xFF
        return gl.expand_dims(byte, 2)

    @gluon.jit
    def mma(tw, tv, act, acc_w, acc_v, TWO: gl.constexpr, PENDING: gl.constexpr):
        """``acc_w += tw · act`` (and ``acc_v += tv · act``) issued asynchronously; then wait until ``PENDING`` steps'
        MMAs at most are in flight."""
        acc_w = warpgroup_mma(tw, act, acc_w, is_async=True)
        if TWO:
            acc_v = warpgroup_mma(tv, act, acc_v, is_async=True)
            acc_w, acc_v = warpgroup_mma_wait(num_outstanding=2 * PENDING, deps=(acc_w, acc_v))
        else:
            acc_w = warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc_w,))
        return acc_w, acc_v

    @gluon.jit
    def drain(acc_w, acc_v, TWO: gl.constexpr):
        """Wait for every MMA in flight."""
        if TWO:
            acc_w, acc_v = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w, acc_v))
        else:
            acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w,))
        return acc_w, acc_v

    @gluon.jit
    def swiglu_tile(acc_w, acc_v, slots_ptr, rw_ptr, pid_m, TK, limit, BLOCK_M: gl.constexpr):
        """The gate and up accumulators ``[rows, BLOCK_M]`` rounded to bf16, the clamped SwiGLU times each slot's
        routing weight (padding slots 0), fp32."""
        g = acc_w.to(gl.bfloat16).to(gl.float32)
        u = acc_v.to(gl.bfloat16).to(gl.float32)
        g = gl.minimum(g, limit)
        u = gl.minimum(gl.maximum(u, -limit), limit)
        y = g / (1.0 + gl.exp(-g)) * u
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_w.type.layout))
        slot_c = gl.load(slots_ptr + pid_m * BLOCK_M + rows)
        rw = gl.load(rw_ptr + slot_c, mask=slot_c < TK, other=0.0)
        return y * rw[None, :]

    @gluon.jit
    def store(y, slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """``y [BLOCK_N, BLOCK_M]`` bf16 (an MMA layout of 8 warps) → columns ``n0 ..< n0 + BLOCK_N`` of the slots'
        rows of ``o``, transposed through shared memory so that each thread stores 16 contiguous bytes."""
        OL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
        out = gl.convert_layout(gl.permute(y, (1, 0)), OL)
        slot_o = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OL)))
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OL))
        o_off = slot_o.to(gl.int64)[:, None] * stride_om + rn[None, :]
        gl.store(o_ptr + o_off, out, mask=(slot_o < TK)[:, None] & (rn < N)[None, :])

    @gluon.jit
    def epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """The accumulators ``[BLOCK_N, BLOCK_M]`` (the MMA layout of 8 warps) → the slots' rows of ``o``: gate/up
        (``TWO``) rounded to bf16, the clamped SwiGLU times the slot's routing weight; down rounded to bf16."""
        if TWO:
            y = swiglu_tile(acc_w, acc_v, slots_ptr, rw_ptr, pid_m, TK, limit, BLOCK_M)
        else:
            y = acc_w
        store(y.to(gl.bfloat16), slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M, BLOCK_N)


__all__ = ["HAVE_GLUON"]
