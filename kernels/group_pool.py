"""A compressor's softmax-gated group pooling in one Triton kernel, reading each group from a ring by index.

In a decode step every sequence (row ``s`` of ``S``) has appended its fp32 projections to the compressor's ring
buffers ``kv`` and ``score`` (viewed flat ``[N, C]``); row ``s``'s group is the ``m`` ring rows ``cur[s]``. The
pooled row is, per channel ``c < d``, ``sum_j softmax_j(score_j[c]) · kv_j[c]`` over the group's rows ``j``:

* non-overlapping (HCA, ``prev is None``): ``C = d``, the ``m`` rows ``cur[s]``, all ``d`` channels;
* overlapping (CSA): ``C = 2d``, ``2m`` rows: first the previous group ``prev[s]``'s first half of the channels
  (``[0, d)``) -- only where ``has_prev[s]``; otherwise these ``m`` rows count as value 0 with score ``-inf`` -- then
  the current group ``cur[s]``'s second half (``[d, 2d)``).

Rows with ``live[s]`` False are zeros (the torch path pools every row and keeps the completed ones; these pool only
the rows the caller marks live). A channel whose every score is ``-inf`` is NaN, as torch's softmax makes it.

The torch definition is ``ReferenceOps.group_pool`` (``deepinfer.backends.reference``, what the tests check this
against): ``Compressor._rows``'s gather/``where``/``cat`` construction and ``ReferenceOps.softmax_pool``'s expression,
bit for bit, then the ``live`` mask. ``group_pool`` is the kernel: grid
``(S, cdiv(d, BLOCK_D))``; a program loads its row's ``live`` flag and stores zeros if it is False; otherwise it
loads the group's ring rows of its channel block through the indices, takes the per-channel max over the rows,
``e = exp(score - max)``, ``p = e / sum(e)`` and ``sum(p · kv)``, all in fp32. When the group's rows times
``BLOCK_D`` fit the register budget (the real shapes: HCA ``m = 128`` with ``BLOCK_D = 32``, CSA ``m = 4`` with
``BLOCK_D = 128``) it loads them once; otherwise it walks the rows in chunks of ``BLOCK_R`` three times (max, sum,
weighted sum). Equal to the reference to about 1e-7 relative (the order of the sums and the division differ; on a
GPU ``tl.exp`` is the fast ``ex2`` path). No host synchronisation: the call can be captured in a CUDA graph; the
indices are not checked (an index outside ``[0, N)`` of a live row, or of a ``has_prev`` row's ``prev``, is
undefined behaviour).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait

_TILE = 4096  # fp32 elements of one [rows, BLOCK_D] tile of kv (and one of score) a program holds at a time


@triton.jit
def _tile(kv_ptr, sc_ptr, idx_ptr, stride_ir, stride_ic, stride_kr, stride_kc, stride_sr, stride_sc, s, r, rmask,
          col, cmask):  # fmt: skip
    """``kv`` and ``score`` ``[BLOCK_R, BLOCK_D]`` of ring rows ``idx[s, r]``, channels ``col``; rows outside
    ``rmask`` are value 0 and score ``-inf``, channels outside ``cmask`` value 0 and score 0 (never stored)."""
    idx = tl.load(idx_ptr + s * stride_ir + r.to(tl.int64) * stride_ic, mask=rmask, other=0)
    mask = rmask[:, None] & cmask[None, :]
    k = tl.load(kv_ptr + idx[:, None] * stride_kr + col[None, :] * stride_kc, mask=mask, other=0.0)
    sc = tl.load(sc_ptr + idx[:, None] * stride_sr + col[None, :] * stride_sc, mask=mask, other=0.0)
    return k, tl.where(rmask[:, None], sc, float("-inf"))


@triton.jit
def _group_pool_kernel(kv_ptr, sc_ptr, cur_ptr, prev_ptr, hp_ptr, live_ptr, out_ptr, M, D,
                       stride_kr, stride_kc, stride_sr, stride_sc, stride_cr, stride_cc, stride_pr, stride_pc,
                       stride_or, OVERLAP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       NCHUNK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = c < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if tl.load(live_ptr + s) != 0:
        if OVERLAP:
            # a vector, not a scalar: Triton 3.9's interpreter turns `tensor & scalar comparison` into an int32 mask
            hp = (tl.zeros([BLOCK_R], tl.int32) + tl.load(hp_ptr + s).to(tl.int32)) != 0
            ccol = c + D  # the current group's half of the channels
        else:
            hp = False
            ccol = c
        if NCHUNK == 1:  # the whole group in registers: one load
            r = tl.arange(0, BLOCK_R)
            kc, scc = _tile(kv_ptr, sc_ptr, cur_ptr, stride_cr, stride_cc, stride_kr, stride_kc, stride_sr,
                            stride_sc, s, r, r < M, ccol, cmask)  # fmt: skip
            mx = tl.max(scc, axis=0)
            if OVERLAP:
                kp, scp = _tile(kv_ptr, sc_ptr, prev_ptr, stride_pr, stride_pc, stride_kr, stride_kc, stride_sr,
                                stride_sc, s, r, (r < M) & hp, c, cmask)  # fmt: skip
                mx = tl.maximum(tl.max(scp, axis=0), mx)
                ep = tl.exp(scp - mx[None, :])
            ec = tl.exp(scc - mx[None, :])
            den = tl.sum(ec, axis=0)
            if OVERLAP:
                den = tl.sum(ep, axis=0) + den
                acc = tl.sum(ep / den[None, :] * kp, axis=0)
            acc = acc + tl.sum(ec / den[None, :] * kc, axis=0)
        else:  # chunks of BLOCK_R rows: max, sum of exponentials, weighted sum
            mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
            for i in range(NCHUNK):
                r = i * BLOCK_R + tl.arange(0, BLOCK_R)
                if OVERLAP:
                    _, scp = _tile(kv_ptr, sc_ptr, prev_ptr, stride_pr, stride_pc, stride_kr, stride_kc, stride_sr,
                                   stride_sc, s, r, (r < M) & hp, c, cmask)  # fmt: skip
                    mx = tl.maximum(mx, tl.max(scp, axis=0))
                _, scc = _tile(kv_ptr, sc_ptr, cur_ptr, stride_cr, stride_cc, stride_kr, stride_kc, stride_sr,
                               stride_sc, s, r, r < M, ccol, cmask)  # fmt: skip
                mx = tl.maximum(mx, tl.max(scc, axis=0))
            den = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i in range(NCHUNK):
                r = i * BLOCK_R + tl.arange(0, BLOCK_R)
                if OVERLAP:
                    _, scp = _tile(kv_ptr, sc_ptr, prev_ptr, stride_pr, stride_pc, stride_kr, stride_kc, stride_sr,
                                   stride_sc, s, r, (r < M) & hp, c, cmask)  # fmt: skip
                    den += tl.sum(tl.exp(scp - mx[None, :]), axis=0)
                _, scc = _tile(kv_ptr, sc_ptr, cur_ptr, stride_cr, stride_cc, stride_kr, stride_kc, stride_sr,
                               stride_sc, s, r, r < M, ccol, cmask)  # fmt: skip
                den += tl.sum(tl.exp(scc - mx[None, :]), axis=0)
            for i in range(NCHUNK):
                r = i * BLOCK_R + tl.arange(0, BLOCK_R)
                if OVERLAP:
                    kp, scp = _tile(kv_ptr, sc_ptr, prev_ptr, stride_pr, stride_pc, stride_kr, stride_kc, stride_sr,
                                    stride_sc, s, r, (r < M) & hp, c, cmask)  # fmt: skip
                    acc += tl.sum(tl.exp(scp - mx[None, :]) / den[None, :] * kp, axis=0)
                kc, scc = _tile(kv_ptr, sc_ptr, cur_ptr, stride_cr, stride_cc, stride_kr, stride_kc, stride_sr,
                                stride_sc, s, r, r < M, ccol, cmask)  # fmt: skip
                acc += tl.sum(tl.exp(scc - mx[None, :]) / den[None, :] * kc, axis=0)
    tl.store(out_ptr + s * stride_or + c, acc, mask=cmask)


def _check(
    kv: torch.Tensor,
    score: torch.Tensor,
    cur: torch.Tensor,
    prev: torch.Tensor | None,
    has_prev: torch.Tensor,
    live: torch.Tensor,
    d: int,
) -> None:
    """Raise ``ValueError`` unless the arguments have ``group_pool``'s shapes, dtypes and one device."""
    if kv.dim() != 2 or kv.dtype != torch.float32 or score.dtype != torch.float32 or score.shape != kv.shape:
        raise ValueError(
            f"group_pool: kv and score must be fp32 [N, C] of one shape, got {kv.dtype} {tuple(kv.shape)} and "
            f"{score.dtype} {tuple(score.shape)}"
        )
    if d <= 0:
        raise ValueError(f"group_pool: d must be positive, got {d}")
    want = 2 * d if prev is not None else d
    if kv.shape[1] != want:
        kind = "overlapping (prev given): C = 2d" if prev is not None else "non-overlapping (prev None): C = d"
        raise ValueError(f"group_pool: {kind} = {want}, got C = {kv.shape[1]}")
    if cur.dim() != 2 or cur.dtype != torch.int64 or cur.shape[1] == 0:
        raise ValueError(f"group_pool: cur must be int64 [S, m] with m > 0, got {cur.dtype} {tuple(cur.shape)}")
    if prev is not None and (prev.dtype != torch.int64 or prev.shape != cur.shape):
        raise ValueError(
            f"group_pool: prev must be int64 of cur's shape {tuple(cur.shape)}, got {prev.dtype} {tuple(prev.shape)}"
        )
    s = cur.shape[0]
    for name, t in (("has_prev", has_prev), ("live", live)):
        if t.dtype != torch.bool or t.shape != (s,):
            raise ValueError(f"group_pool: {name} must be bool [S] = [{s}], got {t.dtype} {tuple(t.shape)}")
    tensors = [score, cur, has_prev, live] + ([prev] if prev is not None else [])
    if any(t.device != kv.device for t in tensors):
        raise ValueError(f"group_pool: every tensor must be on kv's device {kv.device}")


