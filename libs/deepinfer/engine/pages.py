"""Allocator of fixed-size KV-cache pages (physical page ids ``0 .. num_pages - 1``).

Contract:

* ``allocate(n)`` hands out ``n`` free pages, lowest ids first (returned ascending), each with
  refcount 1; it is all-or-nothing: if fewer than ``n`` are free it raises ``OutOfPages`` and changes
  nothing. ``allocate(0)`` returns ``[]``; ``n < 0`` is a ``ValueError``.
* ``incref(pages)`` adds one reference per occurrence (prefix sharing); every page must be in use.
* ``free(pages)`` drops one reference per occurrence; a page whose refcount reaches 0 goes back to
  the free list. Freeing a free page, an unknown id, or more references than a page holds (counting
  repeats inside one call) raises ``ValueError`` and changes nothing: every call validates first,
  then mutates.
* ``num_used`` counts distinct pages with refcount > 0, so ``num_free + num_used == num_total``
  always holds. ``refcount(page)`` is 0 for a free page; an unknown id is a ``ValueError``.
* Deterministic: the same sequence of calls yields the same page ids.
"""

from __future__ import annotations

import heapq
from collections import Counter


class OutOfPages(RuntimeError):
    """Fewer free pages than requested; the pool is unchanged."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"cannot allocate {requested} pages: only {available} free")
        self.requested = requested
        self.available = available


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        self._total = num_pages
        self._refcounts = [0] * num_pages
        self._free_heap = list(range(num_pages))  # already a valid min-heap
        self._num_used = 0

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self._num_used

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_heap)

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free_heap):
            raise OutOfPages(n, len(self._free_heap))
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._refcounts[p] = 1
        self._num_used += n
        return pages

    def _check_id(self, page: object) -> int:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self._total:
            raise ValueError(f"unknown page id {page!r} (pool has {self._total} pages)")
        return page

    def incref(self, pages: list[int]) -> None:
        counts = Counter(self._check_id(p) for p in pages)
        for p in counts:
            if self._refcounts[p] == 0:
                raise ValueError(f"cannot incref page {p}: it is free")
        for p, c in counts.items():
            self._refcounts[p] += c

    def free(self, pages: list[int]) -> None:
        counts = Counter(self._check_id(p) for p in pages)
        for p, c in counts.items():
            rc = self._refcounts[p]
            if rc == 0:
                raise ValueError(f"double free of page {p}: it is already free")
            if c > rc:
                raise ValueError(f"page {p} freed {c} times but holds only {rc} reference(s)")
        for p, c in counts.items():
            self._refcounts[p] -= c
            if self._refcounts[p] == 0:
                heapq.heappush(self._free_heap, p)
                self._num_used -= 1

    def refcount(self, page: int) -> int:
        return self._refcounts[self._check_id(page)]
