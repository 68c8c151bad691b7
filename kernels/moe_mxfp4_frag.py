"""The prefill MXFP4 expert GEMMs for Hopper with the decoded weights as ``wgmma``'s register operand (Gluon).

Why: ``kernels.moe_mxfp4_wgmma`` decodes each weight tile into shared memory and ``wgmma`` reads it back from there
beside the activation tile. Per K step of a 128 x 128 tile that is 32 KB of decoded weights stored and 32 KB read
again on top of the 64 KB of activation reads, and the shared-memory pipe, not the tensor cores, is the busiest unit
(ncu on the H200: L1/shared 75%, tensor pipe 51%; 3.57 ms for a V4-Flash MoE layer at 4096 tokens, 2.3x its bf16
FLOP roofline; ``bench/results/engine/2026-12-01-s27-prefill.md``). Here each thread decodes exactly the weights of
its own
``wgmma`` A fragment into registers, as CUTLASS's mixed-input GEMMs on Hopper do: no decoded tile in shared memory.

The fragment: a thread of a warpgroup holds, for each 32 columns of its rows ``r`` and ``r + 8``, the MMA columns
``8p + 2q + j`` (``p`` < 4, ``j`` < 2, ``q`` the lane's index in its quad; PTX's A fragment of ``wgmma`` for bf16),
8 columns, which is one word of 8 codes. The weights stay as stored (codes of columns ``8q .. 8q + 7`` in word ``q``
of a 32-column block, in the rotate order of ``quant.nibble_order``, decoded by ``moe_mxfp4_gemm``'s PTX into the
pairs ``p``), so the K order inside each 32-column block is permuted instead on the activations' side: MMA column
``8p + 2q + j`` holds original column ``8q + 2p + j`` (``frag_columns``; a swap of ``p`` and ``q``, its own
inverse). The gate/up GEMM reads a permuted copy of the token rows (``permute_columns``) and writes ``h`` in the
permuted order, which is the order the down GEMM wants for its K; the output ``o`` is in the plain order.

Semantics: those of ``moe_mxfp4_wgmma.gate_up`` / ``down`` (and so of ``moe_mxfp4``'s Triton tiles) on the same
padded slot blocks: every decoded weight is exact in bf16, the products accumulate in fp32; only the order of the
fp32 sums differs (``tests/kernels/test_moe_frag.py`` compares them on a GPU).

One program: ``BLOCK_M`` slots of one expert x ``BLOCK_N`` weight rows of each of two matrices (gate/up: ``w1`` and
``w3`` rows of the same features; down: two tiles of ``w2`` rows, ``down_rows``), 8 warps (two warpgroups of 64 rows
of each), two fp32 accumulators a thread. A ring step is 128 columns, copied ``STAGES - 2`` steps ahead by one
``cp.async`` op a buffer (activation columns, words, the rows' four exponents as a 32-bit word); per step, after the
copies' wait, the proxy fence and a CTA barrier, each thread reads its words and exponents from shared memory, and
for each 64-column half decodes its A fragments, issues the half's ``wgmma`` (A from registers, the activations'
transpose from shared memory) and waits for the half before's, whose fragment registers it held until then
(``warpgroup_mma_wait``'s ``deps``): the decode of a half overlaps the MMAs of the one before. The next step's copies
go out between the halves.

Measured (H200, one V4-Flash MoE layer at 4096 tokens, ``bench/kernels/moe_wgmma.py --frag``; results in
``bench/results/engine/2026-12-02-s29-frag.md``): 3.25-3.36 ms against 3.55-3.61 for the shared-memory kernels, no
spills at 245-255 registers. What remains (ncu source counters, timing probes): the tensor pipe ~60% busy; the
copies cost ~20% (with them left out of the loop the gate/up kernel takes 1.61 instead of 2.00 ms), the decode ~10%,
and the warps wait at the step's barriers for the warpgroup whose MMAs the tensor cores took second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.moe_mxfp4_gemm import E2M1_ROTATE_ASM
from deepinfer.kernels.moe_mxfp4_wgmma import BLOCK_M, HAVE_GLUON  # the same padded slot blocks (the MMA's N)

BLOCK_N = 128  # weight rows a program (the MMA's M: two warpgroups of 64)
STEP_K = 128  # columns a ring step (four MXFP4 scale blocks: a 32-bit word of exponents a row), two MMA halves
STAGES = 4  # the cp.async ring; steps are issued STAGES - 2 ahead
NUM_WARPS = 8
LATE_COPIES = False  # True: a step's copies issued between its halves (measured level with right after the barrier)
DOWN_PAIRS = True  # a down program covers two tiles of weight rows (``down_rows``); False: one (benchmarks)


def frag_columns(k: int) -> torch.Tensor:
    """``perm[m]``: the original column at MMA column ``m`` (``8p + 2q + j`` ← ``8q + 2p + j`` in each 32)."""
    m = torch.arange(k)
    b, p, q, j = m // 32, (m // 8) % 4, (m // 2) % 4, m % 2
    return 32 * b + 8 * q + 2 * p + j


def permute_columns(x: torch.Tensor) -> torch.Tensor:
    """``x[:, frag_columns(k)]`` for ``x [T, K]`` (K a multiple of 32): one Triton pass for contiguous CUDA rows of
    256-column multiples (16-byte loads and stores; torch's strided copy of the same moves 4 bytes at a time), a
    strided torch copy otherwise."""
    t, k = x.shape
    if x.is_cuda and x.is_contiguous() and k % 256 == 0 and t > 0:
        out = torch.empty_like(x)
        _permute_kernel[(triton.cdiv(t, 16), k // 256)](x, out, t, k, BLOCK_T=16, BLOCK_K=256, num_warps=4)
        return out
    return x.reshape(t, k // 32, 4, 4, 2).transpose(2, 3).reshape(t, k)


@triton.jit
def _permute_kernel(x_ptr, out_ptr, T, K, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """A ``[BLOCK_T, BLOCK_K]`` tile of ``permute_columns``: loaded in order, the pair and quad indices of each 32
    columns swapped in registers, stored in order."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    off = rt.to(tl.int64)[:, None] * K + rk[None, :]
    mask = (rt < T)[:, None]
    v = tl.load(x_ptr + off, mask=mask)
    v = tl.reshape(tl.permute(tl.reshape(v, (BLOCK_T, BLOCK_K // 32, 4, 4, 2)), (0, 1, 3, 2, 4)), (BLOCK_T, BLOCK_K))
    tl.store(out_ptr + off, v, mask=mask)


def fits(n: int, k: int) -> bool:
    """Whether a GEMM of ``n`` weight rows over ``k`` columns runs here: whole tiles and steps, at least two."""
    return n % BLOCK_N == 0 and k % STEP_K == 0 and k // STEP_K >= 2


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from deepinfer.kernels.moe_mxfp4_tiles import store, swiglu_tile

    @gluon.jit
    def _frag(q, s, DOT: gl.constexpr):
        """Words ``q [BLOCK_N, 2, 4]`` (rotate order) and their blocks' exponents ``s [BLOCK_N, 2, 1]`` (int32) →
        the A fragment ``[BLOCK_N, 64]`` bf16 in ``DOT``, MMA column ``32b + 8p + 2q + j`` holding the code of
        column ``32b + 8q + 2p + j``."""
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            E2M1_ROTATE_ASM, "=r,=r,=r,=r,r,r", [q, gl.broadcast((s + 126) * 0x800080, q)[0]], dtype=(gl.int32,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
        p = gl.join(gl.join(p0, p2), gl.join(p1, p3))  # [R, 2, 4, 2, 2]: pair 2i + i2 of word q at [r, b, q, i, i2]
        lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.join(lo, hi)  # [R, b, q, i, i2, j]
        w = gl.permute(w, (0, 1, 3, 4, 2, 5))  # [R, b, i, i2, q, j]: column 32b + 8(2i + i2) + 2q + j
        w = gl.reshape(w, (q.shape[0], 64))
        return gl.convert_layout(w, DOT)

    @gluon.jit
    def _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, s_ptr, t_ptr, erow, vrows, KW: gl.constexpr,
               KS: gl.constexpr, step, a_smem, w_smem, v_smem, e_smem, f_smem, slot, AL: gl.constexpr,
               WL: gl.constexpr, TWO: gl.constexpr):  # fmt: skip
        """``cp.async`` of step ``step``'s 128 columns into ring slot ``slot``: the activation columns, the weight
        words, the rows' four exponents as a word; the second matrix's rows (``TWO``) ``vrows`` after the first's.
        One copy op a buffer: Triton's barrier analysis puts a CTA barrier between two writes to one allocation."""
        kk = step * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, AL))
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptr + arow[:, None] * stride_am + kk[None, :])
        kw = step * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
        off = wrow[:, None] * KW + kw[None, :]
        async_copy.async_copy_global_to_shared(w_smem.index(slot), w_ptr + off)
        if TWO:
            async_copy.async_copy_global_to_shared(v_smem.index(slot), v_ptr + off + vrows * KW)
        eoff = erow * (KS // 4) + step
        s32 = s_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        async_copy.async_copy_global_to_shared(e_smem.index(slot), s32 + eoff)
        if TWO:
            t32 = t_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
            async_copy.async_copy_global_to_shared(f_smem.index(slot), t32 + eoff + vrows * (KS // 4))

    @gluon.jit
    def _exponents(word, h: gl.constexpr, WD: gl.constexpr):
        """Half ``h``'s exponents ``[BLOCK_N, 2, 1]`` int32 (in ``WD``'s slice) from the rows' exponent words of the
        step (bytes ``2h``, ``2h + 1``)."""
        b = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, WD)))
        s = (word[:, None] >> (8 * (2 * h + b))[None, :]) & 0xFF
        return gl.expand_dims(s, 2)

    @gluon.jit
    def _epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO: gl.constexpr,
                  SWIGLU: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """The accumulators ``[BLOCK_N, BLOCK_M]`` → the slots' rows of ``o``: gate/up (``SWIGLU``) rounded to bf16,
        the clamped SwiGLU times the slot's routing weight, its columns in the fragment order (``frag_columns``: the
        down GEMM's K); down rounded to bf16, plain order (``TWO``: two tiles of rows, the second at ``n0 +
        BLOCK_N``)."""
        if SWIGLU:
            y = swiglu_tile(acc_w, acc_v, slots_ptr, rw_ptr, pid_m, TK, limit, BLOCK_M).to(gl.bfloat16)
            # feature 32b + 8q + 2p + j → column 32b + 8p + 2q + j
            y = gl.reshape(y, (BLOCK_N // 32, 4, 2, 2, 2, BLOCK_M))
            y = gl.reshape(gl.permute(y, (0, 2, 3, 1, 4, 5)), (BLOCK_N, BLOCK_M))
            store(y, slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M, BLOCK_N)
        else:
            store(acc_w.to(gl.bfloat16), slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M, BLOCK_N)
            if TWO:
                store(acc_v.to(gl.bfloat16), slots_ptr, o_ptr, pid_m, n0 + BLOCK_N, TK, N, stride_om, BLOCK_M,
                      BLOCK_N)  # fmt: skip

    @gluon.jit
    def _frag_moe_kernel(a_ptr, w_ptr, s_ptr, v_ptr, t_ptr, rw_ptr, slots_ptr, bexp_ptr, o_ptr, TK, E, N, stride_am,
                         stride_om, limit, K: gl.constexpr, TOPK: gl.constexpr, TWO: gl.constexpr,
                         SWIGLU: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, LATE: gl.constexpr):  # fmt: skip
        gl.static_assert(gl.num_warps() == 8)
        AL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # activations: 16 bytes a thread
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0])  # words: 16 bytes a thread
        EL: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])  # a row's exponent word
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        # the words [BLOCK_N, 2, 4] (row, 32-column block, word of the block) as the A fragment wants them: a thread
        # holds word q (its lane in the quad) of both blocks of rows r and r + 8; warp w has rows 16w ..< 16w + 16
        WD: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0, 0], [0, 1, 0]], lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]], block_bases=[], shape=[BLOCK_N, 2, 4],
        )  # fmt: skip
        ACT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.bfloat16)
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        pid_n = gl.program_id(0)  # the weight tiles of one slot block run side by side: its rows stay in L2
        pid_m = gl.program_id(1)
        e = gl.load(bexp_ptr + pid_m)
        if e < E:
            KW: gl.constexpr = K // 8
            KS: gl.constexpr = K // 32
            nk: gl.constexpr = K // 128
            slot_a = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, AL)))
            if SWIGLU:
                arow = gl.where(slot_a < TK, slot_a // TOPK, 0).to(gl.int64)  # padding reads row 0; never stored
                vrows = 0  # the gate and up rows of the same features
                n0 = pid_n * BLOCK_N
            else:
                arow = gl.where(slot_a < TK, slot_a, 0).to(gl.int64)
                vrows = BLOCK_N  # TWO: the next tile of rows of the same matrix
                n0 = pid_n * BLOCK_N * (2 if TWO else 1)
            wrow = (e * N + n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))).to(gl.int64)
            erow = (e * N + n0 + gl.arange(0, BLOCK_N, layout=EL)).to(gl.int64)

            a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 128], ACT)
            w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], FLAT)
            e_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], FLAT1)
            v_smem = w_smem
            f_smem = e_smem
            if TWO:
                v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], FLAT)
                f_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], FLAT1)

            for i in gl.static_range(STAGES - 2):
                if i < nk:
                    _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, s_ptr, t_ptr, erow, vrows, KW, KS, i, a_smem,
                           w_smem, v_smem, e_smem, f_smem, i, AL, WL, TWO)  # fmt: skip
                async_copy.commit_group()

            acc_w = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            acc_v = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            fw = gl.zeros([BLOCK_N, 64], gl.bfloat16, DOT)  # the half before's fragments (held for its MMAs)
            fv = fw
            for step in range(nk):
                ring = step % STAGES
                async_copy.wait_group(STAGES - 3)  # this thread's copies of step `step`
                fence_async_shared()
                gl.thread_barrier()  # every thread's copies of the step landed; every warpgroup done with step - 2
                ahead = step + STAGES - 2  # into the slot of step - 2, whose MMAs every warpgroup has waited for
                if not LATE:
                    if ahead < nk:
                        _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, s_ptr, t_ptr, erow, vrows, KW, KS, ahead,
                               a_smem, w_smem, v_smem, e_smem, f_smem, ahead % STAGES, AL, WL, TWO)  # fmt: skip
                    async_copy.commit_group()
                # the step's words and exponents first: their latency under the barrier and the first decode
                qw = w_smem.index(ring).reshape([BLOCK_N, 4, 4])
                qw0 = qw.slice(0, 2, dim=1).load(WD)
                qw1 = qw.slice(2, 2, dim=1).load(WD)
                ew = e_smem.index(ring).load(gl.SliceLayout(1, gl.SliceLayout(2, WD)))
                qv0 = qw0
                qv1 = qw1
                ev = ew
                if TWO:
                    qv = v_smem.index(ring).reshape([BLOCK_N, 4, 4])
                    qv0 = qv.slice(0, 2, dim=1).load(WD)
                    qv1 = qv.slice(2, 2, dim=1).load(WD)
                    ev = f_smem.index(ring).load(gl.SliceLayout(1, gl.SliceLayout(2, WD)))
                for h in gl.static_range(2):
                    if LATE and h == 1:  # the copies while the first half's MMAs run
                        if ahead < nk:
                            _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, s_ptr, t_ptr, erow, vrows, KW, KS,
                                   ahead, a_smem, w_smem, v_smem, e_smem, f_smem, ahead % STAGES, AL, WL,
                                   TWO)  # fmt: skip
                        async_copy.commit_group()
                    act = a_smem.index(ring).slice(64 * h, 64, dim=1).permute((1, 0))
                    aw = _frag(qw0 if h == 0 else qw1, _exponents(ew, h, WD), DOT)
                    acc_w = warpgroup_mma(aw, act, acc_w, is_async=True)
                    if TWO:
                        av = _frag(qv0 if h == 0 else qv1, _exponents(ev, h, WD), DOT)
                        acc_v = warpgroup_mma(av, act, acc_v, is_async=True)
                        acc_w, acc_v, fw, fv = warpgroup_mma_wait(num_outstanding=2, deps=(acc_w, acc_v, fw, fv))
                        fv = av
                    else:
                        acc_w, fw = warpgroup_mma_wait(num_outstanding=1, deps=(acc_w, fw))
                    fw = aw
            if TWO:
                acc_w, acc_v, fw, fv = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w, acc_v, fw, fv))
            else:
                acc_w, fw = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w, fw))
            async_copy.wait_group(0)

            _epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO, SWIGLU, BLOCK_M,
                      BLOCK_N)  # fmt: skip


