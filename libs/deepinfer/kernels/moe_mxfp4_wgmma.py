"""The prefill MXFP4 expert GEMMs for Hopper in Gluon: the decoded weight tiles go through shared memory to
asynchronous ``wgmma``, so the decode of one K step overlaps the tensor cores' work on the one before.

Why: the Triton tiles (``kernels.moe_mxfp4``) hand the decoded weights to ``tl.dot`` as the MMA's register operand,
and since the next K step rewrites those registers, every ``wgmma`` is waited for before the next decode starts: at
128-row tiles the kernels take about as long at 1024 tokens as at 4096 (4.5 vs 4.9 ms a V4-Flash layer on an H200,
where the bf16 FLOP roofline of the 4096-token layer is 1.6 ms; bench/results/2026-12-01-rotate-order.md).

Semantics: ``gate_up(...)`` and ``down(...)`` compute what ``moe_mxfp4``'s ``_mx_gate_up_kernel`` and
``_mx_down_kernel`` compute on the same padded slot blocks (``moe_align.padded_slots`` at ``BLOCK_M``): the gate and
up GEMMs of each slot's token row against its expert's rows, rounded to bf16, the clamped SwiGLU times the slot's
routing weight into ``h[slot]``; then each slot's ``h`` row against the expert's ``w2`` rows into ``o[slot]`` in
bf16. Every decoded weight is exact in bf16 and the products accumulate in fp32, so the results differ from the
Triton kernels' only by the order of the fp32 sums (``tests/kernels/test_moe_wgmma.py`` compares them on a GPU).

One program: a block of ``BLOCK_M`` slots of one expert × ``BLOCK_N`` weight rows, 8 warps (two warpgroups of 64
weight rows each). Per K step of ``BLOCK_K`` columns:

* the slots' activation columns and the weight words (codes in the rotate order, ``quant.nibble_order``) come by
  ``cp.async`` into a ring of ``STAGES`` shared-memory slots, issued ``STAGES - 2`` steps ahead (a slot is refilled
  only after a CTA barrier that follows every warpgroup's wait for the MMAs that read it);
* each warp decodes the words of its own warpgroup's rows (the PTX of ``moe_mxfp4_gemm``: 8 codes a word into 4
  bf16x2 times the block scale) and stores the bf16 tile into one of two shared buffers; the blocks' exponents come
  by plain loads, a 16-byte vector of a row's next 8 steps at a time (``SCALE_WORDS``; a byte a step used 2 of the
  32 bytes of each sector it fetched: 3652 → 3569 µs for a V4-Flash layer at 4096 tokens on an H200);
* ``wgmma`` multiplies the tile ``[BLOCK_N, BLOCK_K]`` by the activations' transpose (``[BLOCK_K, BLOCK_M]``) into
  fp32 accumulators ``[BLOCK_N, BLOCK_M]`` asynchronously; a warpgroup waits only for the MMAs of the step before,
  after issuing this step's, so its next decode runs while the tensor cores work.

The epilogue transposes the accumulators through shared memory so each thread stores 16 contiguous bytes of a slot
row. Needs CUDA, sm_90, bf16 activations, Triton with Gluon's Hopper module, weight rows a multiple of ``BLOCK_N``
and K a multiple of ``BLOCK_K`` (``fits``); ``kernels.moe_mxfp4`` keeps its Triton tiles otherwise. Gluon kernels do
not run in Triton's interpreter: their tests run on a GPU only.
"""

from __future__ import annotations

import torch

from deepinfer import envs

try:  # Gluon's Hopper module (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

from deepinfer.kernels.moe_mxfp4_gemm import _E2M1_ROTATE_ASM

BLOCK_M = 128  # slots a program (the MMA's N)
BLOCK_N = 128  # weight rows a program (the MMA's M: two warpgroups of 64)
BLOCK_K = 64  # columns a K step (two MXFP4 scale blocks; one 128-byte swizzled row of bf16)
STAGES = 4  # the cp.async ring of activation and word tiles
NUM_WARPS = 8
WS: bool | None = None  # the warp-specialised variant (kernels.moe_mxfp4_ws); None: DEEPINFER_MOE_PREFILL
FRAG: bool | None = None  # the register-fragment kernels (kernels.moe_mxfp4_frag); None: DEEPINFER_MOE_PREFILL
SCALE_WORDS = True  # the exponents by one vector load a row every few K steps (False: a byte a step; benchmarks)


def available(x: torch.Tensor) -> bool:
    """Whether this path runs for ``x``: bf16 on an sm_90 GPU with Gluon (checked on the host, no sync)."""
    if not (HAVE_GLUON and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device) == (9, 0)


