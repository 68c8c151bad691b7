"""The ``deepinfer.v1.KVStore`` gRPC servicer (a thin adapter over :class:`Store`) and the service's run loop.

Status codes: a malformed request or Put stream → INVALID_ARGUMENT naming the field; a resume point whose key is
not the one its own header derives (``kvstore/keys.py``: a blob put under another prompt's key, or without its
binding) → PERMISSION_DENIED, counted under ``refused_total{reason="key_mismatch" | "unbound_key"}``, the stream
ends there (blobs before it stay stored); an absent (or expired, or other-fingerprint) blob → NOT_FOUND; a stored
copy that failed its checks → DATA_LOSS (the copy is removed and counted, never served); anything unexpected →
INTERNAL with a generic message. Other bad blobs inside a well-formed Put stream are not errors: they are listed in
``PutResponse.refused`` as ``"blob <i> (<key>): <field>: <why>"`` and counted under
``deepinfer_kvstore_refused_total{reason}``.
File I/O runs in worker threads, so a large blob never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from deepinfer import envs
from deepinfer.kvstore.assembly import PutAssembler, StreamError, blob_chunks
from deepinfer.kvstore.blob import Blob, BlobKey, BlobNotFound, BlobRefused, CorruptBlob, Tier, check_blob, check_key
from deepinfer.kvstore.keys import check_binding
from deepinfer.kvstore.shared import SharedFileError, check_name
from deepinfer.telemetry import get_logger
from deepinfer.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.shared_dir import SharedDir, SharedFull
from services.kvstore.store import Store

__all__ = ["KVStoreConfig", "KVStoreService", "run_kvstore"]

log = get_logger(__name__)
MAX_KEYS_PER_CALL = 65536
T = TypeVar("T")
TIER_PROTO = {None: kvstore_pb2.TIER_UNSPECIFIED, Tier.HOST: kvstore_pb2.TIER_HOST, Tier.DISK: kvstore_pb2.TIER_DISK}


@dataclass(frozen=True)
class KVStoreConfig:
    """Limits of one kvstore instance (``from_env``: the ``DEEPINFER_KVSTORE_*`` variables)."""

    host_bytes: int = 4 * 1024**3
    data_dir: Path | None = None
    disk_bytes: int = 64 * 1024**3
    retention_s: float = 259200.0
    max_blob_bytes: int = 1024**3
    shared_dir: str = "auto"  # the same-host path's directory (``shared_dir.SharedDir.open``)

    @classmethod
    def from_env(cls, data_dir: str | Path | None = None) -> KVStoreConfig:
        """The configuration from the environment; ``data_dir`` (the ``--data-dir`` flag) overrides the env."""
        return cls(
            host_bytes=envs.DEEPINFER_KVSTORE_HOST_BYTES,
            data_dir=Path(data_dir).expanduser() if data_dir else envs.DEEPINFER_KVSTORE_DIR,
            disk_bytes=envs.DEEPINFER_KVSTORE_DISK_BYTES,
            retention_s=float(envs.DEEPINFER_KVSTORE_RETENTION_S),
            max_blob_bytes=envs.DEEPINFER_KVSTORE_MAX_BLOB_BYTES,
            shared_dir=envs.DEEPINFER_KVSTORE_SHARED_DIR,
        )

    @property
    def sweep_interval_s(self) -> float:
        """How often expired blobs are swept (lookups and gets also check on their own)."""
        return max(0.1, min(60.0, self.retention_s / 4))


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: Store, metrics: KVStoreMetrics, max_blob_bytes: int, shared: SharedDir | None = None):
        self.store, self.metrics, self.max_blob_bytes, self.shared = store, metrics, max_blob_bytes, shared

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        keys = await _keys(request.model_fingerprint, request.keys, context)
        tiers = await self._call(context, self.store.lookup, keys)
        for tier in tiers:
            self.metrics.hit("lookup", tier)
        return kvstore_pb2.LookupResponse(tiers=[TIER_PROTO[t] for t in tiers])

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PageChunk], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        assembler = PutAssembler(self.max_blob_bytes)
        stored, refused = 0, []
        try:
            async for chunk in request_iterator:
                done = assembler.feed(chunk)
                if done is None:
                    continue
                index = assembler.blobs - 1
                if not isinstance(done, BlobRefused):
                    key, size = done.key, len(done.data)
                    done = await self._store(done, index, context)
                    if done is None:
                        stored += 1
                        self.metrics.transferred("put", "stream", size)
                        continue
                else:
                    key = assembler.last_key
                refused.append(self._refused(index, key, done))
            assembler.finish()
        except StreamError as exc:
            log.info("kvstore_put_malformed", error=str(exc), stored=stored)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return kvstore_pb2.PutResponse(stored=stored, refused=refused)

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.PageChunk]:
        _, blob, tier = await self._lookup(request, context)
        self.metrics.hit("get", tier)
        self.metrics.transferred("get", "stream", len(blob.data))
        for chunk in blob_chunks(blob):
            yield chunk

    async def Describe(
        self, request: kvstore_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DescribeResponse:
        d = self.shared
        return kvstore_pb2.DescribeResponse(shared_dir=str(d.path) if d else "", probe=d.probe if d else "")

    async def PutShared(
        self, request: kvstore_pb2.SharedBlob, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        """One blob from the client's file in the shared directory (module ``shared_dir``); the file is taken or
        removed whatever the answer."""
        d, h = await self._shared(context), request.header
        key, meta = BlobKey(h.model_fingerprint, h.key.hash, h.key.resume_point), dict(h.meta)
        try:
            check_name(request.file, "put")
            check_blob(key, h.layout, meta, h.total_bytes, self.max_blob_bytes)
            data, crc = await asyncio.to_thread(_take, d, request.file, h.total_bytes)
            if crc != h.crc32:
                raise BlobRefused("crc_mismatch", f"crc32: the file has {crc:#010x}, the header said {h.crc32:#010x}")
        except SharedFileError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BlobRefused as exc:
            with contextlib.suppress(SharedFileError):
                await asyncio.to_thread(d.discard, request.file)
            return kvstore_pb2.PutResponse(refused=[self._refused(0, key, exc)])
        refusal = await self._store(Blob(key, data, h.layout, meta, h.crc32), 0, context)  # type: ignore[arg-type]
        if refusal is not None:
            return kvstore_pb2.PutResponse(refused=[self._refused(0, key, refusal)])
        self.metrics.transferred("put", "shared", h.total_bytes)
        return kvstore_pb2.PutResponse(stored=1)

    async def GetShared(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.SharedBlob:
        """One blob written to a new file of the shared directory for the client, who removes it once read."""
        d = await self._shared(context)
        key, blob, tier = await self._lookup(request, context)
        try:
            name = await asyncio.to_thread(d.give, blob.data)
        except (SharedFull, OSError) as exc:  # (a full tmpfs too): the client streams
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"shared directory: {exc}")
        self.metrics.hit("get", tier)
        self.metrics.transferred("get", "shared", len(blob.data))
        header = kvstore_pb2.PageChunk(
            key=request.key, model_fingerprint=key.fingerprint, layout=blob.layout, total_bytes=len(blob.data),
            crc32=blob.crc32, meta=blob.meta,
        )  # fmt: skip
        return kvstore_pb2.SharedBlob(header=header, file=name)

    async def Remove(
        self, request: kvstore_pb2.RemoveRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.RemoveResponse:
        keys = await _keys(request.model_fingerprint, request.keys, context)
        return kvstore_pb2.RemoveResponse(removed=await self._call(context, self.store.remove, keys))

    async def _lookup(self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
                      ) -> tuple[BlobKey, Blob, Tier]:  # fmt: skip
        """The requested blob and its tier; a miss counted and answered NOT_FOUND (DATA_LOSS: a damaged copy)."""
        (key,) = await _keys(request.model_fingerprint, [request.key], context)
        try:
            blob, tier = await self._call(context, self.store.get, key)
        except BlobNotFound as exc:
            self.metrics.hit("get", None)
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except CorruptBlob as exc:
            self.metrics.hit("get", None)
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        return key, blob, tier

    async def _shared(self, context: grpc.aio.ServicerContext) -> SharedDir:
        if self.shared is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this kvstore has no shared directory")
        return self.shared  # type: ignore[return-value]

    async def _store(self, blob: Blob, index: int, context: grpc.aio.ServicerContext) -> BlobRefused | None:
        """Store a received blob: None, or the store's refusal (PERMISSION_DENIED for a forged resume point)."""
        await self._check_binding(blob.key, blob.meta, index, context)
        try:
            await self._call(context, self.store.put, blob)
        except BlobRefused as exc:
            return exc
        return None

    def _refused(self, index: int, key: BlobKey | None, exc: BlobRefused) -> str:
        """A refused blob counted and logged; its line of ``PutResponse.refused``."""
        self.metrics.refused.labels(exc.reason).inc()
        log.info("kvstore_put_refused", blob=index, key=str(key), reason=exc.reason, error=str(exc))
        return f"blob {index} ({key}): {exc}"

    async def _check_binding(
        self, key: BlobKey, meta: dict[str, str], index: int, context: grpc.aio.ServicerContext
    ) -> None:
        """PERMISSION_DENIED (and counted) unless a resume point is put under the key its own header derives."""
        try:
            check_binding(key, meta)
        except BlobRefused as exc:
            self.metrics.refused.labels(exc.reason).inc()
            log.warning("kvstore_put_forged", blob=index, key=str(key), reason=exc.reason, error=str(exc))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"blob {index} ({key}): {exc}")

    @staticmethod
    async def _call(context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call in a worker thread; domain errors pass through, anything else is INTERNAL."""
        try:
            return await asyncio.to_thread(fn, *args)
        except (BlobNotFound, BlobRefused, CorruptBlob):
            raise
        except Exception as exc:
            log.exception("kvstore_internal_error", error=repr(exc))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            raise  # unreachable: abort raises


def _take(d: SharedDir, name: str, size: int) -> tuple[object, int]:
    """A client's file taken (mapped) and its CRC-32, off the event loop."""
    data = d.take(name, size)
    return data, zlib.crc32(data)  # type: ignore[arg-type]


async def _keys(
    fingerprint: str, keys: Iterable[kvstore_pb2.PageKey], context: grpc.aio.ServicerContext
) -> list[BlobKey]:
    """The request's keys, or INVALID_ARGUMENT naming the bad field."""
    out: list[BlobKey] = []
    try:
        for i, k in enumerate(keys):
            if i >= MAX_KEYS_PER_CALL:
                raise BlobRefused("bad_key", f"keys: more than {MAX_KEYS_PER_CALL} keys in one call")
            try:
                check_key(fingerprint, k.hash)
            except BlobRefused as exc:
                raise BlobRefused(exc.reason, str(exc).replace("key.hash", f"keys[{i}].hash", 1)) from None
            out.append(BlobKey(fingerprint, k.hash, k.resume_point))
    except BlobRefused as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return out


async def run_kvstore(
    config: KVStoreConfig, host: str, port: int, metrics_port: int = 0, grace_s: float = 10.0
) -> None:
    """Index the data dir, then serve ``deepinfer.v1.KVStore`` until SIGTERM (metrics, registry, KV events)."""
    from deepinfer.events import Registration
    from deepinfer.serving.metrics import start_metrics_server
    from deepinfer.serving.presence import Presence, advertised, instance_id
    from deepinfer.serving.server import Service, serve
    from services.kvstore.disk import DiskDir
    from services.kvstore.events import KVEventPublisher

    metrics = KVStoreMetrics()
    me = instance_id("kvstore")
    capacity = {"host_bytes": config.host_bytes, "disk_bytes": config.disk_bytes if config.data_dir else 0,
                "retention_s": config.retention_s, "max_blob_bytes": config.max_blob_bytes}  # fmt: skip
    presence = Presence(Registration(me, "kvstore", advertised(host, port), capacity=capacity))
    publisher = None
    if envs.DEEPINFER_NATS_URL:
        publisher = KVEventPublisher(me, lambda: presence.bus, on_drop=metrics.events_dropped.inc)
    disk = DiskDir(config.data_dir) if config.data_dir is not None else None
    listeners = [metrics.on_event, *([publisher.on_event] if publisher else [])]
    store = Store(config.host_bytes, disk, config.disk_bytes, config.retention_s, listeners=listeners)
    metrics.bind(store)
    log.info("kvstore_config", instance=me, data_dir=str(config.data_dir) if config.data_dir else None,
             host_bytes=config.host_bytes, disk_bytes=config.disk_bytes, retention_s=config.retention_s,
             shared_dir=config.shared_dir)  # fmt: skip
    await asyncio.to_thread(store.index_disk)
    shared = SharedDir.open(config.shared_dir, 2 * config.max_blob_bytes)
    metrics.bind_shared(shared)
    stop_metrics = start_metrics_server(metrics.registry, host, metrics_port) if metrics_port > 0 else None
    tasks: list[asyncio.Task[None]] = []

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(config.sweep_interval_s)
            try:
                await asyncio.to_thread(store.sweep)
                if shared is not None:
                    await asyncio.to_thread(shared.sweep)
            except Exception as exc:  # keep sweeping
                log.error("kvstore_sweep_failed", error=repr(exc))

    async def started(_: object) -> None:
        tasks.append(asyncio.create_task(sweep_forever(), name="kvstore-sweep"))
        if publisher is not None:
            await publisher.start()
        await presence.start()

    servicer = KVStoreService(store, metrics, config.max_blob_bytes, shared)
    service = Service("deepinfer.v1.KVStore", servicer, kvstore_pb2_grpc.add_KVStoreServicer_to_server)
    try:
        await serve([service], host, port, grace_s=grace_s, on_started=started)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if publisher is not None:
            await publisher.stop()
        await presence.close()
        if stop_metrics is not None:
            stop_metrics()
        if shared is not None:
            shared.close()
