"""The scheduler's device prefix cache: resume points over pages addressed by a hash chain.

DeepSeek-V4's state has two parts (docs/deepseek_v4.md ("Inference state per layer")): compressed rows and index keys,
append-only and a function of the prefix, in pages; and a per-sequence short-term part (the 128-row window ring and the
compressor buffers). Sharing pages is not enough to resume a prefix exactly: the short-term state at the resume position
is needed too. A **resume point** at position ``P`` therefore holds

* references to the ``P // page_size`` full pages of the prefix (so they outlive the request), and
* a worker-side snapshot (``snapshot_id``): the short-term state at ``P`` plus the rows of the partial
  page below ``P``, taken by the worker when the scheduler asks (``WorkerStepPlan.snapshots``).

A resume point is addressed by the hash chain of its tokens: ``root = H(model fingerprint, cache salt)``,
``h_k = H(h_{k-1}, tokens of page k)`` for each full page, and the tail tokens after the last full page.
Different salts never share an entry. A request resumes from the longest resume point that is a prefix of
its tokens and leaves at least one token to compute. Unused resume points are evicted least recently used
first, when the page pool runs short or their number exceeds the capacity.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def root_hash(fingerprint: str, salt: str | None) -> bytes:
    """The chain's root: the model (weights, dtype, page size) and the tenant's cache salt."""
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-root")
    h.update(fingerprint.encode())
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    return h.digest()


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one page (or tail) of tokens after ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16, person=b"deepinfer-page")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def page_hashes(tokens: Sequence[int], root: bytes, page_size: int, pages: int) -> list[bytes]:
    """``[h_0 = root, h_1, ..., h_pages]`` over the first ``pages`` full pages of ``tokens``."""
    out = [root]
    for k in range(pages):
        out.append(chain(out[-1], tokens[k * page_size : (k + 1) * page_size]))
    return out


@dataclass
class ResumePoint:
    snapshot_id: str
    position: int
    base: bytes  # hash after the last full page
    tail: tuple[int, ...]  # tokens after the last full page (fewer than a page)
    pages: list[int]  # the full pages, referenced while the resume point lives
    visible: bool = False  # the worker has been told to take the snapshot


Key = tuple[bytes, tuple[int, ...]]  # (base hash, tail tokens)
MISS_REASONS = (
    "no_resume_point", "evicted", "salt_mismatch", "not_yet_stored",
    "kvstore_not_found", "kvstore_data_loss", "kvstore_unavailable", "kvstore_error",
)  # fmt: skip


class _Index:
    """Keys grouped by base hash, for prefix matching."""

    def __init__(self) -> None:
        self.by_base: dict[bytes, set[tuple[int, ...]]] = {}

    def add(self, key: Key) -> None:
        self.by_base.setdefault(key[0], set()).add(key[1])

    def discard(self, key: Key) -> None:
        group = self.by_base.get(key[0])
        if group is not None:
            group.discard(key[1])
            if not group:
                del self.by_base[key[0]]

    def matches(self, tokens: Sequence[int], hashes: list[bytes], page_size: int, limit: int) -> list[Key]:
        """Keys that are prefixes of ``tokens`` (positions ≤ ``limit``), longest first."""
        out = []
        for k in range(len(hashes) - 1, -1, -1):
            for tail in self.by_base.get(hashes[k], ()):
                p = k * page_size + len(tail)
                if p <= limit and tuple(tokens[k * page_size : p]) == tail:
                    out.append((p, (hashes[k], tail)))
        out.sort(key=lambda pk: -pk[0])
        return [key for _, key in out]


class PrefixCache:
    """Resume points by (base hash, tail tokens); LRU order among them. Misses are explained: a bounded
    memory of evicted keys, and an index of every entry under the salt-free root."""

    def __init__(self, page_size: int, capacity: int, remember_evicted: int = 4096) -> None:
        if capacity < 0:
            raise ValueError(f"prefix cache capacity must be >= 0, got {capacity}")
        self.page_size, self.capacity, self.remember_evicted = page_size, capacity, remember_evicted
        self._lru: OrderedDict[Key, ResumePoint] = OrderedDict()
        self._index = _Index()
        self._plain = _Index()  # the same entries, hashed from the salt-free root
        self._plain_keys: dict[Key, Key] = {}  # salted entry key -> its salt-free key
        self._plain_count: dict[Key, int] = {}
        self._evicted: OrderedDict[Key, None] = OrderedDict()
        self._evicted_index = _Index()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._lru)

    def _hashes(self, tokens: Sequence[int], root: bytes, limit: int) -> list[bytes]:
        return page_hashes(tokens, root, self.page_size, limit // self.page_size)

    def lookup(self, tokens: Sequence[int], root: bytes, limit: int) -> ResumePoint | None:
        """The longest visible resume point whose tokens are a prefix of ``tokens`` and whose position is
        at most ``limit``; it becomes the most recently used."""
        if not self._lru or limit <= 0:
            return None
        hashes = self._hashes(tokens, root, limit)
        for key in self._index.matches(tokens, hashes, self.page_size, limit):
            rp = self._lru[key]
            if rp.visible:
                self._lru.move_to_end(key)
                return rp
        return None

    def peek(self, tokens: Sequence[int], root: bytes, limit: int) -> int:
        """The position of what ``lookup`` would return (0: nothing), leaving the LRU order as it is."""
        if not self._lru or limit <= 0:
            return 0
        hashes = self._hashes(tokens, root, limit)
        for key in self._index.matches(tokens, hashes, self.page_size, limit):
            if self._lru[key].visible:
                return self._lru[key].position
        return 0

    def miss_reason(self, tokens: Sequence[int], root: bytes, plain_root: bytes, limit: int) -> str:
        """Why nothing matched: an entry still waits for its snapshot, one was evicted, one exists for another
        cache salt, or there never was one."""
        ps = self.page_size
        hashes = self._hashes(tokens, root, limit)
        if self._index.matches(tokens, hashes, ps, limit):
            return "not_yet_stored"  # matching entries exist, none visible yet
        if self._evicted_index.matches(tokens, hashes, ps, limit):
            return "evicted"
        plain = hashes if plain_root == root else self._hashes(tokens, plain_root, limit)
        if self._plain.matches(tokens, plain, ps, limit):  # a salted tenant's entry
            return "salt_mismatch"
        if plain_root != root and self._index.matches(tokens, plain, ps, limit):  # an unsalted entry
            return "salt_mismatch"
        return "no_resume_point"

    def insert(
        self, tokens: Sequence[int], root: bytes, pages: list[int], plain_root: bytes | None = None
    ) -> ResumePoint | None:
        """A new resume point at ``len(tokens)`` holding ``pages`` (its full pages); ``None`` if one exists
        already (it becomes the most recently used) — the caller then keeps its page references.
        ``plain_root`` (the salt-free root) lets misses of other tenants be told apart."""
        ps = self.page_size
        full = len(tokens) // ps
        if len(pages) != full:
            raise ValueError(f"a resume point at {len(tokens)} holds {full} full pages, got {len(pages)}")
        base = page_hashes(tokens, root, ps, full)[-1]
        tail = tuple(tokens[full * ps :])
        key = (base, tail)
        if key in self._lru:
            self._lru.move_to_end(key)
            return None
        rp = ResumePoint(f"rp-{next(self._ids)}", len(tokens), base, tail, list(pages))
        self._lru[key] = rp
        self._index.add(key)
        if plain_root is not None and plain_root != root:
            plain_key = (page_hashes(tokens, plain_root, ps, full)[-1], tail)
            self._plain.add(plain_key)
            self._plain_keys[key] = plain_key
            self._plain_count[plain_key] = self._plain_count.get(plain_key, 0) + 1
        if key in self._evicted:
            del self._evicted[key]
            self._evicted_index.discard(key)
        return rp

    def get(self, tokens: Sequence[int], root: bytes) -> ResumePoint | None:
        """The resume point at exactly ``len(tokens)`` for these tokens (its snapshot ordered or not), or None."""
        full = len(tokens) // self.page_size
        return self._lru.get(
            (page_hashes(tokens, root, self.page_size, full)[-1], tuple(tokens[full * self.page_size :]))
        )

    def remove(self, rp: ResumePoint) -> None:
        if self._lru.get((rp.base, rp.tail)) is rp:
            self.remove_key((rp.base, rp.tail))

    def remove_key(self, key: Key) -> None:
        if self._lru.pop(key, None) is not None:
            self._index.discard(key)

    def pop_lru(self) -> ResumePoint | None:
        """Remove and return the least recently used resume point (the caller frees its pages and drops its
        snapshot)."""
        if not self._lru:
            return None
        key, rp = self._lru.popitem(last=False)
        self._index.discard(key)
        plain_key = self._plain_keys.pop(key, None)
        if plain_key is not None:
            self._plain_count[plain_key] -= 1
            if not self._plain_count[plain_key]:
                del self._plain_count[plain_key]
                self._plain.discard(plain_key)
        self._evicted[key] = None
        self._evicted_index.add(key)
        while len(self._evicted) > self.remember_evicted:
            old, _ = self._evicted.popitem(last=False)
            self._evicted_index.discard(old)
        return rp

    def entries(self) -> list[ResumePoint]:
        return list(self._lru.values())

    def over_capacity(self) -> bool:
        return len(self._lru) > self.capacity
