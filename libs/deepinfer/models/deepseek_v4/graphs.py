"""CUDA graphs for the decode steps of ``DeepseekV4Model`` (one new token per sequence).

An eager decode step is bound by host launch time: a layer is hundreds of small kernels. Everything of a layer except
the attention's state bookkeeping is a pure function of fixed-shape tensors, so it is captured once per batch-size
bucket and replayed:

* segment 0: the embedding and layer 0's ``Block.attn_in`` (mHC collapse, norm, q / kv projections, RoPE, compressor
  projections, indexer queries);
* segment i (1 ≤ i < L): layer i-1's ``Block.ffn_out`` (inverse RoPE, output projections, mHC expand, the MoE
  sublayer) and layer i's ``attn_in``;
* segment L: layer L-1's ``ffn_out``.

Between segments ``Attention.attend`` runs eagerly on the first ``B`` rows (window ring, compressor buffers, paged
cache, indexer top-k, sparse attention: per-sequence state of changing shapes) and its output is copied into the
static input of the next segment. The step's token ids and positions are copied into static buffers; a batch of
``B`` sequences runs in the smallest bucket ``≥ B`` and its padding rows (stale ids and positions) are computed and
dropped. With ``B`` equal to the bucket size the replay runs the kernels of the eager step on the same shapes, so its
results are the eager results bit for bit (``tests/kernels/test_graphs.py`` checks this on a GPU).

All buckets share one memory pool: no segment output outlives the step that wrote it (the final streams are cloned),
so graphs replayed in capture order may reuse each other's memory. A bucket whose capture fails (an op that cannot be
captured) is remembered and runs eagerly. ``reset`` drops every graph (after replacing weights' storage, say).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.models.deepseek_v4.state import ForwardBatch, PagedKVCache

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(n: int, max_batch: int) -> int | None:
    """The bucket of a decode batch of ``n`` sequences (None: above ``max_batch`` or empty)."""
    if n < 1 or n > max_batch:
        return None
    for b in BUCKETS:
        if b >= n:
            return b
    return -(-n // 128) * 128


@dataclass
class _Carry:
    """What one segment hands to the next: the streams and the layer's ``attn_in`` results."""

    h: torch.Tensor
    t: dict[str, torch.Tensor]
    post: torch.Tensor
    comb: torch.Tensor


@dataclass
class _Bucket:
    size: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    attn_out: list[torch.Tensor]  # static inputs: each layer's attention output
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # anything with replay() in tests
    carries: list[_Carry] = field(default_factory=list)  # outputs of segments 0 .. L-1
    h: torch.Tensor | None = None  # output of segment L


class DecodeGraphs:
    """Per-bucket CUDA graphs of a model's decode steps (module docstring)."""

    def __init__(self, model: DeepseekV4Model, max_batch: int | None = None) -> None:
        if max_batch is None:
            from deepinfer import envs

            max_batch = int(envs.get("DEEPINFER_CUDA_GRAPH_MAX_BATCH"))
        self.model, self.max_batch = model, max_batch
        self.buckets: dict[tuple, _Bucket | None] = {}
        self.pool: tuple | None = None
        self.replays = 0  # graphed steps run (for tests and benchmarks)

    def reset(self) -> None:
        self.buckets.clear()
        self.pool = None

    def _key(self, size: int) -> tuple:
        ops = self.model.ops
        return size, id(ops), getattr(ops, "fused", None), getattr(ops, "moe_backend", None)

    def applies(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode step this can replay (one token per chunk, on CUDA, not capturing)."""
        ids = batch.token_ids
        return (
            ids.is_cuda
            and bool(batch.chunks)
            and all(c.length == 1 for c in batch.chunks)
            and ids.shape[0] == len(batch.chunks)
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor | None:
        """The final streams ``[B, hc_mult, D]`` of a decode step, or None when the step is not graphed (the caller
        then runs it eagerly). Advances the attention state as the eager step does (not ``num_tokens``)."""
        if not self.applies(batch):
            return None
        n = len(batch.chunks)
        size = bucket_for(n, self.max_batch)
        if size is None:
            return None
        key = self._key(size)
        if key not in self.buckets:
            self.buckets[key] = self._capture(size, batch.token_ids.device)
        bk = self.buckets[key]
        if bk is None:
            return None
        model, ops = self.model, self.model.ops
        bk.token_ids[:n].copy_(batch.token_ids)
        bk.positions[:n].copy_(batch.positions)
        offsets = batch.offsets()
        for i, layer in enumerate(model.layers):
            bk.graphs[i].replay()
            c = bk.carries[i]
            t = c.t if n == size else {k: v[:n] for k, v in c.t.items()}
            out = layer.attn.attend(t, batch.chunks, offsets, batch.positions, cache, model.rope_of(i), ops)
            bk.attn_out[i][:n].copy_(out)
        bk.graphs[-1].replay()
        self.replays += 1
        return bk.h[:n].clone()

    # -- capture ------------------------------------------------------------------------------------------------

    def _segments(self, bk: _Bucket) -> list[Callable[[], None]]:
        """The segment functions of a bucket; each stores its outputs in ``bk``."""
        model, ops, layers = self.model, self.model.ops, self.model.layers
        ids, pos = bk.token_ids, bk.positions

        def first() -> None:
            h = model.embed_streams(ids)
            bk.carries[0] = _Carry(h, *layers[0].attn_in(h, pos, model.rope_of(0), ops))

        def middle(i: int) -> Callable[[], None]:
            def seg() -> None:
                p = bk.carries[i - 1]
                h = layers[i - 1].ffn_out(bk.attn_out[i - 1], p.t, p.h, p.post, p.comb, ids, ops)
                bk.carries[i] = _Carry(h, *layers[i].attn_in(h, pos, model.rope_of(i), ops))

            return seg

        def last() -> None:
            p = bk.carries[-1]
            bk.h = layers[-1].ffn_out(bk.attn_out[-1], p.t, p.h, p.post, p.comb, ids, ops)

        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def _bucket(self, size: int, device: torch.device) -> _Bucket:
        """A bucket's static inputs (zeros) and no graphs yet."""
        c, layers = self.model.config, self.model.layers
        dtype = self.model.embed.weight.dtype
        bk = _Bucket(
            size=size,
            token_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            attn_out=[torch.zeros(size, c.num_attention_heads, c.head_dim, dtype=dtype, device=device) for _ in layers],
        )
        bk.carries = [None] * len(layers)  # type: ignore[list-item]
        return bk

    def _capture(self, size: int, device: torch.device) -> _Bucket | None:
        bk = self._bucket(size, device)
        segs = self._segments(bk)
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: kernel compilation, library handles, lazy device tables
                    for seg in segs:
                        seg()
                side.synchronize()
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                for seg in segs:
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        seg()
                    finally:
                        g.capture_end()
                    bk.graphs.append(g)
            torch.cuda.current_stream(device).wait_stream(side)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: this bucket runs eagerly
            log.warning("decode CUDA graphs: capture of batch size %d failed, running it eagerly: %s", size, e)
            torch.cuda.synchronize(device)
            return None
        return bk


__all__ = ["BUCKETS", "DecodeGraphs", "bucket_for"]
