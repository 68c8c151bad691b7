"""Per-sequence inference state of DeepSeek-V4 (docs/deepseek_v4.md ("Inference state per layer")).

The short-term state of one sequence (:class:`SequenceState`): a ring of the last ``sliding_window`` raw KV rows per
layer (slot ``pos % W``) and the compressor buffers: fp32 projections of the tokens not yet pooled (plus, for
overlapping CSA compressors, the previous complete window). The long-term state (compressed rows, indexer keys) lives
in the paged cache (``paged_cache.PagedKVCache``); a :class:`StateSnapshot` holds what resumes a sequence besides its
full pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.runtime.host_copy import HostCopies, copy_to
from deepinfer.runtime.platform import Event


@dataclass
class CompressorBuffer:
    """Projections (``kv``, ``score`` incl. the position bias) of positions ``[start, start + len)``."""

    kv: torch.Tensor
    score: torch.Tensor
    start: int = 0


@dataclass
class SequenceState:
    """Per-sequence short-term state; ``num_tokens`` positions have been consumed so far."""

    windows: dict[int, torch.Tensor] = field(default_factory=dict)
    buffers: dict[tuple[int, str], CompressorBuffer] = field(default_factory=dict)
    num_tokens: int = 0
    mtp_tokens: int = 0
    window_start: int = 0  # window rows below this position do not exist (a bounded replay started here)
    replay_until: int = 0  # compressed rows below this position are in the cache already: not rewritten
    history: tuple[int, ...] = ()  # the last few token ids (V4.1 Engram n-grams; -1 = blocked), oldest first
    decoder_start: int = 0  # V4.1 bounded replay: the decoder layers' window rows below this position do not exist
    # (StatePool, slot[, True once adopted whole]) once a decode step pooled its windows and buffers (state_pool.py)
    pool_slot: tuple | None = field(default=None, compare=False, repr=False)

    def set_buffer(self, key: tuple[int, str], buf: CompressorBuffer) -> None:
        """Replace a compressor buffer: a buffer living in a ``StatePool`` (``state_pool.RingBuffer``) takes the
        rows in place, so the state stays pooled; otherwise ``buf`` is stored."""
        cur = self.buffers.get(key)
        if cur is not None and hasattr(cur, "assign"):
            cur.assign(buf)
        else:
            self.buffers[key] = buf

    def window(self, layer: int, size: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        w = self.windows.get(layer)
        if w is None:
            w = self.windows[layer] = torch.zeros(size, dim, dtype=dtype, device=device)
        return w

    def clone(
        self, device: torch.device | str | None = None, copy: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> SequenceState:
        """A deep copy (on ``device`` if given; ``copy``: how each tensor is copied, e.g. ``HostCopies``)."""

        def cp(t: torch.Tensor) -> torch.Tensor:
            if copy is not None:
                return copy(t)
            return t.to(device, copy=True) if device is not None else t.clone()

        out = SequenceState(self.windows, self.buffers, self.num_tokens, self.mtp_tokens, self.window_start,
                            self.replay_until, self.history, self.decoder_start)  # fmt: skip
        out.windows = {k: cp(v) for k, v in self.windows.items()}
        out.buffers = {k: CompressorBuffer(cp(b.kv), cp(b.score), b.start) for k, b in self.buffers.items()}
        return out

    def nbytes(self) -> int:
        n = sum(w.numel() * w.element_size() for w in self.windows.values())
        for b in self.buffers.values():
            n += b.kv.numel() * b.kv.element_size() + b.score.numel() * b.score.element_size()
        return n


def ring_span(ring: torch.Tensor, first: int, count: int) -> list[torch.Tensor]:
    """Views of a window ring's slots of positions ``first .. first + count`` in position order (one or two pieces;
    slot ``pos % len(ring)``)."""
    if count <= 0:
        return []
    size = ring.shape[0]
    a = first % size
    if a + count <= size:
        return [ring[a : a + count]]
    return [ring[a:], ring[: a + count - size]]


@dataclass
class StateSnapshot:
    """Everything needed to resume a sequence at ``position`` besides its full pages: the short-term state
    and the rows of the partial page below ``position`` (``tail[(kind, layer)]``)."""

    state: SequenceState
    tail: dict[tuple[str, int], torch.Tensor]
    compact: bool = False  # no windows or buffers: resuming replays the last tokens (bounded replay)
    # the copies into host memory are queued, not done, until this event has completed (``HostCopies``): the host
    # reads them after :meth:`wait`; a restore copies them back on the same stream, after them
    ready: Event | None = field(default=None, compare=False, repr=False)

    @property
    def position(self) -> int:
        return self.state.num_tokens

    def wait(self) -> None:
        """Until the snapshot's host copies are complete (before the host reads them: ``resume_format.encode``)."""
        ready = self.ready
        if ready is not None:
            ready.synchronize()

    @classmethod
    def take(
        cls,
        state: SequenceState,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        device: torch.device | str = "cpu",
        compact: bool = False,
    ) -> StateSnapshot:
        """A snapshot of ``state`` on ``device``; in host memory (the default) its copies are queued without waiting
        for the device (``HostCopies``; ``ready``)."""
        copy = HostCopies(block_table.device) if torch.device(device).type == "cpu" else None
        tail = {}
        p, ps = state.num_tokens, cache.page_size
        for kind, stores in (("rows", cache.rows), ("index", cache.index_keys)):
            for layer in stores:
                m = cache.ratios[layer]
                first, count = (p // ps) * ps // m, p // m - (p // ps) * ps // m
                if count:
                    pages, slots = cache.slots(layer, block_table, first, count)
                    rows = stores[layer][pages, slots]
                    tail[(kind, layer)] = copy(rows) if copy is not None else rows.to(device, copy=True)
        if compact:
            snap = cls(SequenceState(num_tokens=p, mtp_tokens=p), tail, compact=True)
        else:
            snap = cls(state.clone(device, copy), tail)
        snap.ready = copy.done() if copy is not None else None
        return snap

    def restore(self, cache: PagedKVCache, block_table: torch.Tensor, device: torch.device | str) -> SequenceState:
        """A fresh state at ``position``; writes the partial page's rows into ``block_table``'s page. The copies to
        the device are queued without waiting for it (``copy_to``), after the snapshot's own copies (same stream)."""
        p, ps = self.position, cache.page_size
        for (kind, layer), rows in self.tail.items():
            cache.write(kind, layer, block_table, (p // ps) * ps // cache.ratios[layer], copy_to(rows, device))
        return self.state.clone(copy=lambda t: copy_to(t, device))

    def restore_replay(
        self, cache: PagedKVCache, block_table: torch.Tensor, device: torch.device | str, start: int
    ) -> SequenceState:
        """A compact snapshot's state for a bounded replay of tokens ``start .. position``: no window rows
        below ``start`` (attention there is truncated: approximate by design), no token history (V4.1's Engram
        n-grams reaching before ``start`` hash as blocked, likewise) and no compressed rows rewritten below
        ``position`` (the cached ones are exact)."""
        self.restore(cache, block_table, device)
        return SequenceState(num_tokens=start, mtp_tokens=start, window_start=start, replay_until=self.position)
