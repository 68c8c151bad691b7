"""The two tiers of the kvstore, without transport: host memory in front of an optional disk directory.

::

    store = Store(host_bytes=4 << 30, disk=DiskDir("/var/lib/deepinfer/kv"), disk_bytes=64 << 30)
    store.index_disk()  # at start: what survived the last run
    store.put(Blob.build(BlobKey("fp", b"\\x01" * 32), payload, "deepinfer-resume-v1", {"position": "512"}))
    blob, tier = store.get(BlobKey("fp", b"\\x01" * 32))

Contracts:

- **Put is write-through**: the blob goes to disk (when there is a disk tier and it fits) and into host
  memory (when it fits). A blob that fits in neither is refused (``BlobRefused("capacity")``). A disk
  write that fails leaves the blob in host memory only (logged).
- **Get** serves the host copy if there is one, else reads the file; every payload is checked against its
  CRC-32 before it is returned. A copy that fails is dropped and counted (``removed``, reason ``corrupt``)
  and never served: a bad host copy falls back to the disk copy, a bad file raises :class:`CorruptBlob`.
  A verified disk read is promoted into host memory.
- **Capacity**: each tier evicts its least recently used entries (last Get or Put) to make room. Evicting
  the host copy of a blob that is also on disk only drops the memory copy.
- **Retention**: a blob not read or written for ``retention_s`` (by ``clock``) is expired — by
  :meth:`sweep`, and lazily by :meth:`lookup` and :meth:`get`. Lookup does not count as an access.
- Thread-safe: file payloads are read and written outside the lock (callers run ``put``/``get`` in worker
  threads); index changes, renames and unlinks happen under it. Listeners receive every
  :class:`StoreEvent` synchronously, under the lock, so they must be quick and must not call the store.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.kvstore.blob import Blob, BlobKey, BlobNotFound, BlobRefused, CorruptBlob, Tier
from deepinfer.telemetry import get_logger
from services.kvstore.disk import DiskDir, Header

__all__ = ["Store", "StoreEvent", "StoreListener"]

log = get_logger(__name__)
Clock = Callable[[], float]


@dataclass(frozen=True)
class StoreEvent:
    """A blob appeared in or left one tier.

    ``type`` is ``stored`` (reason ``put``, ``promoted`` or ``indexed``) or ``removed`` (reason ``evicted``,
    ``expired``, ``corrupt``, ``removed``, ``missing``); ``key`` is ``None`` only for a corrupt file whose
    header could not be read.
    """

    type: str
    tier: Tier
    key: BlobKey | None
    reason: str
    size: int = 0
    meta: dict[str, str] = field(default_factory=dict)


StoreListener = Callable[[StoreEvent], None]


@dataclass(eq=False)
class _Entry:
    key: BlobKey
    layout: str
    meta: dict[str, str]
    size: int
    crc32: int
    stored_at: float
    last_access: float
    data: bytes | None = None  # the host copy
    disk_bytes: int = 0  # size of the file; 0 = not on disk
    persisted_access: float = 0.0  # the last access written to the file's mtime

    def blob(self, data: bytes) -> Blob:
        return Blob(self.key, data, self.layout, dict(self.meta), self.crc32)


class Store:
    """Host memory (LRU, ``host_bytes``) in front of an optional disk directory (LRU, ``disk_bytes``)."""

    def __init__(
        self,
        host_bytes: int,
        disk: DiskDir | None = None,
        disk_bytes: int = 0,
        retention_s: float = 72 * 3600.0,
        clock: Clock = time.time,
        listeners: Iterable[StoreListener] = (),
    ) -> None:
        if host_bytes < 0 or disk_bytes < 0 or retention_s <= 0:
            raise ValueError(f"bad store limits: host {host_bytes}, disk {disk_bytes}, retention {retention_s}")
        self.host_capacity, self.disk_capacity = host_bytes, disk_bytes if disk is not None else 0
        self.disk, self.retention_s, self.clock = disk, retention_s, clock
        self.listeners = list(listeners)
        self.touch_interval_s = min(60.0, retention_s / 10)  # how often an access is persisted to the file
        self._lock = threading.Lock()
        self._entries: dict[BlobKey, _Entry] = {}
        self._host: OrderedDict[BlobKey, _Entry] = OrderedDict()  # LRU first
        self._disk: OrderedDict[BlobKey, _Entry] = OrderedDict()
        self.host_used = self.disk_used = 0

    # -- sizes (read by the metrics at scrape time) ------------------------------------------------------

    @property
    def host_entries(self) -> int:
        return len(self._host)

    @property
    def disk_entries(self) -> int:
        return len(self._disk)

    def __len__(self) -> int:
        return len(self._entries)

    # -- operations ---------------------------------------------------------------------------------------

    def index_disk(self) -> int:
        """Index the data directory (headers only); returns the number of blobs found. Call once, at start."""
        if self.disk is None:
            return 0
        found: list[tuple[_Entry, int]] = []
        for result in self.disk.scan():
            if result.header is None:
                log.warning("kvstore_corrupt_file", path=str(result.path), error=result.error)
                result.path.unlink(missing_ok=True)
                self._emit("removed", Tier.DISK, None, "corrupt")
                continue
            h = result.header
            entry = _Entry(h.key, h.layout, h.meta, h.size, h.crc32, h.stored_at, max(h.last_access, result.mtime))
            entry.persisted_access = entry.last_access
            found.append((entry, result.file_bytes))
        now = self.clock()
        with self._lock:
            for entry, file_bytes in sorted(found, key=lambda e: e[0].last_access):
                entry.disk_bytes = file_bytes
                self._entries[entry.key] = self._disk[entry.key] = entry
                self.disk_used += file_bytes
                if self._expired(entry, now):
                    self._drop(entry, "expired")
                else:
                    self._emit("stored", Tier.DISK, entry, "indexed")
            self._evict_disk(0)
            count = len(self._disk)
        log.info("kvstore_indexed", root=str(self.disk.root), blobs=count, bytes=self.disk_used)
        return count

    def put(self, blob: Blob) -> list[Tier]:
        """Store ``blob`` (its checksum already verified); returns the tiers that now hold it."""
        size, now = len(blob.data), self.clock()
        header = Header(blob.key, size, blob.crc32, blob.layout, dict(blob.meta), now, now)
        to_host = size <= self.host_capacity
        to_disk = self.disk is not None and size + len(header.encode()) <= self.disk_capacity
        if not to_host and not to_disk:
            raise BlobRefused("capacity", f"total_bytes: {size} bytes fit in no tier of this store")
        tmp: Path | None = None
        if to_disk:
            assert self.disk is not None
            try:
                tmp = self.disk.write_temp(header, blob.data)
            except OSError as exc:
                log.error("kvstore_disk_write_failed", key=str(blob.key), error=repr(exc))
        entry = _Entry(blob.key, blob.layout, dict(blob.meta), size, blob.crc32, now, now, persisted_access=now)
        with self._lock:
            old = self._entries.pop(blob.key, None)
            if old is not None:
                self._forget(old, keep_file=tmp is not None)
            self._entries[blob.key] = entry
            if tmp is not None and self._commit(tmp, entry):
                self._emit("stored", Tier.DISK, entry, "put")
            if to_host:
                self._evict_host(size)
                self._add_host(entry, blob.data)
                self._emit("stored", Tier.HOST, entry, "put")
            if entry.data is None and not entry.disk_bytes:  # the disk write failed and it is too big for host
                del self._entries[blob.key]
                raise BlobRefused("io_error", "the blob could not be written to disk")
            return self._tiers(entry)

    def get(self, key: BlobKey) -> tuple[Blob, Tier]:
        """The blob and the tier it came from; ``BlobNotFound``, or ``CorruptBlob`` if its copies failed."""
        with self._lock:
            entry = self._live(key)
            data = entry.data
            self._touch(entry)
        if data is not None:
            if zlib.crc32(data) == entry.crc32:
                return entry.blob(data), Tier.HOST
            with self._lock:
                if self._entries.get(key) is entry and entry.data is data:
                    log.error("kvstore_corrupt_memory", key=str(key))
                    self._drop_host(entry, "corrupt")
                    if not entry.disk_bytes:
                        del self._entries[key]
            if not entry.disk_bytes:
                raise CorruptBlob(f"blob {key}: host copy failed its checksum")
        if not entry.disk_bytes or self.disk is None:
            raise BlobNotFound(f"blob {key} is not stored")
        try:
            header, data = self.disk.read(key)
        except FileNotFoundError:
            with self._lock:
                if self._entries.get(key) is entry:
                    self._drop(entry, "missing")
            raise BlobNotFound(f"blob {key} is not stored (its file is gone)") from None
        except CorruptBlob as exc:
            with self._lock:
                if self._entries.get(key) is entry:  # not replaced by a Put in the meantime
                    log.error("kvstore_corrupt_file", key=str(key), error=str(exc))
                    self._drop(entry, "corrupt")
            raise CorruptBlob(f"blob {key}: {exc}") from None
        with self._lock:
            if self._entries.get(key) is entry and entry.data is None and entry.size <= self.host_capacity:
                self._evict_host(entry.size)
                self._add_host(entry, data)
                self._emit("stored", Tier.HOST, entry, "promoted")
        return Blob(key, data, header.layout, dict(header.meta), header.crc32), Tier.DISK

    def lookup(self, keys: Iterable[BlobKey]) -> list[Tier | None]:
        """The fastest tier holding each key (``None``: absent or expired). Not an access."""
        out: list[Tier | None] = []
        with self._lock:
            for key in keys:
                try:
                    out.append(self._tiers(self._live(key))[0])
                except BlobNotFound:
                    out.append(None)
        return out

    def remove(self, keys: Iterable[BlobKey]) -> int:
        """Remove blobs from every tier; returns how many were stored."""
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._drop(entry, "removed")
                    removed += 1
        return removed

    def sweep(self) -> int:
        """Expire every blob not accessed within the retention time; returns how many."""
        now, expired = self.clock(), 0
        with self._lock:
            for lru in (self._host, self._disk):  # least recently used first: stop at the first live one
                while lru:
                    entry = next(iter(lru.values()))
                    if not self._expired(entry, now):
                        break
                    self._drop(entry, "expired")
                    expired += 1
        return expired

    # -- internals (called with the lock held) ------------------------------------------------------------

    def _expired(self, entry: _Entry, now: float) -> bool:
        return now - entry.last_access > self.retention_s

    def _live(self, key: BlobKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise BlobNotFound(f"blob {key} is not stored")
        if self._expired(entry, self.clock()):
            self._drop(entry, "expired")
            raise BlobNotFound(f"blob {key} expired")
        return entry

    @staticmethod
    def _tiers(entry: _Entry) -> list[Tier]:
        return [t for t, held in ((Tier.HOST, entry.data is not None), (Tier.DISK, entry.disk_bytes > 0)) if held]

    def _touch(self, entry: _Entry) -> None:
        now = entry.last_access = self.clock()
        if entry.data is not None:
            self._host.move_to_end(entry.key)
        if entry.disk_bytes:
            self._disk.move_to_end(entry.key)
            if self.disk is not None and now - entry.persisted_access >= self.touch_interval_s:
                self.disk.touch(entry.key, now)
                entry.persisted_access = now

    def _add_host(self, entry: _Entry, data: bytes) -> None:
        entry.data = data
        self._host[entry.key] = entry
        self.host_used += entry.size

    def _commit(self, tmp: Path, entry: _Entry) -> bool:
        assert self.disk is not None
        try:
            entry.disk_bytes = self.disk.commit(tmp, entry.key)
        except OSError as exc:
            log.error("kvstore_disk_write_failed", key=str(entry.key), error=repr(exc))
            tmp.unlink(missing_ok=True)
            self.disk.remove(entry.key)  # a replaced blob's old file must not outlive its index entry
            return False
        self._evict_disk(entry.disk_bytes)
        self._disk[entry.key] = entry
        self.disk_used += entry.disk_bytes
        return True

    def _evict_host(self, room: int) -> None:
        while self._host and self.host_used + room > self.host_capacity:
            entry = next(iter(self._host.values()))
            self._drop_host(entry, "evicted")
            if not entry.disk_bytes:
                del self._entries[entry.key]

    def _evict_disk(self, room: int) -> None:
        while self._disk and self.disk_used + room > self.disk_capacity:
            entry = next(iter(self._disk.values()))
            self._drop_disk(entry, "evicted")
            if entry.data is None:
                del self._entries[entry.key]

    def _drop_host(self, entry: _Entry, reason: str) -> None:
        if entry.data is not None:
            del self._host[entry.key]
            self.host_used -= entry.size
            entry.data = None
            self._emit("removed", Tier.HOST, entry, reason)

    def _drop_disk(self, entry: _Entry, reason: str, unlink: bool = True) -> None:
        if entry.disk_bytes:
            del self._disk[entry.key]
            self.disk_used -= entry.disk_bytes
            entry.disk_bytes = 0
            if unlink and self.disk is not None:
                self.disk.remove(entry.key)
            self._emit("removed", Tier.DISK, entry, reason)

    def _drop(self, entry: _Entry, reason: str) -> None:
        """Remove a blob from both tiers and the index."""
        self._drop_host(entry, reason)
        self._drop_disk(entry, reason)
        self._entries.pop(entry.key, None)

    def _forget(self, old: _Entry, keep_file: bool) -> None:
        """Drop a replaced entry's accounting without events (the new one is announced instead)."""
        if old.data is not None:
            del self._host[old.key]
            self.host_used -= old.size
        if old.disk_bytes:
            del self._disk[old.key]
            self.disk_used -= old.disk_bytes
            if not keep_file and self.disk is not None:  # the new blob is not written: do not leave the old file
                self.disk.remove(old.key)
        old.data, old.disk_bytes = None, 0

    def _emit(self, type_: str, tier: Tier, entry: _Entry | None, reason: str) -> None:
        key = entry.key if entry is not None else None
        event = StoreEvent(type_, tier, key, reason, entry.size if entry else 0, dict(entry.meta) if entry else {})
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as exc:  # a listener bug must not break the store
                log.error("kvstore_listener_failed", error=repr(exc))
