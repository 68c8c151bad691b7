"""The scheduler's index of the resume points the kvstore holds, built from hashes alone.

KV events name a stored resume point by a one-way tag and file it under the anchor of its chain hash, with its
position (``deepinfer.kvstore.keys``): no key, no token. A lookup walks a request's own chain (salted root, full
pages), and for each entry filed under one of its anchors derives the tail digest, the key and the tag from the
request's tokens; a matching tag is a hit, and the key just derived is what the worker fetches. An entry is thus
only ever usable by a request with the same fingerprint, salt and tokens. Entries are dropped least recently
used first beyond ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.engine.prefix_cache import page_hashes
from deepinfer.kvstore.keys import anchor, key_tag, resume_key, tail_digest

__all__ = ["RemoteEntry", "RemoteIndex"]


@dataclass
class RemoteEntry:
    """A resume point some kvstore holds: its tag, anchor and position (``key``: set by a lookup that matched)."""

    tag: bytes
    anchor: bytes
    position: int
    key: bytes = b""


class RemoteIndex:
    """Entries by tag (LRU order) and by anchor (for prefix matching)."""

    def __init__(self, fingerprint: str, page_size: int, capacity: int = 1 << 20) -> None:
        self.fingerprint, self.page_size, self.capacity = fingerprint, page_size, capacity
        self._lru: OrderedDict[bytes, RemoteEntry] = OrderedDict()
        self._by_anchor: dict[bytes, dict[bytes, RemoteEntry]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, anchor_: bytes, position: int, tag: bytes) -> RemoteEntry:
        """Index (or refresh) one entry; the least recently used ones go beyond the capacity."""
        entry = self._lru.get(tag)
        if entry is None or entry.anchor != anchor_ or entry.position != position:
            self.remove(tag)
            entry = self._lru[tag] = RemoteEntry(tag, anchor_, position)
            self._by_anchor.setdefault(anchor_, {})[tag] = entry
        self._lru.move_to_end(tag)
        while len(self._lru) > self.capacity:
            self.remove(next(iter(self._lru)))
        return entry

    def remove(self, tag: bytes) -> None:
        """Forget one entry (no error if unknown)."""
        entry = self._lru.pop(tag, None)
        if entry is None:
            return
        group = self._by_anchor.get(entry.anchor)
        if group is not None:
            group.pop(tag, None)
            if not group:
                del self._by_anchor[entry.anchor]

    def lookup(self, tokens: Sequence[int], root: bytes, limit: int, hashes: Sequence[bytes] | None = None
               ) -> RemoteEntry | None:  # fmt: skip
        """The longest entry whose tokens are a prefix of ``tokens`` (position at most ``limit``) under ``root``,
        with its key derived; it becomes the most recently used. ``hashes``: the chain ``page_hashes`` gives for
        these arguments, when the caller has it already."""
        if not self._lru or limit <= 0:
            return None
        ps, fp = self.page_size, self.fingerprint
        if hashes is None:
            hashes = page_hashes(tokens, root, ps, limit // ps)
        for k in range(len(hashes) - 1, -1, -1):
            group = self._by_anchor.get(anchor(hashes[k]))
            if not group:
                continue
            for entry in sorted(group.values(), key=lambda e: -e.position):
                if entry.position > limit or entry.position // ps != k:
                    continue
                tail = tail_digest(hashes[k], tokens[k * ps : entry.position])
                key = resume_key(fp, hashes[k], tail, entry.position)
                if key_tag(fp, key) == entry.tag:
                    self._lru.move_to_end(entry.tag)
                    return RemoteEntry(entry.tag, entry.anchor, entry.position, key)
        return None
