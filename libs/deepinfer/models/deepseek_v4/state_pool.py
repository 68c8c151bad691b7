"""The short-term state of many sequences as one tensor per layer, one slot per sequence, for decode steps.

A decode step (one new token per sequence) touches every sequence's window ring and compressor buffers. Kept as
separate tensors per sequence (``SequenceState.windows`` / ``.buffers``), that costs a handful of host-side tensor
operations per sequence and layer (slices, allocations, copies), which is what bounds a graphed decode step at large
batches. ``StatePool`` holds them stacked instead:

* ``rings[layer]`` ``[S, W, d]``: slot ``i``'s window ring (row ``pos % W``); the sequence's ``windows[layer]`` is
  the view ``rings[layer][i]``, so every other path reads and writes the same memory;
* ``bufs[(layer, name)]`` ``([S, cap, D], [S, cap, D])``: the compressor's pending fp32 projections and scores
  (``cap`` = 2·ratio for the overlapping CSA compressors, ratio otherwise); the sequence's ``buffers[key]`` is a
  ``PooledBuffer`` (``kv`` / ``score`` views of its first ``length`` rows, ``start``), which the per-sequence code
  reads like a ``CompressorBuffer``. When that code replaces it with a plain buffer, the next pooled step copies it
  back in.

A state gets a slot on its first pooled step (its existing window and buffers are copied in) and gives it back when
it is garbage-collected; its clones (snapshots) are plain tensors. The pool grows by doubling, re-pointing the
views of the states it holds. Index arithmetic on all slots at once replaces the per-sequence work
(``attention.Attention._attend_decode``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from deepinfer.models.deepseek_v4.state import SequenceState

T = TypeVar("T")


@dataclass
class PooledBuffer:
    """A compressor buffer living in a pool slot: positions ``start .. start + length`` (``CompressorBuffer``'s
    interface: ``kv``, ``score``, ``start``)."""

    pool: StatePool = field(repr=False)
    key: tuple[int, str]
    slot: int
    length: int
    start: int

    @property
    def kv(self) -> torch.Tensor:
        return self.pool.bufs[self.key][0][self.slot, : self.length]

    @property
    def score(self) -> torch.Tensor:
        return self.pool.bufs[self.key][1][self.slot, : self.length]


class StatePool:
    def __init__(self, device: torch.device | str, initial: int = 8) -> None:
        self.device = torch.device(device)
        self.capacity = 0
        self.free: list[int] = []
        self.owners: list[weakref.ref | None] = []
        self.rings: dict[int, torch.Tensor] = {}
        self.bufs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._initial = initial
        self._memo: dict = {}  # this forward's tensors shared by every layer (``memo``)

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

    def tables(self, chunks: list, tables: list[torch.Tensor]) -> torch.Tensor:
        """The block tables of ``chunks`` padded into one ``[B, P]`` tensor (made once per step, shared by every
        layer): the rows they are views of when they are consecutive rows of one matrix (the worker's one copy of a
        step's tables), else stacked or padded (a copy)."""
        return self.memo(chunks, "tables", lambda: stacked_rows(tables))

    # -- slots ------------------------------------------------------------------------------------------
    def slots(self, states: list[SequenceState]) -> list[int]:
        """Each state's slot, assigning free slots (growing the pool) to states that have none here."""
        out = []
        for st in states:
            got = st.pool_slot
            if got is None or got[0] is not self:
                got = st.pool_slot = (self, self._take(st))
            out.append(got[1])
        return out

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
        self.bufs = {k: (grown(a), grown(b)) for k, (a, b) in self.bufs.items()}
        self.free += range(capacity - 1, old - 1, -1)
        self.owners += [None] * (capacity - old)
        self.capacity = capacity
        for slot, ref in enumerate(self.owners):  # re-point the live states' window views
            st = ref() if ref is not None else None
            if st is not None:
                for layer, ring in self.rings.items():
                    if layer in st.windows:
                        st.windows[layer] = ring[slot]

    # -- windows ----------------------------------------------------------------------------------------
    def ring(self, layer: int, states: list[SequenceState], slots: list[int], size: int, dim: int,
             dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """The rings of ``layer`` ``[S, size, dim]``, every state's window adopted into its slot."""
        ring = self.rings.get(layer)
        if ring is None:
            ring = self.rings[layer] = torch.zeros(self.capacity, size, dim, dtype=dtype, device=self.device)
        base, step = ring.data_ptr(), ring.stride(0) * ring.element_size()
        for st, slot in zip(states, slots):
            w = st.windows.get(layer)
            if w is None or w.data_ptr() != base + slot * step:  # not this slot's view yet
                view = ring[slot]
                if w is None:
                    view.zero_()
                else:
                    view.copy_(w)
                st.windows[layer] = view
        return ring

    # -- compressor buffers -----------------------------------------------------------------------------
    def buffers(self, key: tuple[int, str], states: list[SequenceState], slots: list[int], starts: list[int],
                cap: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, list[PooledBuffer]]:  # fmt: skip
        """The pooled buffers of ``key`` (``kv``, ``score`` ``[S, cap, dim]``) and every state's ``PooledBuffer``
        (a plain buffer is copied in; none starts empty at the state's next position ``starts[i]``)."""
        pair = self.bufs.get(key)
        if pair is None:
            pair = self.bufs[key] = tuple(
                torch.zeros(self.capacity, cap, dim, dtype=torch.float32, device=self.device) for _ in range(2)
            )
        out = []
        for st, slot, start in zip(states, slots, starts):
            b = st.buffers.get(key)
            if type(b) is PooledBuffer and b.pool is self and b.slot == slot:
                out.append(b)
                continue
            n = 0 if b is None else b.kv.shape[0]
            if n > cap:
                raise ValueError(f"compressor buffer {key} holds {n} rows, more than the pool's {cap}")
            if n:
                pair[0][slot, :n] = b.kv
                pair[1][slot, :n] = b.score
            pb = PooledBuffer(self, key, slot, n, start if b is None else b.start)
            st.buffers[key] = pb
            out.append(pb)
        return pair[0], pair[1], out


def stacked_rows(tables: list[torch.Tensor]) -> torch.Tensor:
    """``tables`` (1-D) as one ``[B, P]`` tensor, padded with zeros where they are shorter than the longest: a view
    of the matrix they are leading slices of consecutive rows of, if they are (no copy), else one copy."""
    base = tables[0]._base if tables else None
    longest = max((t.numel() for t in tables), default=0)
    if base is not None and base.dim() == 2 and base.is_contiguous() and base.shape[1] >= longest:
        width, off = base.shape[1], base.storage_offset()
        first, rem = divmod(tables[0].storage_offset() - off, width)
        if not rem and all(
            t._base is base and t.stride(0) == 1 and t.storage_offset() - off == (first + i) * width
            for i, t in enumerate(tables)
        ):
            return base[first : first + len(tables), :longest]
    if all(t.numel() == tables[0].numel() for t in tables):
        return torch.stack(tables)
    return torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)


def use_pool(model: torch.nn.Module, on: bool, holder: type) -> None:
    """Give every ``holder`` module of ``model`` (its attention layers) the model's ``StatePool``, made on the weights'
    device, or none; the model keeps ``state_pool`` and the pool its layers hold (``_pool_given``), so the modules
    are walked only when that changes."""
    dev = model.embed.weight.device
    if on and (model.state_pool is None or model.state_pool.device != dev):
        model.state_pool = StatePool(dev)
    pool = model.state_pool if on else None
    if model._pool_given is not pool:
        for m in model.modules():
            if isinstance(m, holder):
                m.state_pool = pool
        model._pool_given = pool


__all__ = ["PooledBuffer", "StatePool", "stacked_rows", "use_pool"]
