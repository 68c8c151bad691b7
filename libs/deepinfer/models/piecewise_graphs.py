"""Model-agnostic part of the piecewise CUDA graphs of prefill and mixed steps: token buckets, weak references, and the
capture of a step's pieces.

An eager prefill step of a few thousand tokens is paced by the host as much as by the device: a layer is a few dozen
kernels and torch ops whose launches cost about as long as the device takes to run them (H200, V4-Flash widths,
4096 tokens: 25.7 ms of host issue for 26.5 ms of device work). The attention's per-sequence bookkeeping (window
rings, compressor buffers, paged cache, key lists built from host integers) changes shape with every batch, the rest
of a layer does not: so a step is cut at each attention into ``L + 1`` pieces, each captured once per token bucket
and replayed, and the attention runs eagerly between them (vLLM's and SGLang's piecewise CUDA graphs do the same).

Piece ``j`` stores what the eager code after it and piece ``j + 1`` read in ``bk.carry[j]`` (a dict of tensors; the
last piece stores the step's output in ``bk.carry[L]``). Those tensors live in the graphs' memory pool at fixed
addresses. Once piece ``j + 1`` is captured nothing captured later reads ``carry[j]``: it is replaced by weak
references (``weak_ref``: the same memory, not kept allocated), so that later pieces and other buckets reuse the
memory. The pool then holds about one step's activations, the largest bucket's, not one per layer and bucket. Replays
run in capture order, one bucket at a time, and a replayed piece reads ``carry[j]`` only after the pieces and eager
code that wrote it: reused memory is never read stale.

Before the capture each piece runs twice eagerly (kernel compilation, library handles) with ``_fill`` standing in for
the eager code between pieces: the warm-up must not touch the sequences' state, whose updates are not idempotent.
A bucket whose capture fails runs eagerly (``SegmentGraphs``'s rule). Used by ``deepseek_v4.prefill_graphs``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from deepinfer.models.decode_graphs import SegmentGraphs
from deepinfer.models.deepseek_v4.state import ForwardBatch

log = logging.getLogger(__name__)

# steps of <= 50% padding below 128 tokens, <= 33% above; multiples of 2048 past the ladder
PREFILL_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def prefill_bucket(n: int, max_tokens: int) -> int | None:
    """The token bucket of a step of ``n`` tokens (None: empty or above ``max_tokens``); never above ``max_tokens``."""
    if n < 1 or n > max_tokens:
        return None
    size = next((b for b in PREFILL_BUCKETS if b >= n), -(-n // 2048) * 2048)
    return min(size, max_tokens)


def weak_ref(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (same shape, strides and offset) that does not keep the memory allocated: once the
    last strong reference goes, the allocator may hand the memory out again (torch's CUDA-graph trees and vLLM's
    piecewise graphs keep their outputs so)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def weaken(obj: Any) -> Any:
    """``obj`` with every tensor in it (through dicts, lists, tuples and named tuples) replaced by its
    ``weak_ref``."""
    if isinstance(obj, torch.Tensor):
        return weak_ref(obj)
    if isinstance(obj, dict):
        return {k: weaken(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return obj._make(weaken(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(weaken(v) for v in obj)
    return obj


class PiecewiseGraphs(SegmentGraphs):
    """Per-token-bucket piecewise CUDA graphs of a model's steps (module docstring). A subclass provides ``_bucket``
    (an object with ``size``, ``graphs`` and ``carry``), ``_segments`` (the ``L + 1`` piece functions) and ``run``;
    ``_fill(bk, j)`` stands in for the eager code after piece ``j`` during the warm-up."""

    def __init__(self, model: torch.nn.Module, max_tokens: int | None = None) -> None:
        if max_tokens is None:
            from deepinfer import envs

            max_tokens = int(envs.get("DEEPINFER_PREFILL_GRAPH_MAX_TOKENS"))
        super().__init__(model, max_batch=max_tokens)

    def graphable(self, batch: ForwardBatch) -> bool:
        """Any step with tokens (pure decode steps take ``DecodeGraphs`` first)."""
        return bool(batch.chunks) and batch.num_tokens > 0

    def bucket(self, batch: ForwardBatch, extra: tuple = (), before: Any = None) -> Any | None:
        """The captured bucket of ``batch``'s token count (captured on first use), or None (no bucket holds it, or
        its capture failed). Call after ``applies``."""
        size = prefill_bucket(batch.num_tokens, self.max_batch)
        if size is None:
            return None
        key = self._key(size) + extra
        if key not in self.buckets:
            self.buckets[key] = self._capture(size, batch.device, extra, before)
        return self.buckets[key]

    def _fill(self, bk: Any, j: int) -> None:
        """The warm-up's stand-in for the eager code after piece ``j``: zeros in what it would write (``out``)."""
        out = bk.carry[j].get("out")
        if out is not None:
            out.zero_()

    def _capture(self, size: int, device: torch.device, extra: tuple = (), before: Any = None) -> Any | None:
        bk = self._bucket(size, device, *extra)
        segs = self._segments(bk)
        try:
            side = self.capture_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: kernel compilation, library handles, lazy device tables
                    for j, seg in enumerate(segs):
                        seg()
                        if j < len(segs) - 1:
                            self._fill(bk, j)
                    bk.carry = [None] * len(segs)  # the warm-up's tensors go back to the allocator
                side.synchronize()
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                for j, seg in enumerate(segs):
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        seg()
                    finally:
                        g.capture_end()
                    bk.graphs.append(g)
                    if j:  # piece j was the last reader of carry[j - 1]
                        bk.carry[j - 1] = weaken(bk.carry[j - 1])
                bk.carry[-1] = weaken(bk.carry[-1])  # the step's output: the caller copies it
            torch.cuda.current_stream(device).wait_stream(side)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: this bucket runs eagerly
            log.warning("piecewise CUDA graphs: capture of %d tokens failed, running it eagerly: %s", size, e)
            self.failures[size] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize(device)
            return None
        return bk


__all__ = ["PREFILL_BUCKETS", "PiecewiseGraphs", "prefill_bucket", "weak_ref", "weaken"]
