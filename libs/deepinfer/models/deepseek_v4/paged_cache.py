"""The paged cache of DeepSeek-V4 (docs/deepseek_v4.md ("Inference state per layer")): the long-term, append-only,
prefix-shareable state of every compressed layer (compressed rows of every CSA/HCA layer, indexer keys of CSA layers)
in fixed-size *pages* of ``page_size`` tokens (a page holds ``page_size / m`` rows of a ratio-``m`` layer), reached
through a per-sequence block table of physical page ids.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.models.deepseek_v4.config import CacheStore
from deepinfer.runtime.host_copy import copy_to, to_device


class CacheConfig(Protocol):
    """What a paged cache needs from a model's config (V4 and V4.1 both provide it)."""

    @property
    def page_multiple(self) -> int: ...

    def cache_layout(self) -> list[CacheStore]: ...


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

    def slots(self, layer: int, block_table: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, ...]:
        """(pages, slots in them) of rows ``first .. first + count`` of ``layer`` through ``block_table``."""
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
        pages, slots = self.slots(layer, block_table, first, rows.shape[0])
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
        pages, slots = self.slots(layer, block_table, 0, count)
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
        self, pages: torch.Tensor, device: torch.device | str | None = None
    ) -> dict[tuple[str, int], torch.Tensor]:
        """Copies of whole pages: ``{(kind, layer): [len(pages), rows per page, dim]}``, on the cache's device (a
        gather queued like any other work) unless ``device`` says otherwise."""
        out = {(k, layer): self._store(k, layer)[pages] for k, layer in self.stores()}  # (indexing copies)
        return out if device is None else {key: t.to(device) for key, t in out.items()}

    def write_pages(self, pages: torch.Tensor, data: dict[tuple[str, int], torch.Tensor]) -> None:
        """Fill whole ``pages`` from :meth:`read_pages` output (the layouts must match)."""
        for (k, layer), t in data.items():
            store = self._store(k, layer)
            if t.shape[1:] != store.shape[1:] or t.shape[0] != pages.numel():
                raise ValueError(
                    f"pages of {k} layer {layer}: got {tuple(t.shape)}, the cache holds {tuple(store.shape[1:])}"
                )
            store[pages] = copy_to(t, store.device).to(store.dtype)  # (from the host: no wait for the device)
