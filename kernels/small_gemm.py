"""Small-M GEMMs with an fp32 output in one launch: ``out [M, N] = x · wᵀ`` for bf16 / fp16 ``x [M, K]``, ``w [N, K]``.

Decode's fp32 GEMMs (the routers, the compressors' and indexer's projections through ``NvidiaOps.linear_fp32``, and
the mHC mixes through ``hc.split_mixes_parts``) have a handful of rows against 0.5–16 MB of weights; cuBLAS runs them
as a split-K GEMM plus a ``splitKreduce`` kernel, two launches each. ``small_mm_fp32`` is one launch: the products of
two bf16 / fp16 values are exact in fp32 and ``tl.dot`` accumulates them in fp32, so the result is the fp32 GEMM
``x.float() @ w.float().T`` up to the order of its sums.

* ``_small_mm_kernel``, grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), S)``: program ``(n, m, s)`` computes the tile
  ``outᵀ[n · BLOCK_N:, m · BLOCK_M:]`` as ``W · xᵀ`` (the weight on the MMA's wide side, the tokens padded to
  ``BLOCK_M ≥ 16``; as ``fp8_gemm._w8a16_kernel``) over the K range ``[s · CHUNK, (s + 1) · CHUNK) ∩ [0, K)``
  (``CHUNK`` a multiple of ``BLOCK_K``), one ``[BLOCK_N, BLOCK_K] × [BLOCK_K, BLOCK_M]`` dot per step into an fp32
  accumulator. Rows and columns past the end re-read valid ones (their stores are masked); the tail of K is masked
  to exact zeros. With ``S == 1`` it stores the output itself.
* Split-K (``S > 1``) in the same launch: each program stores its partial to fp32 scratch ``[S, M, N]``, waits for
  all its threads' stores (a CTA barrier) and takes a ticket, ``atomic_add(counter[tile], 1)`` with acquire-release
  semantics at GPU scope. The program that draws ticket ``S - 1`` (the last of its tile to finish) reads the ``S``
  partials from L2 (``.cg``: not from L1) and sums them lane-wise in the fixed order ``s = 0, 1, …, S - 1``, stores
  the output and sets the counter back to 0. The sum does not depend on which program finished last, so results are
  bit-identical between calls, eager or replayed from a CUDA graph. The counters are one int32 buffer per device
  (``counters``: ``COUNTERS`` of them, zeroed once when made, and left at zero by every call), so a call launches
  nothing but the kernel. Two launches on different streams of one device must not overlap (they would share
  counters); decode runs on one stream.

``plan`` picks ``BLOCK_M`` and the split ``S`` on the host from the shapes and the SM count alone (about
``PROGRAMS_PER_SM`` programs per SM, at most ``MAX_SPLIT`` splits and ``REDUCE_BYTES`` of partials per tile, each split
at least one ``BLOCK_K`` step): no device value is read, so a call can be captured in a CUDA graph once ``counters``
exists for the device (the callers' eager warm-up makes it; ``ready`` says whether a call may run now). Results depend
on ``S`` only through the fp32 summation order. The callers take the kernel (``applies``) for CUDA tensors of at most
``MAX_M`` rows and ``MAX_MN`` outputs while ``ENABLED`` (a benchmark's A/B switch), ``torch.mm`` otherwise. Under
``TRITON_INTERPRET=1`` the tiles are cast to fp32 before the dot (the interpreter's bf16 dot is wrong; fp32 products of
the same values are the same exact products).
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import PLAN_ROWS, is_pinned, row_slices

ENABLED = True  # the callers (``NvidiaOps.linear_fp32``, ``hc.split_mixes_parts``) use the kernel (False: torch.mm)
# the callers take it for at most MAX_M rows and MAX_MN outputs: on an H200 at decode's shapes within them 4.0-7.5 µs
# (CUDA graphs) against cuBLAS's 4.1-11.8, faster but for the head's mixes at M = 1 (5.7 against 4.1: cuBLAS's one
# GEMV launch) and V4.1's layer mixes at M = 64 (7.5 against 7.0); past MAX_MN (64 × 1024, say) cuBLAS is faster
MAX_M, MAX_MN = 64, 16384
BLOCK_N = 32  # weight rows per program (the MMA's wide side)
BLOCK_K = 256  # K elements per step of a program's K loop
BLOCK_M_MAX = 16  # tokens per program at most (more tokens: more tiles, the weight re-read from L2)
NUM_WARPS = 4
NUM_STAGES = 3
PROGRAMS_PER_SM = 2  # split K until there are about this many programs per SM …
MAX_SPLIT = 32  # … into at most this many parts (the last program of a tile sums them, unrolled) …
REDUCE_BYTES = 32768  # … of which it reads at most about this many bytes
COUNTERS = 4096  # int32 tickets per device: a split call has at most this many tiles (else it takes S = 1)
# pinned calls (kernels.pinning) take the plan made for this many rows whatever they have (any count up to PLAN_ROWS
# in one launch: more tiles of BLOCK_M rows); the value defines pinned results. On an H100 at decode's shapes 16, 32
# and 64 are within 2 µs of each other at 1 and 64 rows; 32 the least at 64 (bench/kernels/pinned_plans.py)
PINNED_ROWS = 32
DEFAULT_SMS = 132  # an H200's; used without a GPU (the interpreter)
_HALF = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _small_mm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, CHUNK,
    S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    F32_DOT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    wrow = (rn % N).to(tl.int64) * stride_wn  # rows / columns past the end re-read valid ones (stores are masked)
    xrow = (rm % M).to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # outᵀ tile: the weight is the MMA's wide operand
    k_lo = pid_k * CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :])
            xt = tl.load(x_ptr + xrow[None, :] + kk[:, None])
        else:
            w = tl.load(w_ptr + wrow[:, None] + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            xt = tl.load(x_ptr + xrow[None, :] + kk[:, None], mask=(kk < K)[:, None], other=0.0)
        if F32_DOT:  # the interpreter: exact fp32 products of the same values
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    offs = rm.to(tl.int64)[None, :] * N + rn[:, None]  # [M, N] row-major, read as the tile's transpose
    if S == 1:
        tl.store(out_ptr + offs, acc, mask=mask)
    else:
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * mn + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket's release
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == S - 1:  # the tile's last program: all S partials are stored (acquired with the ticket)
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, S):  # s = 1, 2, …, S - 1 in order
                total += tl.load(part_ptr + s * mn + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total, mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, lane) -> its tickets (zero between calls)
# The lane of the calling code: 0, or 1 inside the side branch of Ops.parallel (backends.nvidia.streams), whose kernels
# may run at the same time as lane 0's: each lane draws its tickets from its own counters.
LANE: contextvars.ContextVar[int] = contextvars.ContextVar("small_gemm_lane", default=0)


def _device_key(device: torch.device) -> tuple[torch.device, int]:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, LANE.get()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def ready(device: torch.device) -> bool:
    """Whether ``small_mm_fp32`` may run on ``device`` now: always, except inside a CUDA-graph capture before the
    device's counters exist (their zeroing would only run at replay)."""
    return _device_key(device) in _COUNTERS or not _capturing(device)