def use_ws() -> bool:
    """Whether the warp-specialised variant runs: ``WS``, or where that is None ``DEEPINFER_MOE_PREFILL=gluon-ws``."""
    return WS if WS is not None else envs.get("DEEPINFER_MOE_PREFILL") == "gluon-ws"


def use_frag() -> bool:
    """Whether the register-fragment kernels run (``kernels.moe_mxfp4_frag``) instead of these: ``FRAG``, or where
    that is None ``DEEPINFER_MOE_PREFILL=gluon`` (the default)."""
    return FRAG if FRAG is not None else envs.get("DEEPINFER_MOE_PREFILL") == "gluon"


def fits(n: int, k: int) -> bool:
    """Whether a GEMM of ``n`` weight rows over ``k`` columns is made of whole tiles."""
    return n % BLOCK_N == 0 and k % BLOCK_K == 0


if HAVE_GLUON:

    @gluon.jit
    def _decode(q, s):
        """Words ``q [R, B, 4]`` (rotate order; B blocks of 32 columns) and their blocks' exponents ``s [R, B, 1]``
        (int32) → the bf16 tile ``[R, 32·B]``, each word's 8 codes in column order."""
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _E2M1_ROTATE_ASM, "=r,=r,=r,=r,r,r", [q, gl.broadcast((s + 126) * 0x800080, q)[0]], dtype=(gl.int32,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
        p = gl.join(gl.join(p0, p2), gl.join(p1, p3))  # [R, B, 4, 2, 2]: a word's pair 2i + j at [..., i, j]
        lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.join(lo, hi)
        return gl.reshape(w, (q.shape[0], 32 * q.shape[1]))

    @gluon.jit
    def _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW: gl.constexpr, step, a_smem, w_smem, v_smem, slot,
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
    def _scales(s_ptr, srow, KS: gl.constexpr, step, SL: gl.constexpr, BLOCK_K: gl.constexpr):
        """The exponents of step ``step``'s blocks, ``[BLOCK_N, BLOCK_K/32, 1]`` int32 (one a thread: its words')."""
        kb = step * (BLOCK_K // 32) + gl.arange(0, BLOCK_K // 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        return gl.load(s_ptr + srow[:, None, None] * KS + kb[None, :, None]).to(gl.int32)

    @gluon.jit
    def _scale_group(s_ptr, srow, KS: gl.constexpr, group, SL: gl.constexpr, WPL: gl.constexpr):
        """Words ``group·WPL ..+ WPL`` of each row's exponents (a word: the 4 blocks of 2 K steps) by one
        ``4·WPL``-byte load a thread: ``[BLOCK_N, BLOCK_K/32, WPL]`` int32 in ``SL`` (the threads of a row's two
        blocks load the same words; a byte a step per thread was 2 of every 32 bytes of its sector)."""
        s32 = s_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        w = gl.arange(0, WPL, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        off = srow[:, None, None] * (KS // 4) + group * WPL + w[None, None, :] + 0 * j[None, :, None]
        return gl.load(s32 + off)

    @gluon.jit
    def _scale_of(words, step, SL: gl.constexpr, WPL: gl.constexpr):
        """Step ``step``'s exponents ``[BLOCK_N, 2, 1]`` int32 in ``SL`` (``_scales``') from its group's words."""
        w = gl.arange(0, WPL, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        word = gl.sum(gl.where(w[None, None, :] == (step % (2 * WPL)) // 2, words, 0), axis=2)
        byte = (word >> (8 * ((step % 2) * 2 + j))[None, :]) & 0xFF
        return gl.expand_dims(byte, 2)

    @gluon.jit
    def _mma(tw, tv, act, acc_w, acc_v, TWO: gl.constexpr, PENDING: gl.constexpr):
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
    def _drain(acc_w, acc_v, TWO: gl.constexpr):
        """Wait for every MMA in flight."""
        if TWO:
            acc_w, acc_v = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w, acc_v))
        else:
            acc_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc_w,))
        return acc_w, acc_v

    @gluon.jit
    def _swiglu(acc_w, acc_v, slots_ptr, rw_ptr, pid_m, TK, limit, BLOCK_M: gl.constexpr):
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
    def _store(y, slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """``y [BLOCK_N, BLOCK_M]`` bf16 (an MMA layout of 8 warps) → columns ``n0 ..< n0 + BLOCK_N`` of the slots'
        rows of ``o``, transposed through shared memory so that each thread stores 16 contiguous bytes."""
        OL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
        out = gl.convert_layout(gl.permute(y, (1, 0)), OL)
        slot_o = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OL)))
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OL))
        o_off = slot_o.to(gl.int64)[:, None] * stride_om + rn[None, :]
        gl.store(o_ptr + o_off, out, mask=(slot_o < TK)[:, None] & (rn < N)[None, :])

    @gluon.jit
    def _epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """The accumulators ``[BLOCK_N, BLOCK_M]`` (the MMA layout of 8 warps) → the slots' rows of ``o``: gate/up
        (``TWO``) rounded to bf16, the clamped SwiGLU times the slot's routing weight; down rounded to bf16."""
        if TWO:
            y = _swiglu(acc_w, acc_v, slots_ptr, rw_ptr, pid_m, TK, limit, BLOCK_M)
        else:
            y = acc_w
        _store(y.to(gl.bfloat16), slots_ptr, o_ptr, pid_m, n0, TK, N, stride_om, BLOCK_M, BLOCK_N)

    @gluon.jit
    def _wg_moe_kernel(a_ptr, w_ptr, s_ptr, v_ptr, t_ptr, rw_ptr, slots_ptr, bexp_ptr, o_ptr, TK, E, N, stride_am,
                       stride_om, limit, K: gl.constexpr, TOPK: gl.constexpr, TWO: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       WPL: gl.constexpr = 0):  # fmt: skip
        gl.static_assert(gl.num_warps() == 8)
        # the activation copies: 16 bytes a thread; the words: 16 bytes (4 words of one row) a thread, warp w on rows
        # 16w ..< 16w + 16 (its warpgroup's MMA rows: a warpgroup only writes the tile rows its own MMAs read)
        AL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [8, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [16, 2, 1], [8, 1, 1], [2, 1, 0])  # WL's words by scale block
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        TILE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        ACT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        WORDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        pid_n = gl.program_id(0)  # the weight tiles of one slot block run side by side: its rows stay in L2
        pid_m = gl.program_id(1)
        e = gl.load(bexp_ptr + pid_m)
        if e < E:
            KW: gl.constexpr = K // 8
            KS: gl.constexpr = K // 32
            nk: gl.constexpr = K // BLOCK_K  # a constant trip count: no zero-trip path for ptxas to guard against
            slot_a = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, AL)))
            if TWO:
                arow = gl.where(slot_a < TK, slot_a // TOPK, 0).to(gl.int64)  # padding reads row 0; never stored
            else:
                arow = gl.where(slot_a < TK, slot_a, 0).to(gl.int64)
            n0 = pid_n * BLOCK_N
            wrow = (e * N + n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))).to(gl.int64)
            srow = (e * N + n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL)))).to(gl.int64)

            a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], ACT)
            w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], WORDS)
            tw_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_K], TILE)
            v_smem = w_smem
            tv_smem = tw_smem
            if TWO:
                v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], WORDS)
                tv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_K], TILE)

            for i in gl.static_range(STAGES - 2):
                if i < nk:
                    _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, i, a_smem, w_smem, v_smem, i, AL, WL, TWO,
                           BLOCK_K)  # fmt: skip
                async_copy.commit_group()

            acc_w = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            acc_v = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            # the exponents come by plain loads ahead of their steps (too small for cp.async): WPL > 0, a group of
            # 2·WPL steps' words a row by one vector load, the next group's loaded a group ahead; else a byte a
            # step, two steps ahead
            GROUP: gl.constexpr = 2 * WPL  # K steps a group of words covers
            if WPL > 0:
                ng: gl.constexpr = nk // GROUP
                gw = _scale_group(s_ptr, srow, KS, 0, SL, WPL)
                gw1 = _scale_group(s_ptr, srow, KS, min(1, ng - 1), SL, WPL)
                gv = gw
                gv1 = gw1
                if TWO:
                    gv = _scale_group(t_ptr, srow, KS, 0, SL, WPL)
                    gv1 = _scale_group(t_ptr, srow, KS, min(1, ng - 1), SL, WPL)
            else:
                sw = _scales(s_ptr, srow, KS, 0, SL, BLOCK_K)
                sw1 = _scales(s_ptr, srow, KS, gl.minimum(1, nk - 1), SL, BLOCK_K)
                sv = sw
                sv1 = sw1
                if TWO:
                    sv = _scales(t_ptr, srow, KS, 0, SL, BLOCK_K)
                    sv1 = _scales(t_ptr, srow, KS, gl.minimum(1, nk - 1), SL, BLOCK_K)
            for step in range(nk):
                ring = step % STAGES
                buf = step % 2
                if WPL > 0:
                    if step % GROUP == 0:
                        if step > 0:
                            gw = gw1
                            gv = gv1
                            nxg = gl.minimum(step // GROUP + 1, ng - 1)
                            gw1 = _scale_group(s_ptr, srow, KS, nxg, SL, WPL)
                            gv1 = gw1
                            if TWO:
                                gv1 = _scale_group(t_ptr, srow, KS, nxg, SL, WPL)
                    sw = _scale_of(gw, step, SL, WPL)
                    sv = sw
                    if TWO:
                        sv = _scale_of(gv, step, SL, WPL)
                else:
                    nxt = gl.minimum(step + 2, nk - 1)
                    sw2 = _scales(s_ptr, srow, KS, nxt, SL, BLOCK_K)
                    sv2 = sw2
                    if TWO:
                        sv2 = _scales(t_ptr, srow, KS, nxt, SL, BLOCK_K)
                async_copy.wait_group(STAGES - 3)  # this thread's copies of step `step` (it reads its own words)
                words = w_smem.index(ring).reshape([BLOCK_N, BLOCK_K // 32, 4])
                tw_smem.index(buf).store(_decode(words.load(SL), sw))
                if TWO:
                    words = v_smem.index(ring).reshape([BLOCK_N, BLOCK_K // 32, 4])
                    tv_smem.index(buf).store(_decode(words.load(SL), sv))
                fence_async_shared()
                gl.thread_barrier()  # the tiles written, every warpgroup past its wait for step - 1's MMAs
                ahead = step + STAGES - 2  # into the slot of step - 2, whose MMAs every warpgroup has waited for
                if ahead < nk:
                    _issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, ahead, a_smem, w_smem, v_smem,
                           ahead % STAGES, AL, WL, TWO, BLOCK_K)  # fmt: skip
                async_copy.commit_group()
                act = a_smem.index(ring).permute((1, 0))
                acc_w, acc_v = _mma(tw_smem.index(buf), tv_smem.index(buf), act, acc_w, acc_v, TWO, 1)
                if WPL == 0:
                    sw = sw1
                    sw1 = sw2
                    sv = sv1
                    sv1 = sv2
            acc_w, acc_v = _drain(acc_w, acc_v, TWO)
            async_copy.wait_group(0)

            _epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO, BLOCK_M, BLOCK_N)


def scale_words(k: int, *scales: torch.Tensor) -> int:
    """Exponent words a row loads at once (``_scale_group``): 4 (16 bytes) where a row's ``K/32`` exponents make
    whole 16-byte groups, 2 or 1 for 8- or 4-byte ones (V4.1's 72-byte rows: 2), 0 (a byte a step) otherwise or with
    ``SCALE_WORDS`` off; no wider than the ``scales`` tensors' addresses are aligned."""
    ks = k // 32
    if not SCALE_WORDS or k % BLOCK_K:
        return 0
    return next((w for w in (4, 2, 1) if ks % (4 * w) == 0 and all(s.data_ptr() % (4 * w) == 0 for s in scales)), 0)


def _launch(a, w, s, v, t, rw, slots, bexp, o, tk: int, e: int, n: int, k: int, limit: float, topk: int, two: bool):
    grid = (n // BLOCK_N, bexp.numel())
    args = (a, w, s, v, t, rw, slots, bexp, o, tk, e, n, a.stride(0), o.stride(0), float(limit))
    meta = dict(K=k, TOPK=topk, TWO=two, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    if use_ws():
        from deepinfer.kernels import moe_mxfp4_ws as ws

        ws._ws_moe_kernel[grid](
            *args, STAGES=ws.STAGES, PRODUCER_WARPS=ws.PRODUCER_WARPS, PRODUCER_REGS=ws.PRODUCER_REGS, **meta
        )
    else:
        _wg_moe_kernel[grid](*args, STAGES=STAGES, WPL=scale_words(k, s, t), **meta)


def gate_up(x, w1, s1, w3, s3, rw, slots, bexp, h, topk: int, limit: float) -> None:
    """``h[slot] = silu(min(x·w1ᵀ, limit)) · clamp(x·w3ᵀ, ±limit) · rw[slot]`` (bf16 roundings of
    ``_mx_gate_up_kernel``) for every slot of the blocks: ``x [T, D]`` bf16, ``w1``/``w3`` int32 words
    ``[E, I, D/8]`` in the rotate order, ``s1``/``s3`` uint8 ``[E, I, D/32]``, ``slots``/``bexp`` of
    ``padded_slots(idx, E, BLOCK_M)``, ``h [T·k, I]`` bf16."""
    e, n, kw = w1.shape
    _launch(x, w1, s1, w3, s3, rw, slots, bexp, h, h.shape[0], e, n, 8 * kw, limit, topk, True)


def down(h, w2, s2, slots, bexp, o) -> None:
    """``o[slot] = h[slot]·w2ᵀ`` in bf16 for every slot of the blocks (``w2`` int32 words ``[E, D, I/8]``)."""
    e, n, kw = w2.shape
    _launch(h, w2, s2, w2, s2, o, slots, bexp, o, o.shape[0], e, n, 8 * kw, 0.0, 1, False)


__all__ = ["BLOCK_M", "HAVE_GLUON", "available", "down", "fits", "gate_up", "use_frag", "use_ws"]