def down_rows(n: int) -> int:
    """Weight rows a down program covers: ``2·BLOCK_N`` (two accumulators a warpgroup, each slot row's activations
    read from L2 half as often) where ``DOWN_PAIRS`` and the rows make whole pairs of tiles, else ``BLOCK_N``."""
    return 2 * BLOCK_N if DOWN_PAIRS and n % (2 * BLOCK_N) == 0 else BLOCK_N


def _launch(a, w, s, v, t, rw, slots, bexp, o, tk: int, e: int, n: int, k: int, limit: float, topk: int,
            swiglu: bool):  # fmt: skip
    rows = BLOCK_N if swiglu else down_rows(n)
    _frag_moe_kernel[(n // rows, bexp.numel())](
        a, w, s, v, t, rw, slots, bexp, o, tk, e, n, a.stride(0), o.stride(0), float(limit), K=k, TOPK=topk,
        TWO=swiglu or rows > BLOCK_N, SWIGLU=swiglu, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        LATE=LATE_COPIES, num_warps=NUM_WARPS,
    )  # fmt: skip


def gate_up(xp, w1, s1, w3, s3, rw, slots, bexp, h, topk: int, limit: float) -> None:
    """``moe_mxfp4_wgmma.gate_up`` with the token rows' columns permuted (``xp = permute_columns(x)``) and ``h``
    written in the same permuted order (``frag_columns`` of its ``I`` columns)."""
    e, n, kw = w1.shape
    _launch(xp, w1, s1, w3, s3, rw, slots, bexp, h, h.shape[0], e, n, 8 * kw, limit, topk, True)


def down(hp, w2, s2, slots, bexp, o) -> None:
    """``o[slot] = h[slot]·w2ᵀ`` in bf16 from ``hp``, ``h`` with its columns permuted (``gate_up``'s output)."""
    e, n, kw = w2.shape
    _launch(hp, w2, s2, w2, s2, o, slots, bexp, o, o.shape[0], e, n, 8 * kw, 0.0, 1, False)


__all__ = ["BLOCK_M", "HAVE_GLUON", "down", "down_rows", "fits", "frag_columns", "gate_up", "permute_columns"]
