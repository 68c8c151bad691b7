"""Batch-invariant ops (``DEEPINFER_BATCH_INVARIANT=1``, docs/determinism.md).

A row's result must not depend on the other rows of a call, on its position among them, or on how a
sequence's prefill was chunked. Library GEMMs break this: BLAS picks kernels, blockings and split-K
by the number of rows (measured on this project's CPU torch/MKL: ``F.linear`` of one row differs
from the same row inside 2..15 rows, and with 2 threads a 64-row call splits K differently from a
16-row one). Reductions whose length depends on the batch break it too (a softmax over keys padded
to the longest sequence of the batch). Everything here is built from two primitives whose result
for a row depends only on that row:

* ``_mm``: a matrix product with a fixed tile. cpu: the rows are cut into tiles of ``TILE_M`` rows
  (the last zero-padded) and every tile is one ``F.linear`` call of the same shape, so every row
  meets the same GEMM kernel, blocking and thread split. nvidia: ``kernels.invariant.matmul_fixed``
  (fixed Triton tiles, no split-K).
* ``_rowsum``: an fp32 sum over the last dim that trailing zeros do not change. cpu: blocks of
  ``BLOCK`` elements summed as full vectors, then a left fold over the blocks; nvidia:
  ``kernels.invariant.rowsum`` (lane accumulators, one program per row).

Attention gathers each query's visible keys into a canonical order (window rows by position, then
compressed rows by index), left-aligned and zero-padded, so the keys a query sees, their order and
their padding depend only on the query. Maxima, sorts (stable) and element-wise ops are exact.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.backends.reference.ops import ReferenceOps

TILE_M = 16  # rows per GEMM call on the cpu backend
BLOCK = 64  # elements per block of a padded sum (one full AVX-512 fp32 accumulator set)
_SLICE_ELEMS = 1 << 22  # bound on the element-wise temporaries (splits rows, never a row)


def _cpu_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    if m == 0:
        return x.new_zeros(0, w.shape[0])
    tiles = -(-m // TILE_M)
    buf = x.new_zeros(tiles * TILE_M, k)
    buf[:m] = x
    out = [F.linear(buf[i * TILE_M : (i + 1) * TILE_M], w) for i in range(tiles)]  # 64-byte aligned views
    return torch.cat(out)[:m]


def _cpu_rowsum(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    n = x.shape[-1]
    if n <= BLOCK:
        return x.sum(-1) if n == BLOCK else F.pad(x, (0, BLOCK - n)).sum(-1)
    nb = -(-n // BLOCK)
    parts = F.pad(x, (0, nb * BLOCK - n)).unflatten(-1, (nb, BLOCK)).sum(-1)
    acc = parts[..., 0]
    for b in range(1, nb):  # left fold: trailing zero blocks add exact zeros
        acc = acc + parts[..., b]
    return acc


def scalar_loop(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` through torch's scalar loop for every element: a stride-2 view is never vectorised."""
    buf = x.new_empty(*x.shape, 2)
    buf[..., 0] = x
    return fn(buf[..., 0])


def _cuda_primitives() -> tuple[Callable, Callable]:
    try:
        from deepinfer.kernels.invariant import matmul_fixed, rowsum
    except ImportError as e:  # pragma: no cover - needs a CUDA host without triton
        raise RuntimeError(
            f"DEEPINFER_BATCH_INVARIANT=1 on nvidia needs the Triton kernels (pip install 'deepinfer[nvidia]'): {e}"
        ) from e
    return matmul_fixed, rowsum


