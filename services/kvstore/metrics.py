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
==============================================  =====================  ======================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from deepinfer.kvstore.blob import Tier
from services.kvstore.store import Store, StoreEvent

__all__ = ["KVStoreMetrics", "REFUSAL_REASONS"]

OPS = ("get", "lookup")
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
