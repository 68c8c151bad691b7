"""The scheduler's prefix-cache half (a mixin of :class:`~deepinfer.engine.scheduler.Scheduler`): lookup at
admission, resume points at resume positions, chunk cuts, LRU eviction before preemption, accounting.

See ``engine/prefix_cache.py`` for the index and docs/kv_cache.md for the design.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from typing import TYPE_CHECKING

from deepinfer.engine.interfaces import FetchOrder, FetchResult, OffloadOrder
from deepinfer.engine.prefix_cache import ResumePoint, root_hash
from deepinfer.engine.request import Request
from deepinfer.kvstore.keys import anchor, binding_meta, key_tag, resume_key, tail_digest

_fetch_ids = itertools.count()


def blob_binding(rp: ResumePoint, fingerprint: str) -> tuple[bytes, dict[str, str]]:
    """The kvstore key of a resume point and the meta that binds its blob to it (chain and tail digests, position:
    no token ids); see ``kvstore/keys.py``."""
    tail = tail_digest(rp.base, rp.tail)
    return resume_key(fingerprint, rp.base, tail, rp.position), binding_meta(rp.base, tail, rp.position)


def event_fields(rp: ResumePoint, fingerprint: str) -> dict[str, str | int]:
    """What a KV event says of a resume point: its one-way tag and anchor, and its position."""
    key, _ = blob_binding(rp, fingerprint)
    return {"tag": key_tag(fingerprint, key).hex(), "anchor": anchor(rp.base).hex(), "position": rp.position}


if TYPE_CHECKING:
    from deepinfer.engine.pages import PagePool
    from deepinfer.engine.prefix_cache import PrefixCache
    from deepinfer.engine.remote_index import RemoteEntry, RemoteIndex
    from deepinfer.engine.scheduler_config import SchedulerConfig


class PrefixCaching:
    config: SchedulerConfig
    pages: PagePool
    prefix: PrefixCache | None
    _pending: list[tuple[str, ResumePoint]]
    _dropped: list[str]
    prefix_queries: int
    prefix_hits: int
    prefix_misses: Counter[str]
    remote: RemoteIndex | None  # resume points held by the kvstore (by tag and anchor: hashes only)
    _offloads: list[OffloadOrder]
    _fetches: list[FetchOrder]
    fetching: dict[str, tuple[Request, RemoteEntry]]  # fetch id -> the request waiting for it, and the entry
    waiting: deque[Request]
    kv_listeners: list

    def reset_prefix_cache(self) -> None:
        """Evict every resume point (the worker drops their snapshots with the next plan)."""
        while self._evict_one():
            pass

    @property
    def num_available_pages(self) -> int:
        """Free pages plus pages only resume points hold (evicted on demand): the capacity left."""
        if self.prefix is None:
            return self.pages.num_free
        held = Counter(p for rp in self.prefix.entries() for p in rp.pages)
        return self.pages.num_free + sum(1 for p, n in held.items() if self.pages.refcount(p) == n)

    @property
    def num_total_pages(self) -> int:
        return self.pages.num_total

    @property
    def num_resume_points(self) -> int:
        """Resume points held (the device tier)."""
        return len(self.prefix) if self.prefix is not None else 0

    @property
    def num_cached_pages(self) -> int:
        """Distinct pages that only resume points keep alive or share."""
        return len({p for rp in self.prefix.entries() for p in rp.pages}) if self.prefix is not None else 0

    def _root(self, req: Request) -> bytes:
        return root_hash(self.config.fingerprint, req.cache_salt)

    def _lookup(self, req: Request) -> bool:
        """Start ``req`` from its longest resume point (it keeps at least one token to compute). Returns
        ``True`` when that point is in the kvstore: a fetch has started and the request waits for it."""
        if self.prefix is None or req.num_computed or req.wants_prompt_logprobs:
            return False
        if req.fetched is not None:  # a fetch completed: resume from it, in pages of its own
            fid, position = req.fetched
            position = self._replay_start(position)
            req.num_computed, req.resume_from, req.num_cached_tokens = position, fid, position
            req.cache_tier = "kvstore"
            self.prefix_queries += req.num_tokens
            self.prefix_hits += position
            return False
        self.prefix_queries += req.num_tokens
        root, limit = self._root(req), req.num_tokens - 1
        rp = self.prefix.lookup(req.cache_token_ids, root, limit)
        if self.remote is not None and not req.fetch_failed:
            far = self.remote.lookup(req.cache_token_ids, root, limit)
            if far is not None and (rp is None or far.position > rp.position):
                self.prefix_queries -= req.num_tokens  # counted when the fetched state is used
                fid = f"fetch-{next(_fetch_ids)}"
                self._fetches.append(FetchOrder(fid, far.key))
                req.fetch_id = fid
                self.fetching[fid] = (req, far)
                return True
        if rp is None:
            plain = root_hash(self.config.fingerprint, None)
            req.cache_miss_reason = self.prefix.miss_reason(req.cache_token_ids, root, plain, limit)
            self.prefix_misses[req.cache_miss_reason] += 1
            return
        self.prefix_hits += rp.position
        req.cache_miss_reason = None
        self.pages.incref(rp.pages)
        start = self._replay_start(rp.position)
        req.pages, req.num_computed, req.resume_from = list(rp.pages), start, rp.snapshot_id
        req.num_cached_tokens, req.cache_tier = start, "device"
        return False

    def _replay_start(self, position: int) -> int:
        """Where a resumed request's first chunk starts: the resume position, or in compact mode that many
        tokens earlier (the bounded replay)."""
        return max(0, position - self.config.compact_replay) if self.config.compact_replay else position

    def _fetch_done(self, f: FetchResult) -> None:
        """A kvstore fetch completed: the request waits again, at the front, with the state or without."""
        req, entry = self.fetching.pop(f.fetch_id, (None, None))
        if req is None or req.finished:  # aborted meanwhile: the worker drops what it fetched
            if f.ok:
                self._dropped.append(f.fetch_id)
            return
        req.fetch_id = None
        if f.ok:
            req.fetched = (f.fetch_id, entry.position)
        else:
            req.fetch_failed = True
            req.cache_miss_reason = f"kvstore_{f.reason or 'error'}"
            self.prefix_misses[req.cache_miss_reason] += 1
            self.remote.remove(entry.tag)
        self.waiting.appendleft(req)

    def add_remote(self, anchor_: bytes, position: int, tag: bytes) -> None:
        """Index a resume point the kvstore holds (offloaded here, or announced by a KV event)."""
        if self.remote is not None:
            self.remote.add(anchor_, position, tag)

    def remove_remote(self, tag: bytes) -> None:
        """The kvstore holds this resume point no more."""
        if self.remote is not None:
            self.remote.remove(tag)

    def _unlookup(self, req: Request) -> None:
        """Undo :meth:`_lookup` (the request stays waiting; it is looked up again when admitted)."""
        if self.prefix is None or req.wants_prompt_logprobs:
            return
        if req.resume_from is not None:
            self.pages.free(req.pages)
            self.prefix_hits -= req.num_cached_tokens
            req.pages, req.num_computed, req.resume_from, req.num_cached_tokens = [], 0, None, 0
            req.cache_tier = None
        elif req.cache_miss_reason is not None:
            self.prefix_misses[req.cache_miss_reason] -= 1
            req.cache_miss_reason = None
        self.prefix_queries -= req.num_tokens

    def _resume_point(self, req: Request, position: int) -> None:
        if self.prefix is None:
            return
        full = req.pages[: position // self.config.page_size]
        plain = root_hash(self.config.fingerprint, None)
        rp = self.prefix.insert(req.cache_token_ids[:position], self._root(req), full, plain)
        if rp is not None:
            self.pages.incref(full)
            self._pending.append((req.request_id, rp))
            while self.prefix.over_capacity():
                self._evict_one()

    def _is_resume_position(self, req: Request, p: int) -> bool:
        every = self.config.resume_interval
        return p == req.num_prompt_tokens or bool(every and p % every == 0) or p in req.resume_hints

    def _cut(self, req: Request, n: int) -> int:
        """End a prefill chunk at the next resume position it would cross (so a snapshot can be taken there)."""
        if self.prefix is None or n <= 1:
            return n
        start, every = req.num_computed, self.config.resume_interval
        stops = [p for p in req.resume_hints if start < p < start + n]
        if every:
            stops.append((start // every + 1) * every)
        nearest = min((p for p in stops if start < p < min(start + n, req.num_prompt_tokens)), default=None)
        return n if nearest is None else nearest - start

    def _evict_one(self) -> bool:
        rp = self.prefix.pop_lru() if self.prefix is not None else None
        if rp is None:
            return False
        if rp.visible:
            self._kv_event("removed", rp, "offloaded" if self.remote is not None else "evicted")
        if rp.visible and self.remote is not None:  # move it to the kvstore (the worker reads the pages first)
            fp = self.config.fingerprint
            key, meta = blob_binding(rp, fp)
            self._offloads.append(OffloadOrder(rp.snapshot_id, key, list(rp.pages), meta))
            self.add_remote(anchor(rp.base), rp.position, key_tag(fp, key))
            self.pages.free(rp.pages)
        elif rp.visible:
            self.pages.free(rp.pages)
            self._dropped.append(rp.snapshot_id)
        else:
            self.pages.free(rp.pages)
            self._pending = [(rid, p) for rid, p in self._pending if p is not rp]
        return True

    def _kv_event(self, kind: str, rp: ResumePoint, reason: str) -> None:
        """Tell the listeners (the replica's NATS publisher) that a device resume point came or went."""
        for listener in self.kv_listeners:
            listener(kind, rp, reason)

    def _reserve(self, need: int) -> bool:
        """Whether ``need`` pages can be allocated, evicting unused resume points (LRU) if that helps."""
        while not self.pages.can_allocate(need):
            if not self._evict_one():
                return False
        return True
