"""A prefill's sparse attention on Hopper in Gluon: ``attention.sparse_attention_gather``'s wide tiles with the query
and the gathered key rows in shared memory and ``wgmma`` reading them there.

Why: the Triton wide tiles (``kernels.attention``, ``ATTN_WIDE``) hold the query's ``[64, 512]`` tile and the
address tensors of the gathered rows in registers beside the ``[64, 512]`` fp32 output: 255 registers with spills,
one program an SM, latency bound at 4.9x the FLOP roofline on an H200
(bench/results/engine/2026-12-01-prefill-attention.md).

Semantics: ``sparse_attention_gather``'s (K = V, a per-head sink in the denominator, a query's keys in list order,
``count`` of them), for bf16 ``q [n, H, 512]`` with ``H`` a multiple of 64. One program: one query's 64 heads, 8
warps (two warpgroups). The query's tile comes by ``cp.async`` into shared memory once; each step's ``BLOCK_N`` key
rows are gathered by ``cp.async`` into a ring of ``STAGES`` shared slots, issued ``STAGES - 1`` steps ahead (keys
past ``count`` are zero rows, their scores ``-inf``). Per step:

* ``S = Q · Kᵀ`` by ``wgmma`` (each warpgroup half of the step's keys), scaled, masked;
* the online softmax as the Triton kernel's (running max seeded with the sink, fp32 denominator, the accumulator
  rescaled by ``exp(m - m_new)``), ``P`` in bf16 into shared memory;
* ``O += P · K`` by ``wgmma`` (each warpgroup 256 of the 512 output columns), asynchronous while the next copies
  are issued.

The rounding differs from the Triton wide tiles only in the order of fp32 sums. Needs CUDA, sm_90, Triton with
Gluon's Hopper module (the API of Triton 3.6); a build that fails logs once and the caller keeps the Triton tiles.
Gluon does not run in Triton's interpreter: the kernel's tests run on a GPU only.

On by default (``ENABLED``: ``DEEPINFER_ATTN_PREFILL=gluon``; ``triton`` keeps the Triton tiles). H200, 4096
queries of V4-Flash width (``bench/kernels/attention_prefill.py``): SWA 495 µs (Triton wide tiles 491), HCA 553 (617),
CSA 1017 (1335); the sweep's four layers 2561 against 2935 µs (``bench/results/engine/2026-12-01-s27-prefill.md``).
"""

from __future__ import annotations

import logging

import torch

try:  # Gluon's Hopper module (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    HAVE_GLUON = False

log = logging.getLogger(__name__)

BLOCK_H = 64  # heads a program (the MMAs' M)
HEAD_DIM = 512  # the only width it takes (V4's); each warpgroup accumulates half of it
BLOCK_N = 64  # keys a step
STAGES = 2  # the key ring: 64 KB of query + 2 x 64 KB of keys + 8 KB of P in shared memory
NUM_WARPS = 8
FAILED = False  # set once a build fails: every later call keeps the Triton tiles
# DEEPINFER_ATTN_PREFILL == "gluon" (its default): the nvidia backend hands the setting over (backends.nvidia.settings)
ENABLED = True


def use(q: torch.Tensor) -> bool:
    """Whether ``sparse_attention_gather``'s wide tiles run here: ``ENABLED`` (``DEEPINFER_ATTN_PREFILL=gluon``, the
    default), Gluon, an sm_90 GPU, bf16 ``q [n, H, 512]`` with ``H`` a multiple of ``BLOCK_H``, no failed build
    (checked on the host)."""
    if not ENABLED or FAILED or not HAVE_GLUON:
        return False
    if not (q.is_cuda and q.dtype == torch.bfloat16 and q.shape[2] == HEAD_DIM and q.shape[1] % BLOCK_H == 0):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


