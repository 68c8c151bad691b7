"""Service discovery: instances register in the JetStream KV bucket ``deepinfer_registry``; views watch it.

Usage: ``await Registry(bus, Registration("w0", "worker", "10.0.0.5:50051"), ttl_s=10).start()`` (puts now,
refreshes every ``ttl_s / 3``; ``stop()`` deletes the key); ``view = RegistryView(bus); await view.start();
view.instances("worker")``. Contracts:

- One key ``<kind>.<instance_id>`` per instance, holding the :class:`Registration` as JSON.
- Liveness is a per-key TTL of whole seconds in [1, :data:`BUCKET_TTL_S`] (nats-py sends ``str(int(ttl))``):
  each put is ``js.publish("$KV.deepinfer_registry.<key>", value, msg_ttl=ttl_s)``, so an instance that stops
  refreshing disappears ``ttl_s`` after its last put. The bucket TTL ages out delete markers; expiry markers
  (``limit_marker_ttl``) tell watchers of an expiry at once. ``kv.get`` is never used: it returns markers.
- A :class:`RegistryView` serves an in-memory snapshot: puts apply; deletes, purges and expiry markers
  remove; deliveries not newer than the known revision of their key are ignored. It re-reads the bucket
  every ``resync_s`` and right after a reconnect, when it also replaces its watcher (an old one can stall
  ~15 s after a reconnect). While NATS is down it keeps serving its last snapshot.
- Background tasks never raise; each distinct failure is logged once, as one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BucketNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, OnceLog, quietly, stop_tasks, wait_event
from deepinfer.telemetry import get_logger

__all__ = ["BUCKET_TTL_S", "Registration", "Registry", "RegistryView", "open_registry_bucket"]

log = get_logger(__name__)
BUCKET_TTL_S = 60  # max_age of the bucket; every registration TTL must be <= this
MARKER_TTL_S = 1  # how long the server keeps an expiry marker (a whole number of seconds >= 1)
TOMBSTONE_KEEP_S = 120.0  # how long a view remembers a removal, to ignore late deliveries of older puts
_NATS_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class Registration:
    """What one service instance announces about itself. Validated on construction (``ValueError``)."""

    instance_id: str
    kind: str  # balancer | scheduler | worker | kvstore | grammar
    address: str  # host:port of its gRPC server
    role: str = "mixed"  # e.g. mixed, prefill, decode
    model: str = ""
    capacity: dict[str, Any] = field(default_factory=dict)  # e.g. {"max_num_seqs": 256, "kv_pages": 4096}
    started_at: float = field(default_factory=time.time)  # unix seconds

    def __post_init__(self) -> None:
        subjects.validate_token(self.instance_id, "instance id")
        subjects.validate_kind(self.kind)
        subjects.validate_token(self.role, "role")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {self.address!r} is not host:port")
        if not isinstance(self.capacity, dict):
            raise ValueError("capacity must be a dict")

    @property
    def key(self) -> str:
        """This instance's key in the registry bucket."""
        return subjects.registry_key(self.kind, self.instance_id)

    def to_json(self) -> bytes:
        """The JSON value stored in the bucket."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Registration:
        """Parse a stored value; unknown fields are ignored (newer writers), bad values raise ``ValueError``."""
        raw, known = json.loads(data), {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (TypeError, AttributeError) as exc:  # not an object, or a required field is missing
            raise ValueError(f"not a registration: {exc}") from None


async def open_registry_bucket(bus: EventBus) -> KeyValue:
    """The registry bucket, created (file storage, bucket TTL, expiry markers) if it does not exist yet."""
    try:
        return await bus.js.key_value(subjects.REGISTRY_BUCKET)
    except BucketNotFoundError:
        pass
    bucket = subjects.REGISTRY_BUCKET
    config = KeyValueConfig(bucket, ttl=BUCKET_TTL_S, limit_marker_ttl=MARKER_TTL_S, storage=StorageType.FILE)
    try:
        return await bus.js.create_key_value(config)
    except APIError:  # created concurrently by another instance (possibly with another config): use it
        return await bus.js.key_value(bucket)


class Registry:
    """Keeps one :class:`Registration` alive in the bucket until :meth:`stop`."""

    def __init__(self, bus: EventBus, registration: Registration, *, ttl_s: int = 10) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or not 1 <= ttl_s <= BUCKET_TTL_S:
            raise ValueError(f"ttl_s must be an integer in [1, {BUCKET_TTL_S}] seconds, got {ttl_s!r}")
        self.bus, self.registration, self.ttl_s, self.interval_s = bus, registration, ttl_s, ttl_s / 3
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._kick = asyncio.Event()  # set after a reconnect: refresh at once
        self._errors = OnceLog("registry_refresh_failed")

    async def start(self) -> bool:
        """Register now and keep refreshing in the background; returns whether the first put succeeded."""
        ok = await self.refresh()
        self._running = True
        self.bus.on_reconnect(self._kick.set)
        self._task = asyncio.create_task(self._refresh_loop(), name=f"registry-refresh-{self.registration.key}")
        return ok

    async def refresh(self) -> bool:
        """Put the registration once (skipped while disconnected); ``False`` on failure, never raises."""
        if not self.bus.connected:
            return False
        subject = f"$KV.{subjects.REGISTRY_BUCKET}.{self.registration.key}"
        try:
            self._kv = self._kv or await open_registry_bucket(self.bus)
            await self.bus.js.publish(subject, self.registration.to_json(), msg_ttl=self.ttl_s)
        except _NATS_ERRORS as exc:
            self._kv = None
            self._errors.failed(exc, key=self.registration.key)
            return False
        self._errors.ok()
        return True

    async def update(self, **changes: Any) -> bool:
        """Replace fields of the registration (e.g. ``capacity``) and put it at once."""
        self.registration = dataclasses.replace(self.registration, **changes)
        return await self.refresh()

    async def _refresh_loop(self) -> None:
        while self._running:  # a flag as well as cancellation (see bus.stop_tasks)
            await wait_event(self._kick, self.interval_s)
            if self._running:
                await self.refresh()

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop refreshing; with ``deregister`` also delete the key so views drop it at once.

        ``deregister=False`` (or NATS being down) leaves the key to expire after ``ttl_s``. Never raises.
        """
        self._running = False
        self.bus.remove_reconnect_listener(self._kick.set)
        await stop_tasks(self._task)
        self._task = None
        if not deregister or not self.bus.connected:  # NATS down: the key expires after ttl_s
            return
        try:
            await (self._kv or await open_registry_bucket(self.bus)).delete(self.registration.key)
        except _NATS_ERRORS as exc:
            log.warning("registry_deregister_failed", key=self.registration.key, error=repr(exc))


