"""Model-agnostic part of the decode-step graphs (``Platform.graphs``: CUDA graphs on nvidia): batch-size buckets,
capture of a step's segments, failure fallback.

A decode step (one new token per sequence) is bound by host launch time when run eagerly. A model splits it into
``L + 1`` segments around the eager per-layer state bookkeeping (the attention's window rings, compressor buffers,
paged cache, top-k selection: per-sequence work of changing shapes); each segment is a pure function of fixed-shape
static inputs and is captured once per batch-size bucket, then replayed. A subclass provides ``_bucket`` (the static
inputs of one bucket: an object with a ``graphs`` list) and ``_segments`` (the segment functions, which store their
outputs in the bucket) and its own ``run`` (copy the step's inputs, replay, run the bookkeeping between segments).

All buckets share one memory pool: no segment output may outlive the step that wrote it (a subclass clones what it
returns), so graphs replayed in capture order may reuse each other's memory. A bucket whose capture fails (an op that
cannot be captured) is remembered and runs eagerly (``run`` returns None). ``reset`` drops every graph (after
replacing weights' storage, say). Used by ``deepseek_v4.graphs`` and ``deepseek_v41.graphs``.

A model whose step holds collective exchanges with other ranks (its experts sharded: ``parallel.expert_parallel``)
carries a ``replay_gate`` (``ReplayGate``): a replay runs the exchanges its capture recorded, so a bucket replays only
in a step whose exchanges every rank runs in that form, and a bucket is captured only while every rank captures in
step (a capture runs its segments eagerly first: exchanges that no other rank would join). Graphs of a pass that holds
no exchange (a drafter's: ``collective`` False) ignore it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from deepinfer.runtime.platform import platform_of

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_captured = [0]  # buckets captured in this process, by every model's graphs of every kind (``captures_so_far``)


def captures_so_far() -> int:
    """How many buckets this process has captured (tried to), every kind of graphs together: a step that raised it
    paid a one-time cost (a worker reports it with the step's result: ``StepResult.graph_captures``)."""
    return _captured[0]


def bucket_for(n: int, max_batch: int) -> int | None:
    """The bucket of a decode batch of ``n`` sequences (None: above ``max_batch`` or empty)."""
    if n < 1 or n > max_batch:
        return None
    for b in BUCKETS:
        if b >= n:
            return b
    return -(-n // 128) * 128


class ReplayGate(Protocol):
    """What a model's collective exchanges allow its graphs (module docstring)."""

    capturing: bool  # every rank captures in step now (a warm-up all ranks run alike): new buckets may be captured

    def replays(self, rows: int) -> bool:
        """Whether a bucket of ``rows`` rows (its padding included) may run from graphs in this step."""
        ...


class SegmentGraphs:
    """Per-bucket CUDA graphs of a model's decode-step segments (module docstring). ``model.ops`` is the op set."""

    kind = "decode"  # in log lines
    collective = True  # the segments run the model's trunk, and so its exchanges (``model.replay_gate``)

    def __init__(self, model: nn.Module, max_batch: int | None = None) -> None:
        if max_batch is None:
            from deepinfer import envs

            max_batch = int(envs.get("DEEPINFER_CUDA_GRAPH_MAX_BATCH"))
        self.model, self.max_batch = model, max_batch
        self.buckets: dict[tuple, Any] = {}
        self.pool: tuple | None = None
        self.replays = 0  # graphed steps run (for tests and benchmarks)
        self.captures = 0  # buckets captured (again after ``reset``: a new pool or cache; for benchmarks)
        self.failures: dict[int, str] = {}  # bucket size -> why its capture failed (it runs eagerly)
        self._owner: tuple = ()  # what the buckets were captured over (``own``)

    def reset(self) -> None:
        self.buckets.clear()
        self.pool = None

    def own(self, *owner: Any) -> None:
        """Drop the buckets when ``owner`` (the objects whose tensors the graphs hold: a state pool, its generation, a
        cache) is not the one they were captured over."""
        if len(self._owner) != len(owner) or any(a is not b for a, b in zip(owner, self._owner)):
            self.reset()  # the graphs hold another pool's or cache's tensors
            self._owner = owner

    def _key(self, size: int) -> tuple:
        """What a captured bucket depends on besides the weights: its size and the op set's kernel choices."""
        ops = self.model.ops
        return size, id(ops), getattr(ops, "fused", None), getattr(ops, "moe_backend", None)

    def applies(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode step this can replay (``graphable``, on a platform with graphs, not
        capturing)."""
        platform = platform_of(batch.device)
        return platform.graphs and not platform.capturing() and self.graphable(batch)

    def graphable(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode step (one token per chunk) whatever its device; a model may refuse more."""
        return bool(batch.chunks) and all(c.length == 1 for c in batch.chunks) and batch.num_tokens == len(batch.chunks)

    def bucket(self, batch: ForwardBatch, extra: tuple = (), before: Callable[[Any], None] | None = None) -> Any | None:
        """The captured bucket that runs ``batch`` (captured on first use), or None: no bucket holds it, or its
        capture failed. Call after ``applies``. ``extra``: more of the key, passed to ``_bucket``; ``before(bk)``
        loads a new bucket's static inputs before its capture (its warm-up runs then compute this step)."""
        size = self._size(batch)
        if size is None:
            return None
        gate: ReplayGate | None = getattr(self.model, "replay_gate", None) if self.collective else None
        if gate is not None and not gate.replays(self._rows(size, extra)):
            return None  # (this step's exchanges are not the form the graphs hold, or its padded rows overrun them)
        key = self._key(size) + extra
        if key not in self.buckets:
            if gate is not None and not gate.capturing:
                return None  # (a capture on this rank alone would run exchanges no other rank joins)
            self.buckets[key] = self._capture(size, batch.device, extra, before)
        return self.buckets[key]

    def _rows(self, size: int, extra: tuple) -> int:
        """The rows a bucket of ``size`` sequences runs (``extra``: ``bucket``'s): one each in a decode step."""
        return size

    def _size(self, batch: ForwardBatch) -> int | None:
        """The bucket size of ``batch`` (None: no bucket holds it): its sequence count's ``bucket_for``."""
        return bucket_for(len(batch.chunks), self.max_batch)

    def _after(self, bk: Any, j: int, captured: bool) -> None:
        """Called after segment ``j`` ran in the warm-up (``captured`` False) or was captured (True); nothing here."""

    # -- what a model provides ----------------------------------------------------------------------------------

    def _bucket(self, size: int, device: torch.device, *extra: Any) -> Any:
        """A bucket's static inputs (zeros) with an empty ``graphs`` list (``extra``: ``bucket``'s)."""
        raise NotImplementedError

    def _segments(self, bk: Any) -> list[Callable[[], None]]:
        """The segment functions of a bucket, in replay order; each stores its outputs in ``bk``."""
        raise NotImplementedError

    # -- capture ------------------------------------------------------------------------------------------------

    def capture_stream(self, device: torch.device) -> Any:
        """The side stream every capture runs on (one per device: the libraries' per-stream workspaces, cuBLAS's
        some MiB each, are made once, not once per bucket)."""
        streams = self.__dict__.setdefault("_streams", {})
        if device not in streams:
            streams[device] = platform_of(device).new_stream(device)
        return streams[device]

    def _capture(
        self, size: int, device: torch.device, extra: tuple = (), before: Callable[[Any], None] | None = None
    ) -> Any | None:
        self.captures += 1
        _captured[0] += 1
        start = time.perf_counter()
        bk = self._bucket(size, device, *extra)
        segs = self._segments(bk)
        platform = platform_of(device)
        try:
            if before is not None:
                before(bk)
            side = self.capture_stream(device)
            side.wait_stream(platform.current_stream(device))
            with platform.stream(side):
                for _ in range(2):  # warm-up: kernel compilation, library handles, lazy device tables
                    for j, seg in enumerate(segs):
                        seg()
                        self._after(bk, j, captured=False)
                side.synchronize()
                if self.pool is None:
                    self.pool = platform.graph_pool()
                rng = platform.rng_snapshot(device)
                for j, seg in enumerate(segs):
                    g = platform.graph()
                    g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        seg()
                    finally:
                        try:
                            g.capture_end()
                        except Exception:
                            platform.rng_restore(rng)  # the generators are left marked as capturing
                            raise
                    bk.graphs.append(g)
                    self._after(bk, j, captured=True)
            platform.current_stream(device).wait_stream(side)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: this bucket runs eagerly
            log.warning("%s graphs: capture of size %d failed, running it eagerly: %s", self.kind, size, e)
            self.failures[size] = f"{type(e).__name__}: {e}"[:500]
            platform.synchronize(device)
            return None
        # (a capture while serving stalls every running request for this long: the warm-up's sizes avoid it)
        shape = ", ".join(str(x) for x in extra if isinstance(x, int))
        log.info("%s graphs: captured size %d%s in %.3f s", self.kind, size, f" ({shape})" if shape else "",
                 time.perf_counter() - start)  # fmt: skip
        return bk


__all__ = ["BUCKETS", "ReplayGate", "SegmentGraphs", "bucket_for", "captures_so_far"]
