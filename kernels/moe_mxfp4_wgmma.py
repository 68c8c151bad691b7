"""The prefill MXFP4 expert GEMMs for Hopper in Gluon: the decoded weight tiles go through shared memory to
asynchronous ``wgmma``, so the decode of one K step overlaps the tensor cores' work on the one before.

Why: the Triton tiles (``kernels.moe_mxfp4``) hand the decoded weights to ``tl.dot`` as the MMA's register operand,
and since the next K step rewrites those registers, every ``wgmma`` is waited for before the next decode starts: at
128-row tiles the kernels take about as long at 1024 tokens as at 4096 (4.5 vs 4.9 ms a V4-Flash layer on an H200,
where the bf16 FLOP roofline of the 4096-token layer is 1.6 ms; bench/results/engine/2026-12-01-rotate-order.md).

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

from deepinfer.kernels import moe_mxfp4_ws as ws
from deepinfer.kernels.moe_mxfp4_tiles import HAVE_GLUON

BLOCK_M = 128  # slots a program (the MMA's N)
BLOCK_N = 128  # weight rows a program (the MMA's M: two warpgroups of 64)
BLOCK_K = 64  # columns a K step (two MXFP4 scale blocks; one 128-byte swizzled row of bf16)
STAGES = 4  # the cp.async ring of activation and word tiles
NUM_WARPS = 8
# moe_mxfp4's prefill kernels: one of PREFILL_KERNELS, DEEPINFER_MOE_PREFILL (its default) as the nvidia backend hands
# the setting over (backends.nvidia.settings); "triton" keeps the Triton tiles
PREFILL_KERNELS = ("gluon", "gluon-smem", "gluon-ws", "triton")
PREFILL = "gluon"
WS: bool | None = None  # the warp-specialised variant (kernels.moe_mxfp4_ws); None: PREFILL == "gluon-ws"
FRAG: bool | None = None  # the register-fragment kernels (kernels.moe_mxfp4_frag); None: PREFILL == "gluon"
SCALE_WORDS = True  # the exponents by one vector load a row every few K steps (False: a byte a step; benchmarks)


def available(x: torch.Tensor) -> bool:
    """Whether this path runs for ``x``: bf16 on an sm_90 GPU with Gluon (checked on the host, no sync)."""
    if not (HAVE_GLUON and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device) == (9, 0)


def use_ws() -> bool:
    """Whether the warp-specialised variant runs: ``WS``, or where that is None ``PREFILL == "gluon-ws"``."""
    return WS if WS is not None else PREFILL == "gluon-ws"


def use_frag() -> bool:
    """Whether the register-fragment kernels run (``kernels.moe_mxfp4_frag``) instead of these: ``FRAG``, or where
    that is None ``PREFILL == "gluon"`` (the default)."""
    return FRAG if FRAG is not None else PREFILL == "gluon"


def fits(n: int, k: int) -> bool:
    """Whether a GEMM of ``n`` weight rows over ``k`` columns is made of whole tiles."""
    return n % BLOCK_N == 0 and k % BLOCK_K == 0


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    from deepinfer.kernels.moe_mxfp4_tiles import (
        decode,
        drain,
        epilogue,
        issue,
        mma,
        scale_group,
        scale_of,
        step_scales,
    )

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
                    issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, i, a_smem, w_smem, v_smem, i, AL, WL, TWO,
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
                gw = scale_group(s_ptr, srow, KS, 0, SL, WPL)
                gw1 = scale_group(s_ptr, srow, KS, min(1, ng - 1), SL, WPL)
                gv = gw
                gv1 = gw1
                if TWO:
                    gv = scale_group(t_ptr, srow, KS, 0, SL, WPL)
                    gv1 = scale_group(t_ptr, srow, KS, min(1, ng - 1), SL, WPL)
            else:
                sw = step_scales(s_ptr, srow, KS, 0, SL, BLOCK_K)
                sw1 = step_scales(s_ptr, srow, KS, gl.minimum(1, nk - 1), SL, BLOCK_K)
                sv = sw
                sv1 = sw1
                if TWO:
                    sv = step_scales(t_ptr, srow, KS, 0, SL, BLOCK_K)
                    sv1 = step_scales(t_ptr, srow, KS, gl.minimum(1, nk - 1), SL, BLOCK_K)
            for step in range(nk):
                ring = step % STAGES
                buf = step % 2
                if WPL > 0:
                    if step % GROUP == 0:
                        if step > 0:
                            gw = gw1
                            gv = gv1
                            nxg = gl.minimum(step // GROUP + 1, ng - 1)
                            gw1 = scale_group(s_ptr, srow, KS, nxg, SL, WPL)
                            gv1 = gw1
                            if TWO:
                                gv1 = scale_group(t_ptr, srow, KS, nxg, SL, WPL)
                    sw = scale_of(gw, step, SL, WPL)
                    sv = sw
                    if TWO:
                        sv = scale_of(gv, step, SL, WPL)
                else:
                    nxt = gl.minimum(step + 2, nk - 1)
                    sw2 = step_scales(s_ptr, srow, KS, nxt, SL, BLOCK_K)
                    sv2 = sw2
                    if TWO:
                        sv2 = step_scales(t_ptr, srow, KS, nxt, SL, BLOCK_K)
                async_copy.wait_group(STAGES - 3)  # this thread's copies of step `step` (it reads its own words)
                words = w_smem.index(ring).reshape([BLOCK_N, BLOCK_K // 32, 4])
                tw_smem.index(buf).store(decode(words.load(SL), sw))
                if TWO:
                    words = v_smem.index(ring).reshape([BLOCK_N, BLOCK_K // 32, 4])
                    tv_smem.index(buf).store(decode(words.load(SL), sv))
                fence_async_shared()
                gl.thread_barrier()  # the tiles written, every warpgroup past its wait for step - 1's MMAs
                ahead = step + STAGES - 2  # into the slot of step - 2, whose MMAs every warpgroup has waited for
                if ahead < nk:
                    issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, ahead, a_smem, w_smem, v_smem,
                          ahead % STAGES, AL, WL, TWO, BLOCK_K)  # fmt: skip
                async_copy.commit_group()
                act = a_smem.index(ring).permute((1, 0))
                acc_w, acc_v = mma(tw_smem.index(buf), tv_smem.index(buf), act, acc_w, acc_v, TWO, 1)
                if WPL == 0:
                    sw = sw1
                    sw1 = sw2
                    sv = sv1
                    sv1 = sv2
            acc_w, acc_v = drain(acc_w, acc_v, TWO)
            async_copy.wait_group(0)

            epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO, BLOCK_M, BLOCK_N)


def scale_words(k: int, *scales: torch.Tensor) -> int:
    """Exponent words a row loads at once (``scale_group``): 4 (16 bytes) where a row's ``K/32`` exponents make
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
        ws.ws_moe_kernel[grid](
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


__all__ = [
    "BLOCK_M",
    "HAVE_GLUON",
    "PREFILL",
    "PREFILL_KERNELS",
    "available",
    "down",
    "fits",
    "gate_up",
    "use_frag",
    "use_ws",
]
