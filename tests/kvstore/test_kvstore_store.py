"""Store and DiskDir without transport: tiers, LRU capacity, retention on a fake clock, integrity, restart."""

from __future__ import annotations

import os
import struct
import threading

import pytest

from deepinfer.kvstore.blob import Blob, BlobKey, BlobNotFound, BlobRefused, CorruptBlob, Tier
from services.kvstore.disk import DiskDir, Header, file_name
from services.kvstore.store import Store, StoreEvent

FP = "fp"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def blob(i: int, size: int = 100, fp: str = FP, rp: bool = True) -> Blob:
    return Blob.build(BlobKey(fp, bytes([i]) * 32, rp), bytes([i % 251]) * size, "v1", {"i": str(i)})


def make(tmp_path, host: int = 10_000, disk: int | None = 100_000, retention: float = 100.0, clock=None):
    events: list[StoreEvent] = []
    d = DiskDir(tmp_path / "data", fsync=False) if disk is not None else None
    store = Store(host, d, disk or 0, retention, clock or Clock(), listeners=[events.append])
    return store, events


def test_put_get_lookup_remove_and_events(tmp_path):
    store, events = make(tmp_path)
    b = blob(1)
    assert store.put(b) == [Tier.HOST, Tier.DISK]
    assert store.get(b.key) == (b, Tier.HOST)
    assert store.lookup([b.key, blob(2).key, BlobKey("other", b.key.hash)]) == [Tier.HOST, None, None]
    assert [(e.type, e.tier, e.reason) for e in events] == [("stored", Tier.DISK, "put"), ("stored", Tier.HOST, "put")]
    assert events[0].meta == {"i": "1"} and events[0].key == b.key
    assert store.remove([b.key, blob(3).key]) == 1
    assert [(e.type, e.reason) for e in events[2:]] == [("removed", "removed")] * 2
    with pytest.raises(BlobNotFound):
        store.get(b.key)
    assert store.host_used == store.disk_used == len(store) == 0
    assert os.listdir(tmp_path / "data") == []


def test_replacing_a_blob_keeps_the_accounting_exact(tmp_path):
    store, _ = make(tmp_path)
    store.put(blob(1, 100))
    store.put(Blob.build(blob(1).key, b"y" * 300, "v2"))
    assert store.host_used == 300 and store.host_entries == store.disk_entries == 1
    got, _ = store.get(blob(1).key)
    assert got.data == b"y" * 300 and got.layout == "v2"
    assert store.disk_used == os.path.getsize(tmp_path / "data" / file_name(blob(1).key))


def test_host_lru_keeps_disk_copies_and_promotes_on_read(tmp_path):
    store, events = make(tmp_path, host=250)
    for i in range(3):
        store.put(blob(i))
    assert store.lookup([blob(i).key for i in range(3)]) == [Tier.DISK, Tier.HOST, Tier.HOST]
    got, tier = store.get(blob(0).key)
    assert tier == Tier.DISK and got == blob(0)
    assert store.lookup([blob(i).key for i in range(3)]) == [Tier.HOST, Tier.DISK, Tier.HOST]
    assert ("stored", Tier.HOST, "promoted") in [(e.type, e.tier, e.reason) for e in events]
    assert store.host_used == 200


def test_without_a_disk_tier_host_eviction_drops_the_blob(tmp_path):
    store, events = make(tmp_path, host=250, disk=None)
    for i in range(3):
        store.put(blob(i))
    assert store.lookup([blob(i).key for i in range(3)]) == [None, Tier.HOST, Tier.HOST]
    assert [(e.type, e.reason) for e in events if e.type == "removed"] == [("removed", "evicted")]
    with pytest.raises(BlobRefused) as err:
        store.put(blob(9, 300))
    assert err.value.reason == "capacity"


def test_disk_lru_eviction_and_too_big_for_host(tmp_path):
    b = blob(0)
    file_bytes = len(Header(b.key, 100, b.crc32, b.layout, b.meta, Clock()(), Clock()()).encode()) + 100
    store, _ = make(tmp_path, host=150, disk=3 * file_bytes + 20)  # room for 3 files, not 4
    for i in range(3):
        store.put(blob(i))
    store.get(blob(0).key)  # 0 becomes the most recently used: 1 is evicted next
    store.put(blob(3))
    assert store.lookup([blob(i).key for i in range(4)]) == [Tier.DISK, None, Tier.DISK, Tier.HOST]
    big = blob(5, 200)  # larger than the host tier: disk only
    assert store.put(big) == [Tier.DISK]
    assert store.get(big.key) == (big, Tier.DISK)
    assert store.disk_used <= store.disk_capacity


def test_retention_lazy_and_sweep_with_an_injected_clock(tmp_path):
    clock = Clock()
    store, events = make(tmp_path, retention=10, clock=clock)
    for i in range(3):
        store.put(blob(i))
    clock.now += 6
    store.get(blob(2).key)  # an access renews the retention
    clock.now += 6
    assert store.lookup([blob(0).key]) == [None]  # lazily expired
    assert store.sweep() == 1  # blob 1
    assert store.lookup([blob(2).key]) == [Tier.HOST]
    removed = {(e.tier, e.reason) for e in events if e.type == "removed"}
    assert removed == {(Tier.HOST, "expired"), (Tier.DISK, "expired")}
    clock.now += 11
    with pytest.raises(BlobNotFound, match="expired"):
        store.get(blob(2).key)
    assert len(store) == 0 and os.listdir(tmp_path / "data") == []