if HAVE_GLUON:

    @gluon.jit
    def _issue_keys(k_ptr, p_ptr, pages_ptr, N1, R, kid, valid, k_smem, slot, D: gl.constexpr, KL: gl.constexpr,
                    PAGED: gl.constexpr):  # fmt: skip
        """``cp.async`` of the rows ``kid`` (``kernels.paged_keys``' numbering) into ring slot ``slot``; rows past the
        list are zero-filled."""
        if PAGED:
            j = gl.maximum(kid - N1, 0)
            page = gl.load(pages_ptr + j // R, mask=valid & (kid >= N1), other=0).to(gl.int64)
            at = gl.where(kid < N1, k_ptr + kid * D, p_ptr + (page * R + j % R) * D)
        else:
            at = k_ptr + kid * D
        d = gl.arange(0, D, layout=gl.SliceLayout(0, KL))
        async_copy.async_copy_global_to_shared(k_smem.index(slot), at[:, None] + d[None, :], mask=valid[:, None])

    @gluon.jit
    def _key_ids(idx_ptr, row, W, cnt, step, BLOCK_N: gl.constexpr, KL: gl.constexpr):
        """Step ``step``'s key ids (int64) and which of them are in the list."""
        j = step * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KL))
        valid = j < cnt
        return gl.load(idx_ptr + row * W + j, mask=valid, other=0).to(gl.int64), valid

    @gluon.jit
    def _wg_attention_kernel(q_ptr, k_ptr, p_ptr, pages_ptr, N1, R, idx_ptr, count_ptr, sink_ptr, out_ptr, W, scale,
                             H: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, PAGED: gl.constexpr):  # fmt: skip
        gl.static_assert(gl.num_warps() == 8)
        gl.static_assert(STAGES >= 2)
        # copies: 16 bytes a thread, a warp on 512 contiguous bytes of one row
        KL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        # both MMAs: the two warpgroups side by side along N (S: half the step's keys each; O: half the columns each)
        S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
        O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, D // 2, 16])  # fmt: skip
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
        KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
        PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)

        row = gl.program_id(0).to(gl.int64)
        h0 = gl.program_id(1) * BLOCK_H
        cnt = gl.minimum(gl.maximum(gl.load(count_ptr + row).to(gl.int32), 0), W)  # count may be int64
        nsteps = gl.cdiv(cnt, BLOCK_N)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], QS)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], KS)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], PS)

        hq = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, KL))
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, KL))
        q_at = q_ptr + row * (H * D) + hq.to(gl.int64)[:, None] * D + dq[None, :]
        async_copy.async_copy_global_to_shared(q_smem, q_at)  # joins the first key group
        for i in gl.static_range(STAGES - 1):
            kid, valid = _key_ids(idx_ptr, row, W, cnt, i, BLOCK_N, KL)
            _issue_keys(k_ptr, p_ptr, pages_ptr, N1, R, kid, valid, k_smem, i, D, KL, PAGED)
            async_copy.commit_group()
        # the ids of the step the loop issues first, loaded a step ahead of their copies
        kid, valid = _key_ids(idx_ptr, row, W, cnt, STAGES - 1, BLOCK_N, KL)

        hs = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_MMA))
        m = gl.load(sink_ptr + hs)  # running max, seeded with the sink: masked logits give exp(-inf) = 0
        den = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_MMA))
        acc = gl.zeros([BLOCK_H, D], gl.float32, O_MMA)
        zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_MMA)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
        for step in range(nsteps):
            slot = step % STAGES
            async_copy.wait_group(STAGES - 2)  # this thread's copies of this step (and the query)
            fence_async_shared()  # the copies' writes before wgmma's reads (another proxy)
            gl.thread_barrier()  # every thread's, and every warpgroup past the MMAs of step - 1
            keys = k_smem.index(slot)
            s = warpgroup_mma(q_smem, keys.permute((1, 0)), zero_s, use_acc=False)
            s = gl.where(((step * BLOCK_N + offs_n) < cnt)[None, :], s * scale, float("-inf"))
            m_new = gl.maximum(m, gl.max(s, axis=1))
            alpha = gl.exp(m - m_new)
            p = gl.exp(s - m_new[:, None])
            den = den * alpha + gl.sum(p, axis=1)
            m = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # both halves of P written
            acc = warpgroup_mma(p_smem, keys, acc, is_async=True)
            # the copies STAGES - 1 steps ahead go into the slot step - 1 read (its MMAs finished before the barrier)
            ahead = step + STAGES - 1
            if ahead < nsteps:
                _issue_keys(k_ptr, p_ptr, pages_ptr, N1, R, kid, valid, k_smem, ahead % STAGES, D, KL, PAGED)
            async_copy.commit_group()
            kid, valid = _key_ids(idx_ptr, row, W, cnt, ahead + 1, BLOCK_N, KL)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        async_copy.wait_group(0)

        den = den + gl.exp(gl.load(sink_ptr + hs) - m)
        out = acc / gl.convert_layout(den, gl.SliceLayout(1, O_MMA))[:, None]
        out = gl.convert_layout(out.to(gl.bfloat16), KL)
        gl.store(out_ptr + row * (H * D) + hq.to(gl.int64)[:, None] * D + dq[None, :], out)


def sparse_attention_wgmma(
    q: torch.Tensor,
    keys: torch.Tensor,
    store: torch.Tensor,
    pages: torch.Tensor,
    rows_per_page: int,
    paged: bool,
    idx: torch.Tensor,
    count: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The wide tiles' attention (module docstring) → ``[n, H, 512]`` bf16, or None where the build failed (logged
    once; the caller runs the Triton tiles). Arguments as ``sparse_attention_gather`` passes its kernel: validated,
    contiguous, non-empty; ``use(q)`` holds."""
    global FAILED
    n, H, d = q.shape
    out = torch.empty_like(q) if out is None else out
    try:
        _wg_attention_kernel[(n, H // BLOCK_H)](
            q, keys, store, pages, keys.shape[0], rows_per_page, idx, count, sink, out, idx.shape[1], float(scale),
            H=H, D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=STAGES, PAGED=paged, num_warps=NUM_WARPS,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - Gluon's API moves between Triton releases: keep serving on Triton
        FAILED = True
        log.warning("attention_wgmma_failed: %s: %s", type(e).__name__, str(e)[:3000])
        return None
    return out


__all__ = ["BLOCK_H", "ENABLED", "HAVE_GLUON", "sparse_attention_wgmma", "use"]
