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

Before the capture each piece runs twice eagerly (kernel compilation, library handles) with zeros standing in for
the eager code between pieces (``_after``): the warm-up must not touch the sequences' state, whose updates are not
idempotent. Capture, the shared pool and the eager fallback of a bucket whose capture fails are ``SegmentGraphs``'s.
Used by ``deepseek_v4.prefill_graphs`` and ``deepseek_v41.prefill_graphs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.runtime.decode_graphs import SegmentGraphs

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch

# steps of <= 50% padding below 128 tokens, <= 33% above; multiples of 2048 past the ladder
PREFILL_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def prefill_bucket(n: int, max_tokens: int) -> int | None:
    """The token bucket of a step of ``n`` tokens (None: empty or above ``max_tokens``); never above ``max_tokens``."""
    if n < 1 or n > max_tokens:
        return None
    size = next((b for b in PREFILL_BUCKETS if b >= n), -(-n // 2048) * 2048)
    return min(size, max_tokens)


def prefill_buckets(max_tokens: int, longest: int | None = None) -> list[int]:
    """Every token bucket (``prefill_bucket``'s under ``max_tokens``) that a step of at most ``longest`` tokens (default
    ``max_tokens``) runs in, smallest first: what a start-up warm-up captures so that no step meets a new bucket while
    serving."""
    top = prefill_bucket(min(max_tokens, max_tokens if longest is None else longest), max_tokens)
    if top is None:
        return []
    sizes = [*PREFILL_BUCKETS, *range(PREFILL_BUCKETS[-1] + 2048, top, 2048)]
    return [*(b for b in sizes if b < top), top]


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


@dataclass
class PieceBucket:
    """A token bucket: static inputs (outside the graphs' pool), what each piece leaves for the eager attention and
    the next piece (``carry``), and the pieces' graphs."""

    size: int
    token_ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    carry: list[Any]
    graphs: list[Any] = field(default_factory=list)  # the platform's graphs (``Platform.graph``)


class PiecewiseGraphs(SegmentGraphs):
    """Per-token-bucket piecewise CUDA graphs of a model's steps (module docstring). A subclass provides ``_bucket``
    (a ``PieceBucket``), ``_segments`` (the ``L + 1`` piece functions) and ``run`` (``load``, then ``replay`` with
    its attention)."""

    kind = "piecewise"

    def __init__(self, model: torch.nn.Module, max_tokens: int | None = None) -> None:
        if max_tokens is None:
            from deepinfer import envs

            max_tokens = int(envs.get("DEEPINFER_PREFILL_GRAPH_MAX_TOKENS"))
        super().__init__(model, max_batch=max_tokens)

    def graphable(self, batch: ForwardBatch) -> bool:
        """Any step with tokens (pure decode steps take ``DecodeGraphs`` first)."""
        return bool(batch.chunks) and batch.num_tokens > 0

    def _size(self, batch: ForwardBatch) -> int | None:
        return prefill_bucket(batch.num_tokens, self.max_batch)

    def _statics(self, size: int, device: torch.device, pieces: int) -> dict[str, Any]:
        """``PieceBucket``'s fields but ``graphs``: zero token ids and positions, an empty carry."""
        zeros = torch.zeros(size, dtype=torch.long, device=device)
        return {"size": size, "token_ids": zeros, "positions": zeros.clone(), "carry": [None] * pieces}

    @staticmethod
    def load(bk: PieceBucket, n: int, statics: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each ``(static, value)`` pair's ``n`` rows in, zeros past them."""
        for static, value in statics:
            static[:n].copy_(value)
            if n < bk.size:
                static[n:].zero_()

    def replay(self, bk: PieceBucket, n: int, attend: Callable[[int, dict, torch.Tensor], object]) -> dict:
        """Replay the pieces with ``attend(j, t, out)`` (layer ``j``'s eager attention on the first ``n`` rows of its
        tensors ``t``, into ``out``) between them; the last piece's carry (weak: copy what is kept)."""
        for j in range(len(bk.graphs) - 1):
            bk.graphs[j].replay()
            c = bk.carry[j]
            attend(j, {k: v[:n] for k, v in c["t"].items()}, c["out"][:n])
            if n < bk.size:
                c["out"][n:].zero_()  # the padding tokens carry finite values through the MoE
        bk.graphs[-1].replay()
        self.replays += 1
        return bk.carry[-1]

    def _after(self, bk: PieceBucket, j: int, captured: bool) -> None:
        """Warm-up: zeros in what the eager attention after piece ``j`` would write (``out``), and the warm-up's
        tensors back to the allocator after the last piece. Capture: piece ``j`` was the last reader of
        ``carry[j - 1]``, which becomes weak; the step's output too (the caller copies it)."""
        last = j == len(bk.carry) - 1
        if not captured:
            if last:
                bk.carry = [None] * len(bk.carry)
            else:
                bk.carry[j]["out"].zero_()
            return
        if j:
            bk.carry[j - 1] = weaken(bk.carry[j - 1])
        if last:
            bk.carry[j] = weaken(bk.carry[j])


__all__ = [
    "PREFILL_BUCKETS",
    "PieceBucket",
    "PiecewiseGraphs",
    "prefill_bucket",
    "prefill_buckets",
    "weak_ref",
    "weaken",
]
