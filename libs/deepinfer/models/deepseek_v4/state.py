"""Inference state of DeepSeek-V4 (docs/deepseek_v4.md ("Inference state per layer")) and the description of one forward
step.

Two classes of state:
- long-term, append-only, prefix-shareable: compressed rows of every CSA/HCA layer and the
  indexer keys of CSA layers. They live in fixed-size *pages* of ``page_size`` tokens
  (a page holds ``page_size / m`` rows of a ratio-``m`` layer), reached through a per-sequence
  block table of physical page ids (:class:`PagedKVCache`).
- short-term, per sequence (:class:`SequenceState`): a ring of the last ``sliding_window`` raw
  KV rows per layer (slot ``pos % W``) and the compressor buffers: fp32 projections of the tokens
  not yet pooled (plus, for overlapping CSA compressors, the previous complete window).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from deepinfer.host_copy import to_device
from deepinfer.models.deepseek_v4.config import CacheStore


class CacheConfig(Protocol):
    """What a paged cache needs from a model's config (V4 and V4.1 both provide it)."""

    @property
    def page_multiple(self) -> int: ...

    def cache_layout(self) -> list[CacheStore]: ...


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

    def clone(self, device: torch.device | str | None = None) -> SequenceState:
        """A deep copy (on ``device`` if given)."""

        def cp(t: torch.Tensor) -> torch.Tensor:
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


