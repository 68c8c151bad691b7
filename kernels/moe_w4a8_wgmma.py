"""The prefill MXFP4 expert GEMMs on Hopper's FP8 tensor cores (W4A8) in Gluon: ``moe_mxfp4(act_quant=True)``'s
products, the official expert numerics (docs/deepseek_v4.md, "MXFP4 routed experts": FP8 activations in 1x128
blocks, the FP4 weights cast to FP8 in the kernel).

Semantics. The activations come as e4m3 values ``q`` with a power-of-two scale per row and 128 columns
(``act_quant_fp8``: ``q · s`` is ``act_quant_sim``'s rounding, exactly). A weight row's codes are cast to e4m3 against
the row's reference exponent ``r`` (``quant.w4a8.row_refs``: the largest exponent of the row's non-zero blocks): the
code ``v`` of a block with exponent ``s`` becomes the e4m3 ``v · 2^(6 + s - r)``, exact while ``s >= r - 11`` (0.5
stays a normal e4m3), and the row's scale is ``2^(r - 133)``. Every product is then the W4A16 kernels' product on the
rounded activations, and the sums differ only in order and in the FP8 MMA's own precision within 128 columns: each
128-column partial sum leaves the MMA and is scaled by the rows' activation scales into an fp32 accumulator
(``acc += part · s_x``, DeepGEMM's promotion); the weight rows' scales multiply once, in the epilogue. The gate/up
epilogue is ``moe_mxfp4_wgmma``'s (gate and up rounded to bf16, the clamped SwiGLU times the routing weight, bf16);
down rounds each slot's row to bf16.

One program: ``BLOCK_M = 128`` slots of one expert (the MMA's M: two warpgroups of 64 slots, so each thread's
promotion takes two activation scales) × ``BLOCK_N`` weight rows (64 for gate/up: two accumulators and two partials
of 64×64 a warpgroup; 128 for down), 8 warps, 128 columns a K step:

* everything a step reads comes by ``cp.async`` into a ring of ``STAGES`` slots, ``STAGES - 1`` steps ahead: the
  slots' e4m3 columns and their scales, the weight words (codes as stored, ``quant.formats``) and the weight rows'
  exponents (one 32-bit word a row a step). A value loaded into registers a step ahead instead is waited for where
  the loop carries it over (a register move at the back edge: a third of the stall samples on an H200, and
  4970 → 3675 µs for the V4-Flash layer below once the scales came through the ring);
* per step: the next step's words and exponents are read from shared memory, this step's MMAs are issued
  (asynchronous ``wgmma`` into the partials, both operands from shared memory), the words are decoded (a PTX block:
  8 codes → 8 e4m3 bytes by byte lookups in a table shifted by the block's ``s - r``, the signs by two more lookups:
  ``_E2M1_E4M3_ASM``) into the other tile buffer (stored as int32 words, read by ``wgmma`` as e4m3 through the same
  128-byte swizzle), the copies of ``STAGES - 1`` steps ahead are issued, and then each warpgroup waits for its MMAs,
  promotes, waits for the copies of the step after next and meets the other warps at a barrier.

On an H200 a V4-Flash MoE layer at 4096 tokens takes 3470-3570 µs against 3540-3560 for the W4A16 Gluon kernels
(``kernels.moe_mxfp4_wgmma``) and 3650 for those on the same rounded activations (``bench/kernels/moe_w4a8.py``): about
level, 24% of the FP8 peak. What holds it there is no longer a single stall (the samples spread over the shared
memory loads of the words, the barriers and the promotion); the FP8 MMA's rate itself is far from used.

Needs CUDA, sm_90, Triton with Gluon's Hopper module, weight rows a multiple of ``BLOCK_N`` and K a multiple of 128
(``fits``). Gluon kernels do not run in Triton's interpreter: their tests run on a GPU only
(``tests/kernels/test_moe_w4a8.py``).
"""

from __future__ import annotations

import torch

from deepinfer.kernels.moe_mxfp4_wgmma import HAVE_GLUON, available

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