def counters(device: torch.device) -> torch.Tensor:
    """The ``COUNTERS`` int32 tickets of the device and the caller's ``LANE``, zeroed once when first asked for
    (outside a CUDA-graph capture); every split call leaves them at zero."""
    key = _device_key(device)
    cnt = _COUNTERS.get(key)
    if cnt is None:
        if _capturing(key[0]):
            raise RuntimeError("small_mm_fp32: call it once on this device outside CUDA-graph capture first")
        cnt = _COUNTERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=key[0])
    return cnt


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a caller should take ``small_mm_fp32`` for ``x [.., K] · w [N, K]ᵀ``: ``ENABLED``, CUDA tensors of one
    half dtype, at most ``MAX_M`` rows and ``MAX_MN`` outputs (any number when pinned, ``kernels.pinning``: one
    GEMM for every row count), and ``ready``."""
    if not (ENABLED and x.is_cuda and w.is_cuda and x.dtype == w.dtype and x.dtype in _HALF and w.dim() == 2):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (is_pinned() or (rows <= MAX_M and rows * w.shape[0] <= MAX_MN)) and ready(x.device)


def block_m_for(m: int) -> int:
    """Tokens per program: ``next_power_of_2(m)`` within ``[16, BLOCK_M_MAX]`` (16: the smallest dot)."""
    return max(16, min(BLOCK_M_MAX, triton.next_power_of_2(max(m, 1))))


def plan(
    m: int, n: int, k: int, sms: int = DEFAULT_SMS, split: int | None = None, rows_at_most: int = 0
) -> tuple[int, int, int]:
    """``(BLOCK_M, S, CHUNK)`` for ``[m, k] × [n, k]ᵀ`` on ``sms`` SMs, from the shapes alone: ``S`` splits of
    ``CHUNK`` (a multiple of ``BLOCK_K``) elements of K, none empty; about ``PROGRAMS_PER_SM · sms`` programs,
    ``S ≤ MAX_SPLIT``. ``split`` overrides the target (still capped, and 1 when the tiles outnumber ``COUNTERS``:
    the tiles of ``rows_at_most`` rows where a call under this plan may have that many, a pinned one)."""
    bm = block_m_for(m)
    tiles = triton.cdiv(max(m, 1), bm) * triton.cdiv(max(n, 1), BLOCK_N)
    steps = triton.cdiv(max(k, 1), BLOCK_K)
    s = max(1, PROGRAMS_PER_SM * sms // tiles) if split is None else max(1, int(split))
    reduce = max(1, REDUCE_BYTES // (min(m, bm) * BLOCK_N * 4))  # partials the tile's last program reads
    most = triton.cdiv(max(m, rows_at_most, 1), bm) * triton.cdiv(max(n, 1), BLOCK_N)
    s = 1 if most > COUNTERS else min(s, MAX_SPLIT, reduce, steps)
    chunk = triton.cdiv(steps, s)
    return bm, triton.cdiv(steps, chunk), chunk * BLOCK_K


def small_mm_fp32(x: torch.Tensor, w: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """``x [M, K] · w [N, K]ᵀ`` → ``[M, N]`` fp32 (module docstring): ``x`` and ``w`` bf16 or fp16, of one dtype,
    on one device (CUDA, or any under ``TRITON_INTERPRET=1``), unit stride along K (else copied). Meant for
    ``M ≤ MAX_M``; any ``M`` works. ``split`` overrides ``plan``'s target split (results differ between splits only
    by fp32 summation order). Pinned (``kernels.pinning``): planned for ``PINNED_ROWS`` rows, in slices of
    ``PLAN_ROWS``."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"small_mm_fp32 takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in _HALF:
        raise TypeError(f"small_mm_fp32 takes x and w both bfloat16 or both float16, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, w on {w.device}")
    if not x.is_cuda and not _interpret():
        raise RuntimeError("small_mm_fp32 needs CUDA tensors or TRITON_INTERPRET=1")
    m, k = x.shape
    n = w.shape[0]
    if len(slices := row_slices(m)) > 1:
        return torch.cat([small_mm_fp32(x[a:b], w, split) for a, b in slices])
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    sms = _sm_count(x.device.index or 0) if x.is_cuda and not _interpret() else DEFAULT_SMS
    if is_pinned():  # (kernels.pinning) one plan for every row count up to PLAN_ROWS
        if not 1 <= PINNED_ROWS <= PLAN_ROWS:
            raise ValueError(f"small_gemm.PINNED_ROWS must be in [1, {PLAN_ROWS}], got {PINNED_ROWS}")
        bm, s, chunk = plan(PINNED_ROWS, n, k, sms, split, rows_at_most=PLAN_ROWS)
    else:
        bm, s, chunk = plan(m, n, k, sms, split)
    if s == 1:
        part, cnt = out, out  # unused
    else:
        cnt = counters(x.device)
        part = torch.empty((s, m, n), dtype=torch.float32, device=x.device)
    _small_mm_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(m, bm), s)](
        x, w, out, part, cnt, m, n, k, x.stride(0), w.stride(0), chunk,
        S=s, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, EVEN_K=k % BLOCK_K == 0, F32_DOT=_interpret(),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.launch(),
    )  # fmt: skip
    return out


__all__ = ["ENABLED", "MAX_M", "PINNED_ROWS", "applies", "block_m_for", "counters", "plan", "ready", "small_mm_fp32"]
