"""A warp-specialised variant of ``kernels.moe_mxfp4_wgmma``'s prefill kernels (Gluon, sm_90): producer warps copy
and decode, the two consumer warpgroups only issue ``wgmma``. NOT YET RUN ON A GPU: off unless
``DEEPINFER_MOE_PREFILL=gluon-ws`` (or ``moe_mxfp4_wgmma.WS``); compiled for sm_90 offline with Triton 3.6;
``tests/kernels/test_moe_wgmma.py`` runs it on a GPU.

Why: in ``moe_mxfp4_wgmma`` the same two warpgroups decode, wait at a CTA barrier and issue the MMAs; at 4096 tokens
its gate/up kernel keeps the tensor pipe 53% busy (ncu: one program an SM at 254 registers; stalls at the barrier
25%, fixed-latency waits 15%), and neither fewer barriers, deeper MMA queues nor register operands moved it
(bench/results/kernels/2026-12-01-moe-wgmma.md). Here the decode runs in its own warps (``PRODUCER_WARPS``, few
registers),
up to two steps ahead of the MMAs, and the consumers keep the accumulators.

Same blocks, products, sums and epilogue as ``moe_mxfp4_wgmma`` (the same tile for each K step, accumulated in the
same order by the same ``wgmma`` shapes): bit-identical results are expected.

Per K step ``s`` (ring slot ``s % STAGES`` for the activation rows, the words and the decoded tiles):

* producers: wait for their own copies of step ``s``, decode its words into the tile buffers, fence, sync among
  themselves and arrive on ``ready[s % STAGES]``; then wait until the MMAs of step ``s + 2 - STAGES`` are done
  (``free``: the consumers arrive on it after taking step ``s``, so the producers arrive first) and ``cp.async``
  step ``s + 2``'s activation rows and words into its slot;
* consumers: wait on ``ready``, issue the step's ``wgmma`` (asynchronous), wait for the step before's and arrive on
  its ``free``.
"""

from __future__ import annotations

from deepinfer.kernels.moe_mxfp4_tiles import HAVE_GLUON