BLOCK_M = 128  # slots a program (the MMA's M: two warpgroups)
BLOCK_N_GATE_UP = 64  # weight rows a gate/up program (two accumulators and two partials a thread: 4 x 32 registers)
BLOCK_N_DOWN = 128  # weight rows a down program (one accumulator and one partial: 2 x 64 registers)
BLOCK_K = 128  # columns a K step: one activation scale block, 4 MXFP4 blocks, one 128-byte e4m3 row
# H200, 4096 tokens (bench/kernels/moe_w4a8.py --stages): 4, 5 and 6 within 3% (3: 25% slower, earlier layout)
STAGES = 5
NUM_WARPS = 8

# 8 e2m1 codes (the word $2: code i in nibble i, bit 3 the sign) → 8 e4m3 bytes, $0 codes 0..3 and $1 codes 4..7,
# each the code's value times 2^(6 + d); $3 / $4: the table of the magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6 times
# 2^(6 + d), e4m3 bytes (00 60 68 6C | 70 74 78 7C) + 8·d on each non-zero byte (``_table``). The signs: nibble i's
# bit 3 is word bit 4i+3; bytes of the word and of the word << 4 hold them on bit 7 (code 0: byte 0 of w << 4,
# code 1: byte 0 of w, code 2: byte 1 of w << 4, ...).
_E2M1_E4M3_ASM = """{
.reg .b32 m, mh, q4, g0, g1;
and.b32 m, $2, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 $0, $3, $4, m;
prmt.b32 $1, $3, $4, mh;
shl.b32 q4, $2, 4;
prmt.b32 g0, $2, q4, 0x1504;
prmt.b32 g1, $2, q4, 0x3726;
and.b32 g0, g0, 0x80808080;
and.b32 g1, g1, 0x80808080;
or.b32 $0, $0, g0;
or.b32 $1, $1, g1;
}"""


def fits(n: int, k: int, two: bool) -> bool:
    """Whether a GEMM of ``n`` weight rows over ``k`` columns is made of whole tiles, two K steps at least (Triton
    3.6's lowering asserts on a one-step loop's fully contiguous word copies)."""
    return n % (BLOCK_N_GATE_UP if two else BLOCK_N_DOWN) == 0 and k % BLOCK_K == 0 and k >= 2 * BLOCK_K