class RegistryView:
    """A live, in-memory snapshot of the registered instances (see the module docstring)."""

    def __init__(self, bus: EventBus, *, resync_s: float = 5.0) -> None:
        self.bus, self.resync_s = bus, resync_s
        self.synced_at: float | None = None  # time.monotonic() of the last successful full read
        self._entries: dict[str, tuple[int, Registration]] = {}  # key -> (revision, registration)
        self._tombstones: dict[str, tuple[int, float]] = {}  # key -> (revision, monotonic time removed)
        self._stream_created: object = None  # identity of the bucket's stream, to notice a recreated one
        self._kv: KeyValue | None = None
        self._running, self._kick, self._lock = False, asyncio.Event(), asyncio.Lock()  # kick: re-read now
        self._watch_tasks: set[asyncio.Task[None]] = set()  # normally one; old ones are being cancelled
        self._watch_gen = 0  # the generation of the current watch task; older ones exit
        self._resync_task: asyncio.Task[None] | None = None
        self._errors = OnceLog("registry_view_failed")

    def instances(self, kind: str | None = None) -> list[Registration]:
        """The live instances (of ``kind``, if given), sorted by kind then instance id."""
        regs = (reg for _, reg in self._entries.values() if kind is None or reg.kind == kind)
        return sorted(regs, key=lambda r: (r.kind, r.instance_id))

    def get(self, kind: str, instance_id: str) -> Registration | None:
        """One instance's registration, or ``None`` if it is not live."""
        entry = self._entries.get(subjects.registry_key(kind, instance_id))
        return entry[1] if entry else None

    async def start(self) -> None:
        """Read the bucket once (errors are logged), then keep watching and re-syncing in the background."""
        self._running = True
        await self.resync()
        self.bus.on_reconnect(self._on_reconnect)
        self._resync_task = asyncio.create_task(self._resync_loop(), name="registry-view-resync")
        self._on_reconnect()

    async def close(self) -> None:
        """Stop the background tasks; the last snapshot stays readable."""
        self._running = False
        self.bus.remove_reconnect_listener(self._on_reconnect)
        await stop_tasks(*self._watch_tasks, self._resync_task)

    def _on_reconnect(self) -> None:
        """Replace the watcher (an old one can stall after a reconnect) and re-read everything at once."""
        self._kick.set()
        for task in self._watch_tasks:
            task.cancel()  # its ``finally`` stops its watcher
        self._watch_gen += 1
        if self._running:
            task = asyncio.create_task(self._watch_loop(self._watch_gen), name="registry-view-watch")
            self._watch_tasks.add(task)
            task.add_done_callback(self._watch_tasks.discard)

    async def resync(self) -> bool:
        """Re-read every key now and reconcile the snapshot; ``False`` (snapshot kept) if NATS fails."""
        if not self.bus.connected:
            return False
        async with self._lock:
            try:
                kv = self._kv or await open_registry_bucket(self.bus)
                info = await self.bus.js.stream_info(f"KV_{subjects.REGISTRY_BUCKET}")  # before the read
                watcher = await kv.watchall()  # last value per key, then a None marker
                entries: list[KeyValue.Entry] = []
                try:
                    while (entry := await watcher.updates(timeout=self.bus.request_timeout_s)) is not None:
                        entries.append(entry)
                finally:
                    await quietly(watcher.stop(), "kv watcher stop")
            except _NATS_ERRORS as exc:
                self._kv = None
                self._errors.failed(exc, during="resync")
                return False
            self._kv = kv
            if len(entries) < info.state.messages or not self.bus.connected:
                # fewer keys than the stream held when the read began (one message a key): a read cut short, as by
                # a server going away, which answers a new watcher with nothing pending; reconciling against it
                # would drop live instances for the whole outage that follows, so the snapshot is kept
                log.warning("registry_short_read", read=len(entries), stream_messages=info.state.messages)
                return False
            self._errors.ok()
            if info.created != self._stream_created:  # a new stream: its revisions start again
                if self._stream_created is not None:
                    self._on_reconnect()
                self._stream_created = info.created
                self._entries.clear()
                self._tombstones.clear()
            for entry in entries:
                self._apply(entry)
            seen, last_seq, now = {e.key for e in entries}, info.state.last_seq, time.monotonic()
            for key, (rev, _) in list(self._entries.items()):
                if key not in seen and rev <= last_seq:  # expired or removed before the read started
                    self._remove(key, last_seq, now)
            self._tombstones = {k: t for k, t in self._tombstones.items() if now - t[1] <= TOMBSTONE_KEEP_S}
            self.synced_at = now
            return True

    def _apply(self, entry: KeyValue.Entry) -> None:
        """Apply one delivered entry unless an equal or newer revision of its key is already known."""
        rev = entry.revision or 0
        known = max(self._entries.get(entry.key, (0, None))[0], self._tombstones.get(entry.key, (0, 0.0))[0])
        if rev <= known:
            return
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            self._remove(entry.key, rev, time.monotonic())
            return
        try:
            reg = Registration.from_json(entry.value)
            if reg.key != entry.key:
                raise ValueError(f"stored under {entry.key!r} but describes {reg.key!r}")
        except ValueError as exc:
            log.warning("registry_bad_entry", key=entry.key, revision=rev, error=str(exc))
            return
        self._entries[entry.key] = (rev, reg)
        self._tombstones.pop(entry.key, None)

    def _remove(self, key: str, rev: int, now: float) -> None:
        self._entries.pop(key, None)
        self._tombstones[key] = (rev, now)

    async def _resync_loop(self) -> None:
        while self._running:
            await wait_event(self._kick, self.resync_s)
            if self._running:
                await self.resync()

    async def _watch_loop(self, gen: int) -> None:
        """Apply watcher deliveries; make a fresh watcher whenever the old one ends or cannot be made."""
        while self._running and gen == self._watch_gen:
            if not self.bus.connected:
                await asyncio.sleep(0.25)
                continue
            try:
                watcher = await (self._kv or await open_registry_bucket(self.bus)).watchall()
            except _NATS_ERRORS as exc:
                self._errors.failed(exc, during="watch")
                await asyncio.sleep(1.0)
                continue
            try:
                async for entry in watcher:  # a plain queue get: a cancellation is never swallowed here
                    if entry is not None:
                        self._apply(entry)
            finally:
                await quietly(watcher.stop(), "kv watcher stop")