class BatchInvariantOps(ReferenceOps):
    """The reference semantics with batch-invariant reductions (module docstring)."""

    batch_invariant = True
    invariant_by_sequence = True  # its attention gathers one sequence's keys at a time (the model's per-sequence path)
    invariance = f"batch-invariant v1 (tile_m={TILE_M}, block={BLOCK})"

    def __init__(self, device_name: str = "cpu") -> None:
        super().__init__(device_name)
        if device_name == "nvidia":
            self._mm, self._rowsum = _cuda_primitives()
        elif device_name == "cpu":
            self._mm, self._rowsum = _cpu_mm, _cpu_rowsum
        else:
            raise RuntimeError(f"DEEPINFER_BATCH_INVARIANT=1 is not supported on the {device_name!r} backend")

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # CUDA element-wise kernels run the same code for every element; the CPU ones do not
        return scalar_loop(fn, x) if self.name == "cpu" else fn(x)

    # -- products ------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype != w.dtype:
            raise ValueError(f"linear: input {x.dtype} and weight {w.dtype} differ")
        return self._mm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.linear(x[:, g], w[g]) for g in range(w.shape[0])], dim=1)

    def _dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``Σ_d a·b`` over the last dim of broadcast operands, in row slices."""
        shape = torch.broadcast_shapes(a.shape, b.shape)
        if not shape[0]:
            return torch.zeros(shape[:-1], device=a.device)
        per_row = math.prod(shape[1:])
        step = max(1, _SLICE_ELEMS // max(per_row, 1))
        a = a.expand(shape[0], *a.shape[1:]) if a.shape[0] == 1 else a
        b = b.expand(shape[0], *b.shape[1:]) if b.shape[0] == 1 else b
        return torch.cat([self._rowsum(a[i : i + step] * b[i : i + step]) for i in range(0, shape[0], step)])

    # -- norms, mHC: the reference formulas over these reductions -------------------------------
    def _mean_sq(self, x: torch.Tensor) -> torch.Tensor:
        return self._rowsum(x.square()).unsqueeze(-1) / x.shape[-1]

    def _sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _fold(x, dim)

    def _softmax_last(self, x: torch.Tensor) -> torch.Tensor:
        e = self.pointwise(torch.exp, x - x.amax(-1, keepdim=True))
        return e / _fold(e, -1)

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return collapse_fold(h, pre)

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        rf = res.float()
        acc = post.unsqueeze(-1) * y.float().unsqueeze(-2)
        for j in range(res.shape[1]):
            acc = acc + comb[:, j].unsqueeze(-1) * rf[:, j].unsqueeze(-2)
        return acc.to(y.dtype)

    # -- attention and its compressed branches --------------------------------------------------
    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        return pool_softmax(kv, score, functools.partial(self.pointwise, torch.exp), self._rowsum)

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        n, dev = q.shape[0], q.device
        count = mask.sum(1)
        width = max(BLOCK, -(-int(count.max()) // BLOCK) * BLOCK) if n else BLOCK
        # visible keys first, in list order (window by position, then compressed rows by index)
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
        if order.shape[1] < width:
            order = F.pad(order, (0, width - order.shape[1]), value=keys.shape[0])
        order = order[:, :width]
        valid = torch.arange(width, device=dev).unsqueeze(0) < count.unsqueeze(1)
        kf = torch.cat([keys.float(), keys.new_zeros(1, keys.shape[1], dtype=torch.float32)])
        kg = kf[order] * valid.unsqueeze(-1)  # [n, W, d]
        s = self._dot(q.float().unsqueeze(2), kg.unsqueeze(1)) * scale  # [n, H, W]
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sk = sink.float().view(1, -1)
        m = torch.maximum(s.amax(-1), sk)
        e = self.pointwise(torch.exp, s - m.unsqueeze(-1))
        den = self._rowsum(e) + self.pointwise(torch.exp, sk - m)
        p = (e / den.unsqueeze(-1)).to(keys.dtype).float()
        out = self._dot(p.unsqueeze(2), kg.transpose(1, 2).unsqueeze(1))  # [n, H, d]
        return out.to(q.dtype)

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        s = self._dot(q.float().unsqueeze(1), keys.float().view(1, keys.shape[0], 1, -1)).relu()  # [n, R, h]
        return self._dot(s, weights.float().unsqueeze(1))


def collapse_fold(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """mHC's collapse ``Σ_j pre_j · h_j`` as an explicit left fold (a torch sum's order follows the tensor's size)."""
    hf = h.float()
    acc = pre[:, 0:1] * hf[:, 0]
    for j in range(1, h.shape[1]):
        acc = acc + pre[:, j : j + 1] * hf[:, j]
    return acc.to(h.dtype)


def pool_softmax(
    kv: torch.Tensor, score: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor],
    rowsum: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The compressors' softmax pooling over the last dim of ``[k, d, m]``, with a backend's row-invariant ``exp``
    and ``rowsum``."""
    s = score.float().transpose(1, 2)
    e = exp(s - s.amax(-1, keepdim=True))
    return rowsum(kv.float().transpose(1, 2) * (e / rowsum(e).unsqueeze(-1)))


def _fold(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Left-fold sum over a short dim (mHC's ``n``), kept as a size-1 dim."""
    parts = x.unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.unsqueeze(dim)