if HAVE_GLUON:
    _ASM = gl.constexpr(_E2M1_E4M3_ASM)

    @gluon.jit
    def _table(s, r):
        """The byte tables (``_E2M1_E4M3_ASM``'s $3, $4) of blocks with exponents ``s`` in rows of reference ``r``."""
        d = gl.minimum(gl.maximum(s - r, -11), 0)  # quant.w4a8.MIN_SHIFT: lower only in all-zero blocks
        return 0x6C686000 + d * 0x08080800, 0x7C787470 + d * 0x08080808

    @gluon.jit
    def _decode(q, t0, t1):
        """Words ``q [R, 4, 4]`` (a block's 4 words per ``[r, b]``) → the e4m3 bytes as int32 ``[R, 32]``, in column
        order (word ``j`` of block ``b`` gives int32 columns ``8b + 2j`` and ``8b + 2j + 1``)."""
        lo, hi = gl.inline_asm_elementwise(
            _ASM, "=r,=r,r,r,r", [q, gl.broadcast(t0, q)[0], gl.broadcast(t1, q)[0]],
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
        )  # fmt: skip
        return gl.reshape(gl.join(lo, hi), (q.shape[0], 32))

    @gluon.jit
    def _issue(a_ptr, arow, stride_am, as_ptr, srow, stride_as, w_ptr, v_ptr, woff, s_ptr, t_ptr, eoff,
               K: gl.constexpr, step, a_smem, sa_smem, w_smem, v_smem, e_smem, f_smem, slot, AL: gl.constexpr,
               TWO: gl.constexpr):  # fmt: skip
        """``cp.async`` of step ``step``'s activation columns and scales, weight words and the weight rows'
        exponents (4 bytes a row) into ring slot ``slot``: everything a step reads comes through the ring (a value
        loaded into registers a step ahead is waited for where the loop carries it over)."""
        kk = step * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, AL))
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptr + arow[:, None] * stride_am + kk[None, :])
        async_copy.async_copy_global_to_shared(sa_smem.index(slot), as_ptr + srow * stride_as + step)
        async_copy.async_copy_global_to_shared(w_smem.index(slot), w_ptr + woff + step * 16)
        s32 = s_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        async_copy.async_copy_global_to_shared(e_smem.index(slot), s32 + eoff + step)
        if TWO:
            async_copy.async_copy_global_to_shared(v_smem.index(slot), v_ptr + woff + step * 16)
            t32 = t_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
            async_copy.async_copy_global_to_shared(f_smem.index(slot), t32 + eoff + step)

    @gluon.jit
    def _words(w_smem, e_smem, slot, DL: gl.constexpr, EL: gl.constexpr, BLOCK_N: gl.constexpr):
        """Ring slot ``slot``'s words ``[BLOCK_N, 4, 4]`` and their blocks' exponents ``[BLOCK_N, 4, 1]`` (int32)."""
        s = e_smem.index(slot)._reinterpret(gl.uint8, [BLOCK_N, 4], EL).load(gl.SliceLayout(2, DL))
        return w_smem.index(slot).load(DL), gl.expand_dims(s.to(gl.int32), 2)

    @gluon.jit
    def _tile(q, s, ref, tile):
        """Words ``q`` with their blocks' exponents ``s`` decoded into the e4m3 tile ``tile`` (an int32 view)."""
        t0, t1 = _table(s, ref)
        tile.store(_decode(q, t0, t1))

    @gluon.jit
    def _w4a8_kernel(a_ptr, as_ptr, w_ptr, s_ptr, r_ptr, v_ptr, t_ptr, u_ptr, rw_ptr, slots_ptr, bexp_ptr, o_ptr, TK,
                     E, N, stride_am, stride_as, stride_om, limit, K: gl.constexpr, TOPK: gl.constexpr,
                     TWO: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):  # fmt: skip
        gl.static_assert(gl.num_warps() == 8)
        # the activation copies: 16 bytes a thread, 8 threads a 128-byte row
        AL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
        # the words [BLOCK_N, 4 blocks, 4 words]: a thread copies and decodes one block's 4 words (16 bytes)
        DL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [8, 1, 1], [2, 1, 0])
        RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, DL))  # a row index of DL
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BLOCK_N, 32])  # fmt: skip
        ACT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        TILE8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        TILE32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        WORDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        # the scales' and exponents' copies: 4 bytes a thread (one activation row's scale, one weight row's word)
        CL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 8], [1, 0])
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        EL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        pid_n = gl.program_id(0)  # the weight tiles of one slot block run side by side: its rows stay in L2
        pid_m = gl.program_id(1)
        e = gl.load(bexp_ptr + pid_m)
        if e < E:
            nk: gl.constexpr = K // 128
            slot_a = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, AL)))
            if TWO:
                arow = gl.where(slot_a < TK, slot_a // TOPK, 0).to(gl.int64)  # padding reads row 0; never stored
            else:
                arow = gl.where(slot_a < TK, slot_a, 0).to(gl.int64)
            slot_c = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, CL)))
            if TWO:
                prow_c = gl.where(slot_c < TK, slot_c // TOPK, 0).to(gl.int64)
            else:
                prow_c = gl.where(slot_c < TK, slot_c, 0).to(gl.int64)
            n0 = pid_n * BLOCK_N
            rows = (e * N + n0 + gl.arange(0, BLOCK_N, layout=RL)).to(gl.int64)
            blk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, DL)))
            wd = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, DL)))
            woff = rows[:, None, None] * (K // 8) + blk[None, :, None] * 4 + wd[None, None, :]
            erow = (e * N + n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CL))).to(gl.int64)
            eoff = erow * (K // 128)  # a row's 4 exponents of a step: one 32-bit word
            srow = prow_c
            ref_w = gl.load(r_ptr + rows)[:, None, None]
            ref_v = ref_w
            if TWO:
                ref_v = gl.load(u_ptr + rows)[:, None, None]

            a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], ACT)
            sa_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], FLAT)
            w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 4, 4], WORDS)
            e_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], FLAT)
            tw = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 32], TILE32)
            v_smem = w_smem
            f_smem = e_smem
            tv = tw
            if TWO:
                v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 4, 4], WORDS)
                f_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], FLAT)
                tv = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 32], TILE32)

            for i in gl.static_range(STAGES - 1):
                if i < nk:
                    _issue(a_ptr, arow, stride_am, as_ptr, srow, stride_as, w_ptr, v_ptr, woff, s_ptr, t_ptr, eoff, K,
                           i, a_smem, sa_smem, w_smem, v_smem, e_smem, f_smem, i, AL, TWO)  # fmt: skip
                async_copy.commit_group()
            async_copy.wait_group(STAGES - 2)  # step 0's copies
            gl.thread_barrier()  # the exponents were copied by other threads than those that decode with them
            qw, sw = _words(w_smem, e_smem, 0, DL, EL, BLOCK_N)
            _tile(qw, sw, ref_w, tw.index(0))
            if TWO:
                qv, sv = _words(v_smem, f_smem, 0, DL, EL, BLOCK_N)
                _tile(qv, sv, ref_v, tv.index(0))
            fence_async_shared()
            async_copy.wait_group(STAGES - 3)  # step 1's
            gl.thread_barrier()

            acc_w = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
            acc_v = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
            part_w = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
            part_v = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
            for step in range(nk):
                ring = step % STAGES
                buf = step % 2
                nxt = (step + 1) % STAGES
                # the next step's words from shared memory before this step's MMAs are issued: the loads' latency
                # passes while they are (its copies were waited for before the barrier that ended the last step)
                qw, sw = _words(w_smem, e_smem, nxt, DL, EL, BLOCK_N)
                qv, sv = qw, sw
                if TWO:
                    qv, sv = _words(v_smem, f_smem, nxt, DL, EL, BLOCK_N)
                act = a_smem.index(ring)
                bw = tw.index(buf)._reinterpret(gl.float8e4nv, [BLOCK_N, 128], TILE8).permute((1, 0))
                part_w = warpgroup_mma(act, bw, part_w, use_acc=False, is_async=True)
                if TWO:
                    bv = tv.index(buf)._reinterpret(gl.float8e4nv, [BLOCK_N, 128], TILE8).permute((1, 0))
                    part_v = warpgroup_mma(act, bv, part_v, use_acc=False, is_async=True)
                if step + 1 < nk:
                    _tile(qw, sw, ref_w, tw.index(1 - buf))
                    if TWO:
                        _tile(qv, sv, ref_v, tv.index(1 - buf))
                fence_async_shared()
                ahead = step + STAGES - 1  # into the slot of step - 1, whose MMAs every warpgroup has waited for
                if ahead < nk:
                    _issue(a_ptr, arow, stride_am, as_ptr, srow, stride_as, w_ptr, v_ptr, woff, s_ptr, t_ptr, eoff,
                           K, ahead, a_smem, sa_smem, w_smem, v_smem, e_smem, f_smem, ahead % STAGES, AL,
                           TWO)  # fmt: skip
                async_copy.commit_group()
                sa = sa_smem.index(ring).load(gl.SliceLayout(1, MMA))
                if TWO:
                    part_w, part_v = warpgroup_mma_wait(num_outstanding=0, deps=(part_w, part_v))
                    acc_v = gl.fma(part_v, sa[:, None], acc_v)
                else:
                    part_w = warpgroup_mma_wait(num_outstanding=0, deps=(part_w,))
                acc_w = gl.fma(part_w, sa[:, None], acc_w)
                async_copy.wait_group(STAGES - 3)  # step + 2's copies, for the next step's words
                gl.thread_barrier()  # the next tiles written; every warpgroup past this step's MMAs
            async_copy.wait_group(0)
            _epilogue(acc_w, acc_v, r_ptr, u_ptr, slots_ptr, rw_ptr, o_ptr, pid_m, e * N + n0, n0, TK, N, stride_om,
                      limit, TWO, BLOCK_M, BLOCK_N)  # fmt: skip

    @gluon.jit
    def _epilogue(acc_w, acc_v, r_ptr, u_ptr, slots_ptr, rw_ptr, o_ptr, pid_m, row0, n0, TK, N, stride_om, limit,
                  TWO: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """The accumulators ``[BLOCK_M, BLOCK_N]`` times the weight rows' scales ``2^(r - 133)`` → the slots' rows of
        ``o``, 16 contiguous bytes a thread: gate/up (``TWO``) rounded to bf16, the clamped SwiGLU times the slot's
        routing weight; down rounded to bf16."""
        ML: gl.constexpr = acc_w.type.layout
        cn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ML))
        sw = ((gl.load(r_ptr + row0 + cn).to(gl.int32) - 6) << 23).to(gl.float32, bitcast=True)
        if TWO:
            sv = ((gl.load(u_ptr + row0 + cn).to(gl.int32) - 6) << 23).to(gl.float32, bitcast=True)
            g = (acc_w * sw[None, :]).to(gl.bfloat16).to(gl.float32)
            u = (acc_v * sv[None, :]).to(gl.bfloat16).to(gl.float32)
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
            y = g / (1.0 + gl.exp(-g)) * u
            rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ML))
            slot_c = gl.load(slots_ptr + pid_m * BLOCK_M + rm)
            rw = gl.load(rw_ptr + slot_c, mask=slot_c < TK, other=0.0)
            y = y * rw[:, None]
        else:
            y = acc_w * sw[None, :]
        OL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [8, 1], [1, 0])
        out = gl.convert_layout(y.to(gl.bfloat16), OL)
        slot_o = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OL)))
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OL))
        o_off = slot_o.to(gl.int64)[:, None] * stride_om + rn[None, :]
        gl.store(o_ptr + o_off, out, mask=(slot_o < TK)[:, None] & (rn < N)[None, :])


