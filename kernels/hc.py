"""Fused mHC (manifold-constrained hyper-connection) kernels: one launch where the reference takes ~130.

The semantics are ``ReferenceOps.hc_mixes`` / ``hc_collapse`` / ``hc_expand`` (``deepinfer.backends.reference``):

* ``hc_pre(h, fn, scale, base, iters, eps, norm_eps)``: the mixes ``(flatten(h) · fnᵀ) · rsqrt(mean(h²) + norm_eps)``
  (the ``[T, M]`` product: bf16 streams on CUDA, one bf16 GEMM against ``fn`` split into three exact bf16 parts,
  ``split_mixes_parts``; otherwise ``h.float()`` and one fp32 ``torch.mm``, as the reference's ``F.linear``; with
  ``MIXES_KERNEL`` it is ``hc_mixes.mixes_gemm``, read straight from ``h`` in its dtype, slower on an H200 so far),
  then one Triton program per token that computes ``pre = sigmoid(·) + eps``,
  ``post = 2 · sigmoid(·)`` and the Sinkhorn ``comb`` (row softmax + eps, a column normalisation, then
  ``iters - 1`` row/column rounds, all in registers) and the collapse
  ``x = Σ_j pre_j · h_j`` (fp32 sum, ``h.dtype`` out). A program takes one token on a GPU and up to
  ``INTERPRET_ROWS`` in Triton's interpreter. With ``M == N`` (the head) only ``pre`` exists, and it is
  returned as ``post`` and ``comb`` too (as ``hc_mixes`` does).
* ``hc_expand(y, res, post, comb)``: ``out[:, k] = post[:, k] · y + Σ_j comb[:, j, k] · res[:, j]`` in fp32, one
  program per (token, block of ``D``).

Results agree with the reference to fp32 rounding (the reductions run in another order); the kernels never read a
device value on the host and are safe to capture in a CUDA graph.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl, small_gemm
from deepinfer.kernels.hc_mixes import mixes_gemm
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.pinning import is_pinned, plan_rows

HC_BLOCK_D = 1024  # elements per row and step of the row loops (one token per program on a GPU)
# decode sizes (at most SMALL_T tokens: fewer programs than SMs): wider steps on more warps, so that a token's two
# passes over its streams take 4 + 1 loads of the row instead of 16 + 4 (the program's latency is the step's)
SMALL_T, SMALL_BLOCK_D, SMALL_WARPS = 132, 4096, 8
HC_WARPS = 4  # warps of a program above SMALL_T tokens
# hc_expand: elements of a token's row per program, and its warps; above SMALL_T tokens a wider row (H200, 4096
# tokens at V4-Flash widths: 78 µs against 103 at 512, the roofline 72; bench/kernels/hc_prefill.py)
EXPAND_BLOCK_D, EXPAND_WARPS, EXPAND_WIDE_BLOCK_D = 512, 4, 2048
# the mixes by ``hc_mixes.mixes_gemm`` (True) or ``h.float()`` + ``torch.mm`` (False, the default: on an H200 the
# kernel took 2.1-2.7x longer, 18.7 against 6.8 µs at T = 1 and 710 against 333 µs at T = 4096;
# bench/kernels/decode_kernels.py, bench/results/engine/2026-11-30-whole-step-graph.md)
MIXES_KERNEL = False
INTERPRET_ROWS = 64  # tokens per program in Triton's interpreter (numpy vectorises a program, not a grid)
# bf16 streams on CUDA: the mixes as one bf16 GEMM against fn split into three bf16 parts (``split_mixes_parts``)
# instead of an fp32 copy of the streams and an fp32 GEMM
SPLIT_MIXES = True
_SPLITS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(fn) -> (fn, its version, split3(fn))


def split3(w: torch.Tensor) -> torch.Tensor:
    """``w [M, K]`` fp32 → ``[3M, K]`` bf16 ``(hi; mid; lo)`` with ``hi + mid + lo == w`` exactly (each part the
    nearest bf16 of what the previous ones leave: 8 + 8 + 8 significant bits hold fp32's 24, away from the bottom of
    bf16's exponent range, which it shares with fp32)."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo]).contiguous()


def cached_split3(fn: torch.Tensor) -> torch.Tensor:
    """``split3(fn)``, made once per weight tensor: the object itself and its version, not its address (a new tensor
    may reuse a freed one's address and id)."""
    ref, version, w3 = _SPLITS.get(id(fn), (None, -1, None))
    if ref is None or ref() is not fn or version != fn._version:
        if len(_SPLITS) > 1024:
            _SPLITS.clear()
        w3 = split3(fn)
        _SPLITS[id(fn)] = (weakref.ref(fn), fn._version, w3)
    return w3


def split_mixes_parts(h2: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """``h2 [T, K] bf16 · fnᵀ`` (``fn [M, K]`` fp32) as one bf16 GEMM with fp32 accumulation against
    ``cached_split3(fn)`` (each product of two bf16 values is exact in fp32), reading the streams once in bf16:
    ``[T, 3M]`` fp32, whose three column groups summed in fp32, ``(a + b) + c``, are the fp32 GEMM's result up to
    the order of its sums. ``_hc_pre_kernel`` adds them as it reads them (``PARTS = 3``). Up to
    ``small_gemm.MAX_M`` tokens (decode) the GEMM is ``small_gemm.small_mm_fp32`` (one launch, deterministic split-K)
    instead of cuBLAS's split-K GEMM and its reduction kernel."""
    w3 = cached_split3(fn)
    if small_gemm.applies(h2, w3):
        return small_gemm.small_mm_fp32(h2, w3)
    return torch.mm(h2, w3.t(), out_dtype=torch.float32)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mix(ptr, offs, mask, M: tl.constexpr, PARTS: tl.constexpr):
    """Mixes at ``offs`` of a row: one value, or (``PARTS = 3``, ``split_mixes_parts``' GEMM) the sum of its three
    column groups ``(a + b) + c`` in fp32."""
    v = tl.load(ptr + offs, mask=mask, other=0.0)
    if PARTS == 3:
        v = (v + tl.load(ptr + M + offs, mask=mask, other=0.0)) + tl.load(ptr + 2 * M + offs, mask=mask, other=0.0)
    return v


@triton.jit(do_not_specialize=["T", "iters"])
def _hc_pre_kernel(
    h_ptr,
    mix_ptr,
    scale_ptr,
    base_ptr,
    x_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    D,
    iters,
    eps,
    norm_eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    M: tl.constexpr,
    PARTS: tl.constexpr,
    HEAD: tl.constexpr,
    COLLAPSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    offs = tl.arange(0, BLOCK_D)
    # rsqrt(mean of squares) of each whole row (all N streams)
    sq = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, N * D, BLOCK_D):
        k = k0 + offs
        m = mt[:, None] & (k < N * D)[None, :]
        v = tl.load(h_ptr + t[:, None] * (N * D) + k[None, :], mask=m, other=0.0).to(tl.float32)
        sq += v * v
    rs = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / (N * D) + norm_eps)  # [BLOCK_T]
    i = tl.arange(0, NP)
    mi = i < N
    ti = mt[:, None] & mi[None, :]
    row = mix_ptr + t[:, None] * (M * PARTS)
    s0 = tl.load(scale_ptr)
    pre = _mix(row, i[None, :], ti, M, PARTS) * rs[:, None] * s0
    pre = tl.sigmoid(pre + tl.load(base_ptr + i, mask=mi, other=0.0)[None, :]) + eps
    pre = tl.where(ti, pre, 0.0)
    tl.store(pre_ptr + t[:, None] * N + i[None, :], pre, mask=ti)
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = _mix(row, N + i[None, :], ti, M, PARTS) * rs[:, None] * s1
        post = post + tl.load(base_ptr + N + i, mask=mi, other=0.0)[None, :]
        tl.store(post_ptr + t[:, None] * N + i[None, :], 2.0 * tl.sigmoid(post), mask=ti)
        jk = 2 * N + i[:, None] * N + i[None, :]  # [j, k] offsets of comb in a row of mixes
        mjk = mi[:, None] & mi[None, :]
        m3 = mt[:, None, None] & mjk[None, :, :]
        c = _mix(mix_ptr + t[:, None, None] * (M * PARTS), jk[None, :, :], m3, M, PARTS) * rs[:, None, None] * s2
        c = c + tl.load(base_ptr + jk, mask=mjk, other=0.0)[None, :, :]
        c = tl.where(m3, c, -1e30)  # finite: a padded row's max stays finite (no inf - inf)
        c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
        c = tl.where(m3, c, 0.0)
        den = tl.sum(c, axis=2)
        den = tl.where(den > 0, den, 1.0)  # padded rows: 0 / 1, not 0 / 0
        c = tl.where(m3, c / den[:, :, None] + eps, 0.0)  # softmax over k, + eps
        c = tl.where(m3, c / (tl.sum(c, axis=1)[:, None, :] + eps), 0.0)  # normalise over j (dim -2)
        for _ in range(iters - 1):  # padded lanes stay exact zeros (eps may be tiny: no 0/0)
            c = tl.where(m3, c / (tl.sum(c, axis=2)[:, :, None] + eps), 0.0)
            c = tl.where(m3, c / (tl.sum(c, axis=1)[:, None, :] + eps), 0.0)
        tl.store(comb_ptr + t[:, None, None] * (N * N) + (i[:, None] * N + i[None, :])[None, :, :], c, mask=m3)
    if COLLAPSE:  # x = Σ_j pre_j · h_j, j in order
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs
            m = mt[:, None] & (d < D)[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for j in tl.static_range(N):
                p = tl.sum(tl.where(i[None, :] == j, pre, 0.0), axis=1)  # exact: one term and zeros
                hv = tl.load(h_ptr + t[:, None] * (N * D) + j * D + d[None, :], mask=m, other=0.0)
                acc += p[:, None] * hv.to(tl.float32)
            tl.store(x_ptr + t[:, None] * D + d[None, :], acc.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _hc_expand_kernel(
    y_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    T,
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < T
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = mt[:, None] & (d < D)[None, :]
    k = tl.arange(0, NP)
    mk = mt[:, None] & (k < N)[None, :]
    y = tl.load(y_ptr + t[:, None] * D + d[None, :], mask=md, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t[:, None] * N + k[None, :], mask=mk, other=0.0)  # [T, k]
    out = post[:, :, None] * y[:, None, :]  # [T, k, d]
    for j in tl.static_range(N):
        res = tl.load(res_ptr + t[:, None] * (N * D) + j * D + d[None, :], mask=md, other=0.0).to(tl.float32)
        comb = tl.load(comb_ptr + t[:, None] * (N * N) + j * N + k[None, :], mask=mk, other=0.0)  # [T, k]
        out += comb[:, :, None] * res[:, None, :]
    m3 = mk[:, :, None] & md[:, None, :]
    dst = out_ptr + t[:, None, None] * (N * D) + k[None, :, None] * D + d[None, None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m3)


def _mixes(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    collapse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, d = h.shape
    m = fn.shape[0]
    h = h.contiguous()
    parts = 1  # column groups of the mixes the kernel sums as it reads them
    if MIXES_KERNEL and (h.is_cuda or _interpret()):
        mixes = mixes_gemm(h, fn)
    elif SPLIT_MIXES and h.is_cuda and h.dtype == torch.bfloat16:
        mixes, parts = split_mixes_parts(h.view(t, n * d), fn), 3
    elif is_pinned() and (h.is_cuda or _interpret()):  # one plan for any token count (torch.mm's varies with it)
        mixes = mixes_gemm(h, fn)
    else:
        mixes = torch.mm(h.view(t, n * d).float(), fn.float().t()).contiguous()
    return _from_mixes(h, mixes, parts, m, scale, base, iters, eps, norm_eps, collapse)


def _from_mixes(
    h: torch.Tensor,
    mixes: torch.Tensor,
    parts: int,
    m: int,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    collapse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_hc_pre_kernel`` on the mixes ``[T, parts · M]`` (``parts`` column groups it sums as it reads them)."""
    t, n, d = h.shape
    head = m == n
    pre = torch.empty((t, n), dtype=torch.float32, device=h.device)
    x = torch.empty((t, d), dtype=h.dtype, device=h.device) if collapse else pre  # unused without the collapse
    post = pre if head else torch.empty((t, n), dtype=torch.float32, device=h.device)
    comb = pre if head else torch.empty((t, n, n), dtype=torch.float32, device=h.device)
    if t:
        bt = min(INTERPRET_ROWS, triton.next_power_of_2(plan_rows(t))) if _interpret() else 1
        small = plan_rows(t) <= SMALL_T and not _interpret()  # (kernels.pinning: pinned, as for PLAN_ROWS tokens)
        block, warps = (SMALL_BLOCK_D, SMALL_WARPS) if small else (HC_BLOCK_D, HC_WARPS)
        _hc_pre_kernel[(triton.cdiv(t, bt),)](
            h, mixes, scale.float().contiguous(), base.float().contiguous(), x, pre, post, comb,
            t, d, int(iters), float(eps), float(norm_eps),
            N=n, NP=triton.next_power_of_2(n), M=m, PARTS=parts, HEAD=head, COLLAPSE=collapse, BLOCK_T=bt,
            BLOCK_D=min(block, triton.next_power_of_2(d)), num_warps=warps, **pdl.launch(),
        )  # fmt: skip
    return x, pre, post, comb


def hc_mixes(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ReferenceOps.hc_mixes``: ``(pre [T, N], post [T, N], comb [T, N, N])`` fp32 of streams ``h [T, N, D]``."""
    _, pre, post, comb = _mixes(h, fn, scale, base, iters, eps, norm_eps, collapse=False)
    return pre, post, comb


def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hc_collapse(h, pre), post, comb)`` of ``hc_mixes`` (module docstring): ``h [T, N, D]`` → ``[T, D]`` in
    ``h.dtype``, ``post [T, N]``, ``comb [T, N, N]`` fp32 (the head: ``M == N``, ``pre`` as ``post`` and ``comb``)."""
    x, _, post, comb = _mixes(h, fn, scale, base, iters, eps, norm_eps, collapse=True)
    return x, post, comb


def hc_expand(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``ReferenceOps.hc_expand``: ``y [T, D]``, ``res [T, N, D]``, ``post [T, N]``, ``comb [T, N, N]`` →
    ``[T, N, D]`` in ``y.dtype``."""
    t, n, d = res.shape
    out = torch.empty((t, n, d), dtype=y.dtype, device=y.device)
    if t:
        block = min(EXPAND_BLOCK_D if plan_rows(t) <= SMALL_T else EXPAND_WIDE_BLOCK_D, triton.next_power_of_2(d))
        bt = min(INTERPRET_ROWS, triton.next_power_of_2(plan_rows(t))) if _interpret() else 1
        _hc_expand_kernel[(triton.cdiv(t, bt), triton.cdiv(d, block))](
            y.contiguous(), res.contiguous(), post.float().contiguous(), comb.float().contiguous(), out, t, d,
            N=n, NP=triton.next_power_of_2(n), BLOCK_T=bt, BLOCK_D=block, num_warps=EXPAND_WARPS, **pdl.launch(),
        )  # fmt: skip
    return out


__all__ = ["hc_expand", "hc_mixes", "hc_pre"]