class PagedKVCache:
    """Compressed rows and indexer keys of every compressed layer, in pages shared by all sequences."""

    def __init__(
        self,
        config: CacheConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size <= 0 or page_size % config.page_multiple:
            raise ValueError(
                f"page_size={page_size} must be a positive multiple of {config.page_multiple} "
                f"(the least common multiple of the model's compression ratios)"
            )
        self.config, self.num_pages, self.page_size = config, num_pages, page_size
        # one more page than the block tables may name: a decode step's masked writes (rows not completed, the
        # padding rows of a graphed step) land there, and its padded tables point there (decode_step.py)
        self.scratch_page = num_pages
        self.ratios: dict[int, int] = {}
        self.rows: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for store in config.cache_layout():
            m, layer = store.ratio, store.layer
            self.ratios[layer] = m
            shape = (num_pages + 1, page_size // m)
            self.rows[layer] = torch.zeros(*shape, store.row_dim, dtype=dtype, device=device)
            if store.index_dim:
                self.index_keys[layer] = torch.zeros(*shape, store.index_dim, dtype=dtype, device=device)

    def bytes_per_page(self) -> int:
        t = list(self.rows.values()) + list(self.index_keys.values())
        return sum(x[0].numel() * x.element_size() for x in t)

    def _store(self, kind: str, layer: int) -> torch.Tensor:
        return self.rows[layer] if kind == "rows" else self.index_keys[layer]

    def _slots(self, layer: int, block_table: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, ...]:
        per_page = self.page_size // self.ratios[layer]
        if count and (first + count - 1) // per_page >= block_table.numel():  # host ints: no device sync
            raise IndexError(
                f"block table has {block_table.numel()} pages, row {first + count - 1} of layer {layer} needs more"
            )
        w = torch.arange(first, first + count, device=block_table.device)
        return block_table[w // per_page], w % per_page

    def write(self, kind: str, layer: int, block_table: torch.Tensor, first: int, rows: torch.Tensor) -> None:
        """Store rows ``first .. first + len(rows)`` of one sequence."""
        if rows.shape[0] == 0:
            return
        pages, slots = self._slots(layer, block_table, first, rows.shape[0])
        store = self._store(kind, layer)
        store[pages, slots] = rows.to(store.dtype)

    def write_many(self, kind: str, layer: int, writes: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
        """Several sequences' :meth:`write` in one scatter: ``writes`` holds ``(block_table, first, rows)``."""
        writes = [w for w in writes if w[2].shape[0]]
        if len(writes) <= 1:
            for table, first, rows in writes:
                self.write(kind, layer, table, first, rows)
            return
        per_page = self.page_size // self.ratios[layer]
        meta, o = [], 0  # (first row, rows, the table's offset in the joined tables) a write
        for table, first, rows in writes:
            n = rows.shape[0]
            if (first + n - 1) // per_page >= table.numel():
                raise IndexError(
                    f"block table has {table.numel()} pages, row {first + n - 1} of layer {layer} needs more"
                )
            meta.append((first, n, o))
            o += table.numel()
        first, n, off = torch.tensor(meta, dtype=torch.long).unbind(1)  # the rows of every write at once
        start = torch.cumsum(n, 0) - n
        w = torch.arange(int(n.sum())) + torch.repeat_interleave(first - start, n)
        tables = torch.cat([t for t, _, _ in writes])
        idx = to_device(torch.stack([w // per_page + torch.repeat_interleave(off, n), w % per_page]), tables.device)
        store = self._store(kind, layer)
        store[tables[idx[0]], idx[1]] = torch.cat([r for _, _, r in writes]).to(store.dtype)

    def read(self, kind: str, layer: int, block_table: torch.Tensor, count: int) -> torch.Tensor:
        """Rows ``0 .. count`` of one sequence, in order."""
        pages, slots = self._slots(layer, block_table, 0, count)
        return self._store(kind, layer)[pages, slots]

    def read_many(
        self,
        kind: str,
        layer: int,
        block_tables: list[torch.Tensor],
        counts: list[int],
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows ``0 .. counts[i]`` of several sequences in one gather: ``(pool, offsets)``, sequence ``i``'s row ``r``
        at ``pool[offsets[i] + r]``. The pool holds each sequence's pages whole, so rows past a count are other data."""
        per_page = self.page_size // self.ratios[layer]
        store = self._store(kind, layer)
        pages, offsets, o = [], [], 0
        for table, count in zip(block_tables, counts):
            n = -(-count // per_page)
            if n > table.numel():
                raise IndexError(f"block table has {table.numel()} pages, row {count - 1} of layer {layer} needs more")
            pages.append(table[:n])
            offsets.append(o)
            o += n * per_page
        if not o:
            return store.new_zeros(0, store.shape[-1]), offsets
        return store[torch.cat(pages) if len(pages) > 1 else pages[0]].flatten(0, 1), offsets

    def stores(self) -> list[tuple[str, int]]:
        """Every ``(kind, layer)`` this cache holds."""
        return [("rows", layer) for layer in self.rows] + [("index", layer) for layer in self.index_keys]

    def read_pages(
        self, pages: torch.Tensor, device: torch.device | str = "cpu"
    ) -> dict[tuple[str, int], torch.Tensor]:
        """Copies of whole pages: ``{(kind, layer): [len(pages), rows per page, dim]}``."""
        return {(k, layer): self._store(k, layer)[pages].to(device, copy=True) for k, layer in self.stores()}

    def write_pages(self, pages: torch.Tensor, data: dict[tuple[str, int], torch.Tensor]) -> None:
        """Fill whole ``pages`` from :meth:`read_pages` output (the layouts must match)."""
        for (k, layer), t in data.items():
            store = self._store(k, layer)
            if t.shape[1:] != store.shape[1:] or t.shape[0] != pages.numel():
                raise ValueError(
                    f"pages of {k} layer {layer}: got {tuple(t.shape)}, the cache holds {tuple(store.shape[1:])}"
                )
            store[pages] = t.to(store.device, store.dtype)


@dataclass
class StateSnapshot:
    """Everything needed to resume a sequence at ``position`` besides its full pages: the short-term state
    and the rows of the partial page below ``position`` (``tail[(kind, layer)]``)."""

    state: SequenceState
    tail: dict[tuple[str, int], torch.Tensor]
    compact: bool = False  # no windows or buffers: resuming replays the last tokens (bounded replay)

    @property
    def position(self) -> int:
        return self.state.num_tokens

    @classmethod
    def take(
        cls,
        state: SequenceState,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        device: torch.device | str = "cpu",
        compact: bool = False,
    ) -> StateSnapshot:
        tail = {}
        p, ps = state.num_tokens, cache.page_size
        for kind, stores in (("rows", cache.rows), ("index", cache.index_keys)):
            for layer in stores:
                m = cache.ratios[layer]
                first, count = (p // ps) * ps // m, p // m - (p // ps) * ps // m
                if count:
                    pages, slots = cache._slots(layer, block_table, first, count)
                    tail[(kind, layer)] = stores[layer][pages, slots].to(device, copy=True)
        if compact:
            return cls(SequenceState(num_tokens=p, mtp_tokens=p), tail, compact=True)
        return cls(state.clone(device), tail)

    def restore(self, cache: PagedKVCache, block_table: torch.Tensor, device: torch.device | str) -> SequenceState:
        """A fresh state at ``position``; writes the partial page's rows into ``block_table``'s page."""
        p, ps = self.position, cache.page_size
        for (kind, layer), rows in self.tail.items():
            cache.write(kind, layer, block_table, (p // ps) * ps // cache.ratios[layer], rows.to(device))
        return self.state.clone(device)

    def restore_replay(
        self, cache: PagedKVCache, block_table: torch.Tensor, device: torch.device | str, start: int
    ) -> SequenceState:
        """A compact snapshot's state for a bounded replay of tokens ``start .. position``: no window rows
        below ``start`` (attention there is truncated: approximate by design), no token history (V4.1's Engram
        n-grams reaching before ``start`` hash as blocked, likewise) and no compressed rows rewritten below
        ``position`` (the cached ones are exact)."""
        self.restore(cache, block_table, device)
        return SequenceState(num_tokens=start, mtp_tokens=start, window_start=start, replay_until=self.position)


@dataclass
class SeqChunk:
    """``length`` new tokens of one sequence starting at absolute position ``start``."""

    state: SequenceState
    start: int
    length: int
    block_table: torch.Tensor
    # V4.1 encoder/decoder split: the decoder layers run on positions >= decoder_from only (bounded replay of a
    # prompt's tail; the rows before it get no output). None: every position (exact).
    decoder_from: int | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index, as a tensor made there reports it (``cuda`` → ``cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ForwardBatch:
    """One step: the new tokens of several sequences, concatenated in ``chunks`` order.

    ``token_ids`` and ``positions`` are device tensors. A batch built from host lists (``build``) keeps them in host
    memory (``host_token_ids``, ``host_positions``) and copies them to ``device`` together, once, when one is first
    read: a graphed decode step reads the host ids alone (into its bucket's one metadata copy) and never needs them."""

    def __init__(
        self,
        token_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        chunks: list[SeqChunk],
        input_embeds: torch.Tensor | None = None,  # [T, hidden] in place of the token embeddings (image features)
        image_mask: torch.Tensor | None = None,  # [T] bool: image-span tokens (V4.1: bias_vl routing, no Engram)
        host_token_ids: torch.Tensor | None = None,  # token_ids in host memory, where the batch was built from lists
        host_positions: torch.Tensor | None = None,
        device: torch.device | str | None = None,  # where token_ids / positions go when they are made lazily
    ) -> None:
        if token_ids is None and (host_token_ids is None or host_positions is None or device is None):
            raise ValueError("ForwardBatch: token_ids, or host_token_ids, host_positions and device")
        self._token_ids, self._positions = token_ids, positions
        self.chunks, self.input_embeds, self.image_mask = chunks, input_embeds, image_mask
        self.host_token_ids, self.host_positions = host_token_ids, host_positions
        self._host_both: torch.Tensor | None = None  # [2, T] whose rows are the two (build): copied as it is
        self.device = token_ids.device if token_ids is not None else _indexed(torch.device(device))

    @property
    def token_ids(self) -> torch.Tensor:
        if self._token_ids is None:
            self._to_device()
        return self._token_ids

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._to_device()
        return self._positions

    @property
    def num_tokens(self) -> int:
        return (self._token_ids if self._token_ids is not None else self.host_token_ids).shape[0]

    def _to_device(self) -> None:
        ids, pos, both = self.host_token_ids, self.host_positions, self._host_both
        if both is None or both[0].data_ptr() != ids.data_ptr() or both[1].data_ptr() != pos.data_ptr():
            both = torch.stack([ids, pos])
        both = to_device(both, self.device)  # one copy
        self._token_ids, self._positions = both[0], both[1]

    def substitute(self, at: list[int], sources: list[tuple[torch.Tensor, int]]) -> None:
        """Token ``at[i]`` becomes element ``sources[i][1]`` of the device tensor ``sources[i][0]`` (an earlier
        step's samples, maybe not computed yet): the copy is queued on the device, so the host never waits for it.
        The ids then live on the device only (``host_token_ids`` is None)."""
        if not at:
            return
        ids = self.token_ids
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for a, (src, row) in zip(at, sources):
            g = groups.setdefault(id(src), (src, [], []))
            g[1].append(a)
            g[2].append(row)
        for src, where, rows in groups.values():
            a, r, k = where[0], rows[0], len(where)
            if where == list(range(a, a + k)) and rows == list(range(r, r + k)):
                ids[a : a + k].copy_(src[r : r + k].to(ids.dtype))  # consecutive rows (a decode batch): no index
                continue
            idx = to_device(torch.tensor([where, rows], dtype=torch.long), self.device)
            ids.index_copy_(0, idx[0], src.index_select(0, idx[1]).to(ids.dtype))
        self.host_token_ids = None

    @classmethod
    def build(
        cls, chunks: list[SeqChunk], token_ids: list[list[int]], device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        if len(chunks) != len(token_ids):
            raise ValueError("one token list per chunk is required")
        for c, t in zip(chunks, token_ids):
            if len(t) != c.length:
                raise ValueError(f"chunk declares {c.length} tokens but {len(t)} were given")
            if c.start != c.state.num_tokens:
                raise ValueError(f"chunk starts at {c.start} but the sequence state holds {c.state.num_tokens} tokens")
        lens = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        n = int(lens.sum())
        # ids and positions in one [2, T] array, no per-token or per-chunk torch op: a third of the time of
        # torch.tensor + torch.arange per chunk for a 4096-token prompt, half for a decode batch of 256
        host = np.empty((2, n), dtype=np.int64)
        host[0] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=n)
        host[1] = np.arange(n, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        both = torch.from_numpy(host)
        batch = cls(None, None, chunks, host_token_ids=both[0], host_positions=both[1], device=device)
        batch._host_both = both
        return batch

    def offsets(self) -> list[tuple[int, int]]:
        out, o = [], 0
        for c in self.chunks:
            out.append((o, o + c.length))
            o += c.length
        return out
