"""What the CSA2 attention paths of DeepSeek-V4.1 share below ``attention``: the per-step hand-off between layers
(``StepContext``) and what the batched and the decode-step paths (``attention_batched``, ``decode_step``) read of a
layer (``AttentionLayer``, which ``attention.Attention`` is). Those paths take the layer as an argument, so they
import this module, not ``attention`` (which calls them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v41.indexer import Compressor, Indexer
from deepinfer.models.deepseek_v41.layout import LayerSpec


@dataclass
class StepContext:
    """What one forward step's layers hand each other: the chunks, their rows in the batch, the paged cache, and
    per chunk the owner rows read so far and the latest selection / candidate masks (transient, never cached)."""

    chunks: list[SeqChunk]
    offsets: list[tuple[int, int]]
    positions: torch.Tensor
    cache: PagedKVCache | None
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (owner, chunk) -> rows so far
    index_keys: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> bool [n, R] of the owner's rows
    candidates: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # the batched path (attention_batched): owner pools, and the latest selection / candidates of every token
    pools: dict[tuple[int, str], tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    sel_rows: torch.Tensor | None = None  # [T, k] owner rows, valid first
    sel_count: torch.Tensor | None = None  # [T]
    cand: torch.Tensor | None = None  # [T, width] bool
    plan: Any = None  # a decode step on pooled state: its decode_step.V41DecodePlan, made by the first layer
    # context parallelism: the rows (host, ascending) whose queries this rank attends; the state takes every row
    queries: torch.Tensor | None = None

    def query_positions(self) -> torch.Tensor:
        """The positions of the rows whose queries are attended (all rows', or ``queries``')."""
        return self.positions if self.queries is None else self.positions[self.queries.to(self.positions.device)]


class AttentionLayer(Protocol):
    """What ``attention_batched`` and ``decode_step`` read of a layer's attention (``attention.Attention``)."""

    layer_id: int
    ratio: int  # CSA2 compression ratio: 0, 1 or 2
    window: int
    head_dim: int
    spec: LayerSpec
    attn_sink: torch.Tensor
    quant_sim: bool
    compressor: Compressor | None  # a KV source's (Full layers)
    indexer: Indexer | None  # an index source's (Full and Reindex layers)


__all__ = ["AttentionLayer", "StepContext"]