def _launch(a, sa, w, s, r, v, t, u, rw, slots, bexp, o, tk: int, e: int, n: int, k: int, limit: float, topk: int,
            two: bool) -> None:  # fmt: skip
    block_n = BLOCK_N_GATE_UP if two else BLOCK_N_DOWN
    grid = (n // block_n, bexp.numel())
    _w4a8_kernel[grid](
        a, sa, w, s, r, v, t, u, rw, slots, bexp, o, tk, e, n, a.stride(0), sa.stride(0), o.stride(0), float(limit),
        K=k, TOPK=topk, TWO=two, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=STAGES, num_warps=NUM_WARPS,
    )  # fmt: skip


def gate_up(xq, xs, w1, s1, r1, w3, s3, r3, rw, slots, bexp, h, topk: int, limit: float) -> None:
    """``h[slot] = silu(min(g, limit)) · clamp(u, ±limit) · rw[slot]`` with ``g``, ``u`` the slot's token row of
    ``xq · xs`` (e4m3 ``[T, D]``, fp32 scales ``[T, D/128]``) against its expert's ``w1`` / ``w3`` rows (int32 words
    ``[E, I, D/8]`` as stored, exponents uint8 ``[E, I, D/32]``, row references int32 ``[E, I]``), each rounded to
    bf16; ``slots``/``bexp`` of ``padded_slots(idx, E, BLOCK_M)``, ``h [T·k, I]`` bf16."""
    e, n, kw = w1.shape
    _launch(xq, xs, w1, s1, r1, w3, s3, r3, rw, slots, bexp, h, h.shape[0], e, n, 8 * kw, limit, topk, True)


def down(hq, hs, w2, s2, r2, slots, bexp, o) -> None:
    """``o[slot] = (hq · hs)[slot] · w2ᵀ`` in bf16 for every slot of the blocks (``w2`` words ``[E, D, I/8]``)."""
    e, n, kw = w2.shape
    _launch(hq, hs, w2, s2, r2, w2, s2, r2, o, slots, bexp, o, o.shape[0], e, n, 8 * kw, 0.0, 1, False)


def runs_on(device: torch.device) -> bool:
    """Whether these kernels can run on ``device``: an sm_90 GPU, with Gluon's Hopper module."""
    return HAVE_GLUON and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def usable(x: torch.Tensor, inter: int, d: int) -> bool:
    """Whether the W4A8 kernels take experts ``[E, inter, d]`` for ``x`` (bf16 on an sm_90 GPU with Gluon)."""
    return available(x) and fits(inter, d, True) and fits(d, inter, False)


__all__ = ["BLOCK_M", "down", "fits", "gate_up", "runs_on", "usable"]
