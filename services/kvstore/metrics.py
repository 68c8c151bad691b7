"""Prometheus metrics of the kvstore, in a private registry (served on ``--metrics-port``).

==============================================  =====================  ======================================
name                                            labels                 meaning
==============================================  =====================  ======================================
``deepinfer_kvstore_bytes``                     tier                   payload bytes held (disk: file bytes)
``deepinfer_kvstore_entries``                   tier                   blobs held
``deepinfer_kvstore_hits_total``                op, tier               Get / Lookup answered from a tier
``deepinfer_kvstore_misses_total``              op                     Get / Lookup for an absent blob
``deepinfer_kvstore_stored_total``              tier, reason           blobs stored (put, promoted, indexed)
``deepinfer_kvstore_stored_bytes_total``        tier                   payload bytes stored
``deepinfer_kvstore_refused_total``             reason                 blobs Put refused (bad_key, key_mismatch, ...)
``deepinfer_kvstore_corrupt_total``             tier                   copies that failed their checks
``deepinfer_kvstore_evicted_total``             tier                   copies evicted for capacity
``deepinfer_kvstore_expired_total``             tier                   copies expired by retention
``deepinfer_kvstore_removed_total``             tier, reason           every removal (the four above + Remove)
``deepinfer_kvstore_events_dropped_total``                             KV events not published (NATS)
``deepinfer_kvstore_transfers_total``           op, path               blobs put / got: stream or shared (file)
``deepinfer_kvstore_transfer_bytes_total``      op, path               their payload bytes
``deepinfer_kvstore_shared_waiting_bytes``                             bytes in shared files not yet read
==============================================  =====================  ======================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from deepinfer.kvstore.blob import Tier
from services.kvstore.shared_dir import SharedDir
from services.kvstore.store import Store, StoreEvent

__all__ = ["KVStoreMetrics", "REFUSAL_REASONS"]

OPS = ("get", "lookup")
TRANSFER_OPS, PATHS = ("put", "get"), ("stream", "shared")
REFUSAL_REASONS = ("bad_key", "bad_fingerprint", "bad_meta", "empty", "too_large", "crc_mismatch", "capacity",
                   "io_error", "key_mismatch", "unbound_key")  # fmt: skip


class KVStoreMetrics:
    """The kvstore's metrics; :meth:`on_event` is a :class:`Store` listener."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        p = "deepinfer_kvstore"
        self.bytes = Gauge(f"{p}_bytes", "Bytes held per tier (host: payloads, disk: files).", ["tier"], registry=r)
        self.entries = Gauge(f"{p}_entries", "Blobs held per tier.", ["tier"], registry=r)
        self.hits = Counter(f"{p}_hits", "Get/Lookup answered from a tier.", ["op", "tier"], registry=r)
        self.misses = Counter(f"{p}_misses", "Get/Lookup for a blob that is not stored.", ["op"], registry=r)
        self.stored = Counter(f"{p}_stored", "Blobs stored per tier (put, promoted, indexed).", ["tier", "reason"],
                              registry=r)  # fmt: skip
        self.stored_bytes = Counter(f"{p}_stored_bytes", "Payload bytes stored per tier.", ["tier"], registry=r)
        self.refused = Counter(f"{p}_refused", "Blobs a Put refused, by reason.", ["reason"], registry=r)
        self.corrupt = Counter(f"{p}_corrupt", "Copies that failed their header or checksum.", ["tier"], registry=r)
        self.evicted = Counter(f"{p}_evicted", "Copies evicted to make room.", ["tier"], registry=r)
        self.expired = Counter(f"{p}_expired", "Copies expired by the retention time.", ["tier"], registry=r)
        self.removed = Counter(f"{p}_removed", "Copies removed, by reason.", ["tier", "reason"], registry=r)
        self.events_dropped = Counter(f"{p}_events_dropped", "KV events that could not be published.", registry=r)
        self.transfers = Counter(f"{p}_transfers", "Blobs put or got, by path (stream, shared).", ["op", "path"],
                                 registry=r)  # fmt: skip
        self.transfer_bytes = Counter(f"{p}_transfer_bytes", "Payload bytes put or got, by path.", ["op", "path"],
                                      registry=r)  # fmt: skip
        self.shared_waiting = Gauge(f"{p}_shared_waiting_bytes", "Bytes in shared files not yet read.", registry=r)
        for op in TRANSFER_OPS:
            for path in PATHS:
                self.transfers.labels(op, path)
                self.transfer_bytes.labels(op, path)
        for tier in Tier:  # exported at 0 from the start
            for c in (self.corrupt, self.evicted, self.expired, self.stored_bytes):
                c.labels(tier.value)
            for op in OPS:
                self.hits.labels(op, tier.value)
        for op in OPS:
            self.misses.labels(op)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)

    def bind(self, store: Store) -> None:
        """Read the size gauges from ``store`` at scrape time."""
        self.bytes.labels(Tier.HOST.value).set_function(lambda: store.host_used)
        self.bytes.labels(Tier.DISK.value).set_function(lambda: store.disk_used)
        self.entries.labels(Tier.HOST.value).set_function(lambda: store.host_entries)
        self.entries.labels(Tier.DISK.value).set_function(lambda: store.disk_entries)

    def bind_shared(self, shared: SharedDir | None) -> None:
        """Read the bytes waiting in the shared directory at scrape time (0 without one)."""
        if shared is not None:
            self.shared_waiting.set_function(lambda: shared.waiting_bytes)

    def transferred(self, op: str, path: str, size: int) -> None:
        """Count one blob put or got (``op``) over ``path`` (``stream`` or ``shared``)."""
        self.transfers.labels(op, path).inc()
        self.transfer_bytes.labels(op, path).inc(size)

    def on_event(self, event: StoreEvent) -> None:
        tier = event.tier.value
        if event.type == "stored":
            self.stored.labels(tier, event.reason).inc()
            if event.reason != "indexed":
                self.stored_bytes.labels(tier).inc(event.size)
            return
        self.removed.labels(tier, event.reason).inc()
        counter = {"corrupt": self.corrupt, "evicted": self.evicted, "expired": self.expired}.get(event.reason)
        if counter is not None:
            counter.labels(tier).inc()

    def hit(self, op: str, tier: Tier | None) -> None:
        """Count one Get/Lookup answer (``tier`` None: a miss)."""
        if tier is None:
            self.misses.labels(op).inc()
        else:
            self.hits.labels(op, tier.value).inc()
