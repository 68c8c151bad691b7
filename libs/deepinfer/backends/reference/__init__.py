"""The reference backend (``DEEPINFER_ACCELERATOR=cpu``): the op set in plain torch, on any device, whose semantics
every other backend is tested against.

* :class:`ReferenceOps` (``ops``): the products, composed with one mixin per group of ops: RMSNorm, RoPE and mHC
  (``norms``), sparse attention, pooling, the indexer and top-k (``attention``), routing and the experts (``moe``), the
  FP8 linears and quantisation round trips (``quant``), the decode step's glue (``step_glue``);
* :class:`BatchInvariantOps` (``invariant``, ``DEEPINFER_BATCH_INVARIANT=1``): the same semantics with reductions whose
  result for a row never depends on the rest of the batch (docs/determinism.md); the nvidia backend's batch-invariant
  set builds on it with Triton primitives.

Importing this package imports no Triton.
"""

from __future__ import annotations

from deepinfer.backends.reference.invariant import BatchInvariantOps
from deepinfer.backends.reference.moe import swiglu
from deepinfer.backends.reference.ops import ReferenceOps

__all__ = ["BatchInvariantOps", "ReferenceOps", "swiglu"]
