"""The short-term state of many sequences as one tensor per layer, one slot per sequence, for decode steps.

A decode step (one new token per sequence) touches every sequence's window ring and compressor buffers. Kept as
separate tensors per sequence (``SequenceState.windows`` / ``.buffers``), that costs a handful of host-side tensor
operations per sequence and layer (slices, allocations, copies), which is what bounds a graphed decode step at large
batches. ``StatePool`` holds them stacked instead:

* ``rings[layer]`` ``[S, W, d]``: slot ``i``'s window ring (row ``pos % W``); the sequence's ``windows[layer]`` is
  the view ``rings[layer][i]``, so every other path reads and writes the same memory;
* ``rbufs[key]``: the compressors' buffers, as rings (below).

The pool grows by doubling, re-pointing the views of the states it holds; a state gives its slot back when it is
garbage-collected, and its clones (snapshots) are plain tensors.

The decode steps (V4's and V4.1's ``decode_step.py``) keep the compressor buffers as rings (``rbufs[key]``
``([S, cap, D], [S, cap, D])``, position ``p`` at row ``p % cap``; the state's ``buffers[key]`` a ``RingBuffer``), so
that a step is the same kernels whatever each sequence's phase: nothing moves when a group completes, and the host
keeps no per-buffer counters (a ``RingBuffer`` derives its rows from the state's ``num_tokens``). The attention
layers ``register`` their rings and buffers with the pool, and ``adopt`` moves a state's whole short-term state into
a slot at once, on its first pooled step; the per-sequence paths then write through ``SequenceState.set_buffer``
(into the ring) and the window views, so the state stays pooled. Slot ``scratch`` belongs to no state: the padding
rows of a graphed step write there. ``generation`` counts the reallocations (a captured graph holds the tensors).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState

T = TypeVar("T")
log = logging.getLogger(__name__)


class RingBuffer:
    """A compressor buffer living in a pool's ring (``StatePool.rbufs[key]``, position ``p`` at row ``p % cap`` of
    slot ``slot``): positions ``start .. end`` with ``end`` the state's ``num_tokens`` and ``start`` what the
    compressor keeps (the open group, and the last complete one for an overlapping compressor), never below
    ``floor``. ``CompressorBuffer``'s interface (``kv``, ``score``, ``start``; copies in position order)."""

    __slots__ = ("floor", "key", "overlap", "pool", "ratio", "slot", "state")

    def __init__(self, pool: StatePool, key: tuple[int, str], slot: int, state: SequenceState, floor: int) -> None:
        cap, _, self.ratio, self.overlap = pool.ring_specs[key]
        self.pool, self.key, self.slot, self.floor = pool, key, slot, floor
        self.state = weakref.ref(state)

    @property
    def end(self) -> int:
        st = self.state()
        if st is None:
            raise RuntimeError(f"compressor buffer {self.key}: its sequence state is gone")
        return st.num_tokens

    @property
    def start(self) -> int:
        m = self.ratio
        return max(self.floor, max(self.end // m - (1 if self.overlap else 0), 0) * m)

    def _rows(self, i: int) -> torch.Tensor:
        t = self.pool.rbufs[self.key][i]
        return t[self.slot, torch.arange(self.start, self.end, device=t.device) % t.shape[1]]

    @property
    def kv(self) -> torch.Tensor:
        return self._rows(0)

    @property
    def score(self) -> torch.Tensor:
        return self._rows(1)

    def assign(self, buf: CompressorBuffer) -> None:
        """Take the rows of ``buf`` (positions ``buf.start ..``, the state's buffer after a per-sequence step)."""
        kv, sc = self.pool.rbufs[self.key]
        n, cap = buf.kv.shape[0], kv.shape[1]
        if n > cap:
            raise ValueError(f"compressor buffer {self.key} holds {n} rows, more than its ring's {cap}")
        if n:
            at = torch.arange(buf.start, buf.start + n, device=kv.device) % cap
            kv[self.slot, at] = buf.kv.to(kv.device, kv.dtype)
            sc[self.slot, at] = buf.score.to(sc.device, sc.dtype)
        self.floor = buf.start


class StatePool:
    def __init__(self, device: torch.device | str, initial: int = 8, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype = torch.device(device), dtype  # dtype: the window rings' (the model's)
        self.capacity = 0
        self.free: list[int] = []
        self.owners: list[weakref.ref | None] = []
        self.rings: dict[int, torch.Tensor] = {}
        self.ring_specs: dict[tuple[int, str], tuple[int, int, int, bool]] = {}  # key -> (cap, dim, ratio, overlap)
        self.rbufs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.window_specs: dict[int, tuple[int, int]] = {}  # layer -> (rows, dim) of the registered window rings
        self.generation = 0
        self._initial = initial
        self._memo: dict = {}  # this forward's tensors shared by every layer (``memo``)
        self.verify: object | None = None  # a verify step's plan while its forward runs (deepseek_v4.verify_step)
        self._grow(initial)
        self.scratch = self.free.pop()  # no state's: where the padding rows of a graphed step write

    # -- the step ----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Forget what an earlier forward shared (``memo``, ``tables``); the model calls it when a forward (its
        trunk, an MTP block) starts and when it ends."""
        self._memo.clear()

    end_step = begin_step

    def memo(self, chunks: list, key: object, make: Callable[[], T]) -> T:
        """``make()`` once per forward and chunk list under ``key``: what every layer of a decode step derives alike
        from the same chunks (window indices, block tables, attention metadata), built and copied to the device
        once. Valid within one forward only (``begin_step`` / ``end_step``), while ``chunks`` is alive."""
        full = (id(chunks), key)
        got = self._memo.get(full)
        if got is None:
            got = self._memo[full] = make()
        return got

    # -- slots ------------------------------------------------------------------------------------------
    def _take(self, st: SequenceState) -> int:
        if not self.free:
            self._grow(max(self._initial, 2 * self.capacity))
        slot = self.free.pop()
        self.owners[slot] = weakref.ref(st, lambda _, s=slot: self._release(s))
        return slot

    def _release(self, slot: int) -> None:
        self.owners[slot] = None
        self.free.append(slot)

    def _grow(self, capacity: int) -> None:
        old = self.capacity

        def grown(t: torch.Tensor) -> torch.Tensor:
            new = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            new[:old] = t
            return new

        self.rings = {k: grown(v) for k, v in self.rings.items()}
        self.rbufs = {k: (grown(a), grown(b)) for k, (a, b) in self.rbufs.items()}
        self.generation += 1
        if old:  # (a decode step's graphs hold the old tensors: each bucket is captured again when next met)
            log.info("state pool grown from %d to %d slots", old, capacity)
        self.free += range(capacity - 1, old - 1, -1)
        self.owners += [None] * (capacity - old)
        self.capacity = capacity
        for slot, ref in enumerate(self.owners):  # re-point the live states' window views
            st = ref() if ref is not None else None
            if st is not None:
                for layer, ring in self.rings.items():
                    if layer in st.windows:
                        st.windows[layer] = ring[slot]

    # -- whole states (DeepSeek-V4's decode step) ----------------------------------------------------------
    def register(self, windows: dict[int, tuple[int, int]], buffers: dict[tuple[int, str], tuple[int, int, int, bool]]
                 ) -> None:  # fmt: skip
        """An attention layer's window ring ``{layer: (rows, dim)}`` and compressor rings ``{key: (cap, dim, ratio,
        overlap)}``, which ``adopt`` moves into a slot at once (allocated there, on first use)."""
        self.window_specs.update(windows)
        self.ring_specs.update(buffers)

    def adopt(self, states: list[SequenceState]) -> list[int]:
        """Each state's slot. A state not yet in this pool gets one, with its every registered window and compressor
        buffer copied in (its windows become views of ``rings``, its buffers ``RingBuffer`` s); it stays so until it
        is garbage-collected (``SequenceState.set_buffer`` writes a per-sequence step's buffers into its rings)."""
        out = []
        for st in states:
            got = st.pool_slot
            if got is None or got[0] is not self or len(got) < 3:
                got = st.pool_slot = (self, self._take(st) if got is None or got[0] is not self else got[1], True)
                self._adopt(st, got[1])
            out.append(got[1])
        return out

    def _adopt(self, st: SequenceState, slot: int) -> None:
        for layer, (rows, dim) in self.window_specs.items():
            ring = self.rings.get(layer)
            if ring is None:
                ring = self.rings[layer] = torch.zeros(self.capacity, rows, dim, dtype=self.dtype, device=self.device)
            w, view = st.windows.get(layer), ring[slot]
            if w is None:
                view.zero_()
            elif w.data_ptr() != view.data_ptr():
                view.copy_(w)
            st.windows[layer] = view
        for key, (cap, dim, _, _) in self.ring_specs.items():
            if key not in self.rbufs:
                self.rbufs[key] = tuple(
                    torch.zeros(self.capacity, cap, dim, dtype=torch.float32, device=self.device) for _ in range(2)
                )
            b = st.buffers.get(key)
            rb = RingBuffer(self, key, slot, st, st.num_tokens if b is None else b.start)
            if b is not None:
                rb.assign(CompressorBuffer(b.kv, b.score, b.start))  # a copy first: b may read this slot
            st.buffers[key] = rb


def stacked_rows(tables: list[torch.Tensor], longest: int | None = None) -> torch.Tensor:
    """``tables`` (1-D) as one ``[B, P]`` tensor, padded with zeros where they are shorter than the longest
    (``longest``: their most elements, when the caller has counted them): a view of the matrix they are leading slices
    of consecutive rows of, if they are (no copy), else one copy."""
    if longest is None:
        longest = max((t.numel() for t in tables), default=0)
    base = tables[0]._base if tables else None
    if base is not None and base.dim() == 2 and base.is_contiguous() and base.shape[1] >= longest:
        n, width, dt = len(tables), base.shape[1], base.dtype
        row, rem = np.divmod(np.array([t.storage_offset() for t in tables]) - base.storage_offset(), width)
        first = int(row[0])
        if (
            not rem.any()
            and 0 <= first <= base.shape[0] - n
            and (row == np.arange(first, first + n)).all()
            and all(t._base is base and t.dtype is dt and t.is_contiguous() for t in tables)
        ):
            return base[first : first + n, :longest]
    if all(t.numel() == tables[0].numel() for t in tables):
        return torch.stack(tables)
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)


def use_pool(model: torch.nn.Module, on: bool, holder: type) -> None:
    """Give every ``holder`` module of ``model`` (its attention layers) the model's ``StatePool``, made on the weights'
    device, or none; the model keeps ``state_pool`` and the pool its layers hold (``_pool_given``), so the modules
    are walked only when that changes."""
    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    if on and (model.state_pool is None or model.state_pool.device != dev or model.state_pool.dtype != dtype):
        model.state_pool = StatePool(dev, dtype=dtype)
    pool = model.state_pool if on else None
    if model._pool_given is not pool:
        for m in model.modules():
            if isinstance(m, holder):
                m.state_pool = pool
                if pool is not None and hasattr(m, "pool_specs"):
                    pool.register(*m.pool_specs())
        model._pool_given = pool


__all__ = ["RingBuffer", "StatePool", "stacked_rows", "use_pool"]