def test_restart_reindexes_headers_and_keeps_last_access(tmp_path):
    clock = Clock()
    store, _ = make(tmp_path, retention=10, clock=clock)
    store.put(blob(1))
    store.put(blob(2, fp="other-model", rp=False))
    clock.now += 8
    store.get(blob(1).key)  # persisted as the file's mtime
    (tmp_path / "data" / ".tmp-leftover").write_bytes(b"half a write")
    (tmp_path / "data" / "unrelated.txt").write_text("not ours")
    clock.now += 5
    again, events = make(tmp_path, retention=10, clock=clock)
    assert again.index_disk() == 1  # blob 2 is older than the retention: expired at start
    assert again.lookup([blob(1).key]) == [Tier.DISK]
    assert again.get(blob(1).key) == (blob(1), Tier.DISK)
    assert ("stored", "indexed") in [(e.type, e.reason) for e in events]
    assert sorted(os.listdir(tmp_path / "data")) == sorted([file_name(blob(1).key), "unrelated.txt"])


def test_corrupt_files_are_removed_at_index_time_and_at_read_time(tmp_path):
    store, _ = make(tmp_path, host=0)
    for i in range(4):
        store.put(blob(i))
    root = tmp_path / "data"
    p = {i: root / file_name(blob(i).key) for i in range(4)}
    p[0].write_bytes(p[0].read_bytes()[:-1])  # truncated
    raw = bytearray(p[1].read_bytes())
    raw[20] ^= 1  # inside the JSON header: its checksum fails
    p[1].write_bytes(bytes(raw))
    os.rename(p[2], root / file_name(blob(7).key))  # a file under another key's name
    again, events = make(tmp_path, host=0)
    assert again.index_disk() == 1
    assert [e.reason for e in events if e.type == "removed"] == ["corrupt"] * 3
    raw = bytearray(p[3].read_bytes())
    raw[-1] ^= 0xFF
    p[3].write_bytes(bytes(raw))
    with pytest.raises(CorruptBlob, match="payload checksum"):
        again.get(blob(3).key)
    assert os.listdir(root) == [] and len(again) == 0


def test_a_corrupt_host_copy_is_never_served_and_falls_back_to_disk(tmp_path):
    store, events = make(tmp_path)
    b = blob(1)
    store.put(b)
    entry = store._entries[b.key]
    store._host[b.key].data = entry.data = b"\x00" + entry.data[1:]  # a bit flip in memory
    assert store.get(b.key) == (b, Tier.DISK)
    assert ("removed", Tier.HOST, "corrupt") in [(e.type, e.tier, e.reason) for e in events]


def test_header_format_round_trip_and_rejects(tmp_path):
    h = Header(BlobKey("fp", b"\x01\x02", False), 3, 7, "v1", {"a": "b"}, 1.5, 2.5)
    encoded = h.encode()
    magic, version, length, _ = struct.unpack("<8sHII", encoded[:18])
    assert magic == b"DIKVBLOB" and version == 1 and length == len(encoded) - 18
    assert Header.decode(encoded[18:]) == h
    for bad in [b"[]", b"{}", b'{"fingerprint": 1}', b"not json"]:
        with pytest.raises(CorruptBlob):
            Header.decode(bad)
    assert file_name(h.key).endswith("-0102-p.kvb") and "/" not in file_name(BlobKey("../../etc", b"\xff"))


def test_concurrent_puts_and_gets_from_threads(tmp_path):
    store, _ = make(tmp_path, host=2_000, disk=20_000)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(40):
                b = blob((offset + i) % 50)
                store.put(b)
                try:
                    got, _ = store.get(b.key)
                    assert got.data == b.data
                except BlobNotFound:
                    pass  # evicted by another thread in between
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.host_used == sum(e.size for e in store._host.values()) <= 2_000
    assert store.disk_used == sum(os.path.getsize(p) for p in (tmp_path / "data").iterdir()) <= 20_000


def test_a_failing_disk_keeps_the_host_copy_and_never_leaves_stale_files(tmp_path, monkeypatch):
    store, _ = make(tmp_path, host=150)
    store.put(blob(1))  # on disk and in memory

    def disk_full(self, header, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskDir, "write_temp", disk_full)
    replacement = Blob.build(blob(1).key, b"new" * 10)
    assert store.put(replacement) == [Tier.HOST]  # the old file (old content) is gone with it
    assert os.listdir(tmp_path / "data") == [] and store.disk_used == 0
    assert store.get(replacement.key) == (replacement, Tier.HOST)
    with pytest.raises(BlobRefused) as err:
        store.put(blob(2, 200))  # too big for memory, and the disk fails
    assert err.value.reason == "io_error" and store.lookup([blob(2).key]) == [None]