def group_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    cur: torch.Tensor,
    prev: torch.Tensor | None,
    has_prev: torch.Tensor,
    live: torch.Tensor,
    d: int,
    *,
    block_d: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """``ReferenceOps.group_pool`` in one Triton kernel (module docstring): ``kv``, ``score`` fp32 ``[N, C]`` (any
    strides), ``cur`` (and ``prev`` for an overlapping compressor, ``None`` for a non-overlapping one) int64 ``[S, m]``
    indices into their rows, ``has_prev`` and ``live`` bool ``[S]``; returns fp32 ``[S, d]``, zeros where not
    ``live``. ``block_d`` / ``block_r`` (powers of two) override the channel block and the row chunk (tests).
    On CUDA or under the Triton interpreter; no host synchronisation."""
    _check(kv, score, cur, prev, has_prev, live, d)
    s, m = cur.shape
    out = torch.empty(s, d, dtype=torch.float32, device=kv.device)
    if s == 0:
        return out
    parts = 2 if prev is not None else 1
    rows = triton.next_power_of_2(m)
    if block_d is None:
        block_d = max(16, min(128, _TILE // (parts * rows), triton.next_power_of_2(d)))
    if block_r is None:
        block_r = min(rows, max(1, _TILE // (parts * block_d)))
    for name, v in (("block_d", block_d), ("block_r", block_r)):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"group_pool: {name} must be a power of two, got {v}")
    block_r = min(block_r, rows)
    pv = prev if prev is not None else cur  # never read without an overlap
    _group_pool_kernel[(s, triton.cdiv(d, block_d))](
        kv, score, cur, pv, has_prev.view(torch.uint8), live.view(torch.uint8), out, m, d,
        kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), cur.stride(0), cur.stride(1),
        pv.stride(0), pv.stride(1), out.stride(0),
        OVERLAP=prev is not None, BLOCK_D=block_d, BLOCK_R=block_r, NCHUNK=triton.cdiv(m, block_r), num_warps=4,
        **pdl.launch(),
    )  # fmt: skip
    return out


__all__ = ["group_pool"]
