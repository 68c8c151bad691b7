"""Batch-invariant mode of the nvidia op set (``NvidiaOps(invariant=True)``, ``DEEPINFER_BATCH_INVARIANT=1``): the
default op set's own kernels, CUDA graphs and pooled decode state, made batch-invariant.

* Every op runs inside ``kernels.pinning.pinned()`` (:func:`pin`): each kernel plans its launch (path, tiles,
  split-K) for ``PLAN_ROWS`` rows whatever the call has, so a row meets the same code and the same order of sums
  alone, in a batch of 256, in a decode step and in a prefill chunk.
* The products that would go to cuBLAS (which picks its kernel by the row count) run on the fixed-plan kernels
  (``fixed``); so do the ops the default set takes from the reference's torch code (:class:`InvariantOps`):
  attention over each query's visible keys gathered into a canonical order (window rows by position, then compressed
  rows by index) on ``kernels.attention``, the lightning indexer's scores on fixed key tiles
  (``kernels.indexer.indexer_scores_fixed``), the compressor's softmax pooling on padded row sums
  (``kernels.invariant.rowsum``) and mHC's collapse as an explicit fold over the streams; each falls back to the
  default (the next class of the MRO) when the mode is off. The MoE takes the Triton kernels at every size
  (CUTLASS's grouped GEMM picks its tiles by the slots).

The model runs its batched paths, not a sequence at a time (``invariant_by_sequence`` is False, unlike the reference
backend's batch-invariant set): every kernel of those paths is invariant per row.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.backends.nvidia.fixed import fixed_grouped, fixed_mm


def visible_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the indices of its visible keys first, in list order (``[n, K]``), and their count."""
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    return order, mask.sum(1)


def _pinned(fn: Callable[..., Any]) -> Callable[..., Any]:
    from deepinfer.kernels.pinning import pinned

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with pinned():
            return fn(*args, **kwargs)

    return call


def pin(ops: object) -> None:
    """Run every op of ``ops`` (the interface's, ``deepinfer.ops.op_names``) inside ``kernels.pinning.pinned()``."""
    from deepinfer.ops.base import op_names

    for name in sorted(op_names()):  # bound to ``ops`` as methods: a copy of the op set rebinds them to the copy
        setattr(ops, name, types.MethodType(_pinned(getattr(type(ops), name)), ops))


def invariance_name() -> str:
    """The mode's version and the pinned plans' constants by name (``requires["ops"]`` of a batch-invariant
    response, docs/determinism.md): together they fix every pinned kernel's order of sums."""
    from deepinfer.kernels import fp8_gemm_config, moe_mxfp4, small_gemm
    from deepinfer.kernels.invariant import MATMUL_PLAN, MATMUL_PLAN_FP32
    from deepinfer.kernels.pinning import PLAN_ROWS

    shapes = "".join(f", fp8_rows{n}x{k}={r}" for (n, k), r in sorted(fp8_gemm_config.PINNED_ROWS_BY_SHAPE.items()))
    head, fp32 = ("x".join(map(str, p)) for p in (MATMUL_PLAN, MATMUL_PLAN_FP32))
    return (f"batch-invariant v3 (pinned plans, plan_rows={PLAN_ROWS}, fp8_rows={fp8_gemm_config.PINNED_ROWS}{shapes}, "
            f"small_rows={small_gemm.PINNED_ROWS}, moe_split={moe_mxfp4.PINNED_SPLIT}, head_plan={head}, "
            f"fp32_plan={fp32})")  # fmt: skip


class InvariantOps:
    """``pointwise``, ``linear``, ``grouped_linear``, ``hc_collapse``, ``sparse_attention``, ``indexer_scores`` and
    ``softmax_pool`` of the nvidia op set: batch-invariant where ``batch_invariant`` is set (module docstring), else
    the next class's (the reference's torch code). A mixin: it reads the op set's ``batch_invariant``."""

    batch_invariant: bool

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant or x.is_cuda:  # a CUDA element-wise kernel runs one code for every element
            return super().pointwise(fn, x)  # type: ignore[misc]
        from deepinfer.backends.reference.invariant import scalar_loop

        return scalar_loop(fn, x)  # host tensors (the tests, in Triton's interpreter): torch's CPU SIMD body and tail

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().linear(x, w)  # type: ignore[misc]
        if x.dtype != w.dtype:
            raise ValueError(f"linear: input {x.dtype} and weight {w.dtype} differ")
        return fixed_mm(x, w, x.dtype)

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().grouped_linear(x, w)  # type: ignore[misc]
        return fixed_grouped(x, w)

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if not self.batch_invariant:
            return super().sparse_attention(q, keys, mask, sink, scale)  # type: ignore[misc]
        from deepinfer.kernels.attention import sparse_attention_gather

        idx, count = visible_keys(mask)
        return sparse_attention_gather(q, keys.to(q.dtype), idx, count, sink.float(), scale)

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().indexer_scores(q, keys, weights)  # type: ignore[misc]
        from deepinfer.kernels.indexer import indexer_scores_fixed

        return indexer_scores_fixed(q, keys.to(q.dtype), weights.float())

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().hc_collapse(h, pre)  # type: ignore[misc]
        from deepinfer.backends.reference.invariant import collapse_fold

        return collapse_fold(h, pre)

    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().softmax_pool(kv, score)  # type: ignore[misc]
        from deepinfer.backends.reference.invariant import pool_softmax
        from deepinfer.kernels.invariant import rowsum

        return pool_softmax(kv, score, torch.exp, rowsum)  # (a device's exp is elementwise: row-invariant)


__all__ = ["InvariantOps", "invariance_name", "pin", "visible_keys"]
