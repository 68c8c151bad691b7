"""The compile cache: compiled grammars by cache key, least recently used first out, capped in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from deepinfer.grammar.spec import CompiledGrammar

__all__ = ["GrammarCache"]


class GrammarCache:
    """A byte-capped LRU map ``cache_key -> CompiledGrammar`` (thread-safe). Capacity 0 caches nothing; an entry
    larger than the capacity is not kept."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = max(0, int(capacity_bytes))
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, grammar: CompiledGrammar) -> bool:
        """Keep ``grammar`` under its cache key, evicting the least recently used; False if it cannot fit."""
        size = grammar.nbytes
        if size > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(grammar.cache_key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            while self._entries and self.used_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.used_bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[grammar.cache_key] = grammar
            self.used_bytes += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0
