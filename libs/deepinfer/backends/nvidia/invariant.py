"""``NvidiaInvariantOps`` (``DEEPINFER_BATCH_INVARIANT=1`` on nvidia): the reference backend's batch-invariant set
(``deepinfer.backends.reference.invariant``) on its Triton primitives, with sparse attention over each query's visible
keys gathered into a canonical order (window rows by position, then compressed rows by index) and the lightning
indexer over fixed key tiles; both kernels are batch-invariant by construction."""

from __future__ import annotations

import torch

from deepinfer.backends.nvidia.streams import StreamOps
from deepinfer.backends.reference.invariant import BatchInvariantOps


def _kernels() -> tuple:
    try:
        from deepinfer.kernels.attention import sparse_attention_gather
        from deepinfer.kernels.indexer import indexer_scores_fixed
    except ImportError as e:  # pragma: no cover - a CUDA host without triton
        raise RuntimeError(f"the nvidia backend needs Triton (pip install 'deepinfer[nvidia]'): {e}") from e
    return sparse_attention_gather, indexer_scores_fixed


def visible_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the indices of its visible keys first, in list order (``[n, K]``), and their count."""
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    return order, mask.sum(1)


class _KernelAttention:
    def _load_kernels(self) -> None:
        self._attend, self._index = _kernels()

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        idx, count = visible_keys(mask)
        return self._attend(q, keys.to(q.dtype), idx, count, sink.float(), scale, split=False)

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._index(q, keys.to(q.dtype), weights.float())


class NvidiaInvariantOps(StreamOps, _KernelAttention, BatchInvariantOps):
    # the ops taken from the reference backend's batch-invariant set (BatchInvariantOps, and through it ReferenceOps) as
    # they are; its own: sparse_attention, indexer_scores (_KernelAttention) and parallel (StreamOps)
    FROM_REFERENCE = frozenset({
        "act_quant_sim", "fp4_quant_sim", "fp8_grouped_linear", "fp8_linear", "grouped_linear", "linear",
        "linear_fp32", "logits_linear", "moe", "moe_combine", "moe_mxfp4", "pointwise", "prepare_weights",
        "rms_norm", "rope", "route", "swiglu", "topk_indices",  # core
        "hc_collapse", "hc_expand", "hc_mixes", "hc_pre",  # mHC
        "cache_round", "compress_score", "group_pool", "indexer_scores_ranges", "select_rows", "softmax_pool",
        "sparse_attention_lists",  # hybrid attention
        "append_rows", "key_lists", "step_indices", "store_rows",  # decode step
    })  # fmt: skip

    def __init__(self) -> None:
        BatchInvariantOps.__init__(self, "nvidia")
        self._load_kernels()
