"""The DeepSeek-V4 family's hybrid attention (:class:`HybridAttentionOps`): the KV compressors' gated pooling of
groups of rows (``softmax_pool``, ``group_pool``, ``compress_score``), the lightning indexer's scores and its
selection of compressed rows (``indexer_scores``, ``indexer_scores_ranges``, ``select_rows``), sparse attention with
K = V and a sink logit over a key mask or a key list per query (``sparse_attention``, ``sparse_attention_lists``) and
DeepSeek-V4.1's cache round trips (``cache_round``). Used by DeepSeek-V4 (``models/deepseek_v4/attention.py``,
``compressor.py``) and V4.1 (``attention.py``, ``attention_batched.py``, ``indexer.py``, ``decode_step.py``,
``dspark.py``); ``cache_round`` by V4.1 only.

Shapes use ``n`` = new tokens of one sequence, ``T`` = tokens of the whole batch, ``H`` heads, ``d`` head dim,
``K`` candidate keys.
"""

from __future__ import annotations

from typing import Protocol

import torch


class HybridAttentionOps(Protocol):
    """Compressed sparse attention of the DeepSeek-V4 family (module docstring)."""

    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Compressor pooling: ``Σ_m softmax_m(score) · kv`` over dim 1 of ``[k, m, d]`` → ``[k, d]`` fp32."""
        ...

    def group_pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        cur: torch.Tensor,
        prev: torch.Tensor | None,
        has_prev: torch.Tensor,
        live: torch.Tensor,
        d: int,
    ) -> torch.Tensor:
        """A compressor's groups pooled from its pending rows by index (``kernels.group_pool``): ``kv``, ``score``
        ``[N, C]`` fp32; row ``s`` pools rows ``cur[s]`` ``[S, m]`` and, overlapping (``prev`` given, ``C = 2d``),
        first the first ``d`` channels of rows ``prev[s]`` where ``has_prev[s]`` (else value 0, score ``-inf``), then
        the last ``d`` of ``cur[s]``; ``softmax_pool`` of that → ``[S, d]`` fp32, zeros where ``live`` is False."""
        ...

    def compress_score(
        self, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        """A compressor's scores: the fp32 gate ``[T, C]`` plus its position bias ``ape.float()[positions % ratio]``."""
        ...

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Lightning-indexer scores ``Σ_h weights[:, h] · relu(q[:, h] · keys)`` → ``[n, R]``."""
        ...

    def indexer_scores_ranges(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        start: torch.Tensor,
        width: int,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``indexer_scores`` with a key range per query: ``[T, width]``, column ``r`` of row ``t`` scoring
        ``keys[start[t] + r]`` (columns past the end of ``keys`` are 0; the caller masks what a query may not see).
        ``paged``: as ``sparse_attention_lists``' (the keys continue with the listed pages' rows; a backend may read
        them in place)."""
        ...

    def select_rows(self, scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible rows among each row's ``topk_indices(scores, k)``, in ascending order: ``scores [..., W]`` (any
        float dtype) and bool ``visible`` of the same shape → ``(rows [..., min(k, W)] long, count [...] long)``, where
        ``rows[..., :count]`` are the chosen visible rows ascending and ``count`` how many there are. Entries at and
        past ``count`` are never read by the callers; they are row indices in ``[0, W)``, but which ones is up to the
        backend (the reference lists the rows it did not choose, ascending)."""
        ...

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention with K = V and a per-head sink logit: ``q [n, H, d]``, ``keys [K, d]``, ``mask [n, K]``."""
        ...

    def sparse_attention_lists(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sparse_attention`` with a key list per query: query ``t`` attends to ``keys[idx[t, :count[t]]]``
        (``idx [T, W]``; entries past ``count`` are never read). Several sequences share one call. ``paged = (store
        [P, R, d], pages [M])``: the keys continue past ``keys`` with the rows of the listed pages of a paged store,
        key ``len(keys) + j`` being row ``j % R`` of page ``pages[j // R]`` (``kernels.paged_keys.gathered``); a
        backend may read them in place. ``out`` (contiguous, ``q``'s shape and dtype): the result is written there and
        returned (a CUDA graph reads it from a fixed address)."""
        ...

    def cache_round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """DeepSeek-V4.1's cache round trip ``fmt`` over the last dim, in ``x.dtype``: ``fp8`` (window KV,
        ``quant.cache.fp8_window_round``), ``nvfp4`` (compressed rows, ``nvfp4_round``) or ``mxfp4`` (index keys and
        queries, ``mxfp4_round``)."""
        ...