PRODUCER_WARPS = 4
PRODUCER_REGS = 96  # registers a producer thread (setmaxnreg); the consumers get the rest
STAGES = 3

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
    )

    from deepinfer.kernels.moe_mxfp4_tiles import decode, drain, epilogue, issue, mma, step_scales

    @gluon.jit
    def _producer(a_ptr, w_ptr, s_ptr, v_ptr, t_ptr, slots_ptr, pid_m, row0, TK, stride_am, a_smem, w_smem, v_smem,
                  tw_smem, tv_smem, ready, free, K: gl.constexpr, TOPK: gl.constexpr, TWO: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        W: gl.constexpr = gl.num_warps()
        AL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [W, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [16, 2, 1], [W, 1, 1], [2, 1, 0])  # WL's words by block
        KW: gl.constexpr = K // 8
        KS: gl.constexpr = K // 32
        nk: gl.constexpr = K // BLOCK_K
        slot = gl.load(slots_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, AL)))
        if TWO:
            arow = gl.where(slot < TK, slot // TOPK, 0).to(gl.int64)  # padding reads row 0; never stored
        else:
            arow = gl.where(slot < TK, slot, 0).to(gl.int64)
        wrow = (row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))).to(gl.int64)
        srow = (row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL)))).to(gl.int64)
        for i in gl.static_range(2):
            issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, i, a_smem, w_smem, v_smem, i, AL, WL, TWO, BLOCK_K)
            async_copy.commit_group()
        sw = step_scales(s_ptr, srow, KS, 0, SL, BLOCK_K)
        sv = sw
        if TWO:
            sv = step_scales(t_ptr, srow, KS, 0, SL, BLOCK_K)
        for step in range(nk):
            nxt = gl.minimum(step + 1, nk - 1)
            sw1 = step_scales(s_ptr, srow, KS, nxt, SL, BLOCK_K)
            sv1 = sw1
            if TWO:
                sv1 = step_scales(t_ptr, srow, KS, nxt, SL, BLOCK_K)
            # step's copies (issued two steps ago) landed; its tile buffers were freed by the consumers' arrive for
            # step - STAGES, waited for two steps ago before those copies
            async_copy.wait_group(1)
            buf = step % STAGES
            words = w_smem.index(buf).reshape([BLOCK_N, BLOCK_K // 32, 4])
            tw_smem.index(buf).store(decode(words.load(SL), sw))
            if TWO:
                words = v_smem.index(buf).reshape([BLOCK_N, BLOCK_K // 32, 4])
                tv_smem.index(buf).store(decode(words.load(SL), sv))
            fence_async_shared()
            gl.thread_barrier()  # every producer's copies and tiles of this step
            mbarrier.arrive(ready.index(buf), count=1)
            # only then wait for a slot: the consumers free step - 1's after they have taken this step's
            ahead = step + 2
            if ahead < nk:
                ring = ahead % STAGES
                mbarrier.wait(free.index(ring), (ahead // STAGES + 1) & 1, pred=ahead >= STAGES)  # step ahead - STAGES
                issue(a_ptr, arow, stride_am, w_ptr, v_ptr, wrow, KW, ahead, a_smem, w_smem, v_smem, ring, AL, WL,
                      TWO, BLOCK_K)  # fmt: skip
            async_copy.commit_group()
            sw = sw1
            sv = sv1
        async_copy.wait_group(0)

    @gluon.jit
    def _consumer(a_smem, tw_smem, tv_smem, ready, free, K: gl.constexpr, TWO: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        nk: gl.constexpr = K // BLOCK_K
        acc_w = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        acc_v = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        for step in range(nk):
            buf = step % STAGES
            mbarrier.wait(ready.index(buf), (step // STAGES) & 1)
            act = a_smem.index(buf).permute((1, 0))
            acc_w, acc_v = mma(tw_smem.index(buf), tv_smem.index(buf), act, acc_w, acc_v, TWO, 1)
            gl.thread_barrier()  # both warpgroups are done with step - 1
            mbarrier.arrive(free.index((step + STAGES - 1) % STAGES), count=1, pred=step >= 1)
        return drain(acc_w, acc_v, TWO)

    @gluon.jit
    def ws_moe_kernel(a_ptr, w_ptr, s_ptr, v_ptr, t_ptr, rw_ptr, slots_ptr, bexp_ptr, o_ptr, TK, E, N, stride_am,
                      stride_om, limit, K: gl.constexpr, TOPK: gl.constexpr, TWO: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr):  # fmt: skip
        gl.static_assert(gl.num_warps() == 8)
        gl.static_assert(K // BLOCK_K >= 2)
        TILE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        ACT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        WORDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        e = gl.load(bexp_ptr + pid_m)
        if e < E:
            n0 = pid_n * BLOCK_N
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], ACT)
            w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], WORDS)
            tw_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], TILE)
            v_smem = w_smem
            tv_smem = tw_smem
            if TWO:
                v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], WORDS)
                tv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], TILE)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(free.index(i), count=1)
            fence_async_shared()
            acc_w, acc_v = gl.warp_specialize(
                [
                    (_consumer, (a_smem, tw_smem, tv_smem, ready, free, K, TWO, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
                    (_producer, (a_ptr, w_ptr, s_ptr, v_ptr, t_ptr, slots_ptr, pid_m, e * N + n0, TK, stride_am,
                                 a_smem, w_smem, v_smem, tw_smem, tv_smem, ready, free, K, TOPK, TWO, BLOCK_M,
                                 BLOCK_N, BLOCK_K, STAGES)),
                ],
                [PRODUCER_WARPS],
                [PRODUCER_REGS],
            )  # fmt: skip

            epilogue(acc_w, acc_v, slots_ptr, rw_ptr, o_ptr, pid_m, n0, TK, N, stride_om, limit, TWO, BLOCK_M, BLOCK_N)


__all__ = ["PRODUCER_REGS", "PRODUCER_WARPS", "STAGES"]
