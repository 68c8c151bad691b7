"""An asyncio client of the kvstore service.

::

    async with KVStoreClient("127.0.0.1:50081") as kv:
        await kv.put("fp", key, payload, {"position": "512"}, "deepinfer-resume-v1")
        got = await kv.get("fp", key)  # (payload, meta) or None
        tiers = await kv.lookup("fp", [key, other])  # [Tier.HOST, None]

Payloads are streamed in 1 MiB chunks with their CRC-32; ``get`` checks the CRC again on arrival. On the kvstore's
host (``same_host``, the default) they pass through a file of its shared directory instead (``PutShared`` /
``GetShared``, ``deepinfer.kvstore.shared``), with the same checks, when ``Describe`` says it has one and this
process reads its probe there; a kvstore without one, a refusal of the path or a file that cannot be written or read
falls back to the stream. Every call has a deadline (``timeout_s``). ``get`` returns ``None`` for NOT_FOUND and raises
:class:`KVStoreDataLoss` for DATA_LOSS (a stored copy failed its checks and was removed, or the bytes
arrived damaged); ``put`` raises :class:`KVStoreRefused` when the service refuses the blob. Other gRPC
failures propagate as ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import re
import time
import zlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from deepinfer.kvstore.assembly import CHUNK_BYTES, blob_chunks
from deepinfer.kvstore.blob import Blob, BlobKey, Tier
from deepinfer.kvstore.shared import SharedFileError, map_taken, new_name, probe_matches, read_taken, write_new
from deepinfer.rpc.channel import open_channel
from deepinfer.telemetry import get_logger
from deepinfer.v1 import kvstore_pb2, kvstore_pb2_grpc

__all__ = ["KVStoreClient", "KVStoreDataLoss", "KVStoreError", "KVStoreRefused", "PutResult"]

log = get_logger(__name__)
_TIERS = {kvstore_pb2.TIER_HOST: Tier.HOST, kvstore_pb2.TIER_DISK: Tier.DISK}
_NO_SHARED_PATH = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)  # (then stream from now on)
_STREAM = object()  # ``_get_shared``: stream this blob
SHARED_FULL_BACKOFF_S = 60.0  # a shared directory that was full: the stream for this long, then ask again


class KVStoreError(RuntimeError):
    """The kvstore answered, but not with what was asked for."""


class KVStoreDataLoss(KVStoreError):
    """The blob was stored but its bytes failed an integrity check (it is gone now): recompute it."""


class KVStoreRefused(KVStoreError):
    """The kvstore refused to store a blob (``reasons``: one line per refused blob)."""

    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


@dataclass
class PutResult:
    stored: int
    refused: list[str] = field(default_factory=list)


class KVStoreClient:
    """One channel to one kvstore instance; ``await close()`` (or use ``async with``) when done."""

    def __init__(
        self, address: str, timeout_s: float = 60.0, chunk_bytes: int = CHUNK_BYTES, same_host: bool = True
    ) -> None:
        self.address, self.timeout_s, self.chunk_bytes = address, timeout_s, chunk_bytes
        self._channel = open_channel(address)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._shared: str | None = None  # the kvstore's shared directory, when this process shares it
        self._ask_again_at = 0.0 if same_host else math.inf  # when to ask for it (again): never, once answered

    async def shared_dir(self) -> str | None:
        """The kvstore's shared directory if this process shares it, else None: asked once, and again after a file
        could not be written or read (at once; after ``SHARED_FULL_BACKOFF_S`` when the directory was full)."""
        if self._shared is None and time.monotonic() >= self._ask_again_at:
            try:
                d = await self._stub.Describe(kvstore_pb2.DescribeRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # (a kvstore of an earlier release: stream)
                    raise
                d = kvstore_pb2.DescribeResponse()
            self._shared = d.shared_dir if probe_matches(d.shared_dir, d.probe) else None
            self._ask_again_at = math.inf
        return self._shared

    async def put(
        self,
        fingerprint: str,
        key: bytes,
        data: bytes,
        meta: Mapping[str, object] | None = None,
        layout: str = "",
        resume_point: bool = True,
    ) -> None:
        """Store one blob; :class:`KVStoreRefused` if the service refuses it."""
        blob = Blob.build(BlobKey(fingerprint, key, resume_point), data, layout, _meta(meta))
        result = await self.put_many([blob])
        if result.refused or result.stored != 1:
            raise KVStoreRefused(result.refused or ["not stored"])

    async def put_many(self, blobs: Iterable[Blob]) -> PutResult:
        """Store several blobs in one stream; the result lists those refused (nothing is raised for them)."""

        blobs, out, streamed = list(blobs), PutResult(0), []
        for i, blob in enumerate(blobs):
            response = await self._put_shared(blob) if await self.shared_dir() else None
            if response is None:
                streamed.append(i)
                continue
            out.stored += response.stored
            out.refused += [re.sub(r"^blob 0 ", f"blob {i} ", line) for line in response.refused]
        if streamed:

            async def chunks() -> AsyncIterator[kvstore_pb2.PageChunk]:
                for i in streamed:
                    for chunk in blob_chunks(blobs[i], self.chunk_bytes):
                        yield chunk

            response = await self._stub.Put(chunks(), timeout=self.timeout_s)
            out.stored += response.stored
            out.refused += [re.sub(r"^blob (\d+) ", lambda m: f"blob {streamed[int(m[1])]} ", line)
                            for line in response.refused]  # fmt: skip
        return out

    async def _put_shared(self, blob: Blob) -> kvstore_pb2.PutResponse | None:
        """One blob through a file of the shared directory; None: stream it (the path is refused or unusable)."""
        directory, name = self._shared, new_name("put")
        assert directory is not None
        header = kvstore_pb2.PageChunk(
            key=kvstore_pb2.PageKey(hash=blob.key.hash, resume_point=blob.key.resume_point),
            model_fingerprint=blob.key.fingerprint, layout=blob.layout, total_bytes=len(blob.data), crc32=blob.crc32,
            meta=blob.meta,
        )  # fmt: skip
        try:
            await asyncio.to_thread(write_new, directory, name, blob.data)
        except OSError as exc:  # (a kvstore restarted with another directory, or a full tmpfs): this blob streams
            log.warning("kvstore_shared_write_failed", error=str(exc))
            self._forget_shared(SHARED_FULL_BACKOFF_S if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 0.0)
            return None
        try:
            return await self._stub.PutShared(kvstore_pb2.SharedBlob(header=header, file=name), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _NO_SHARED_PATH:
                raise
            self._shared = None
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):  # (taken by the kvstore unless the call failed first)
                os.unlink(os.path.join(directory, name))

    async def get(self, fingerprint: str, key: bytes, resume_point: bool = True) -> tuple[bytes, dict[str, str]] | None:
        """``(payload, meta)``, or ``None`` if the blob is not stored; :class:`KVStoreDataLoss` if it is damaged. The
        payload is ``bytes``, or, for a blob of ``MAP_MIN_BYTES`` or more through the shared directory, a read-only
        ``memoryview`` of the mapped file (no copy; the memory is freed with its last reference)."""
        blob = await self.get_blob(fingerprint, key, resume_point)
        return None if blob is None else (blob.data, blob.meta)

    async def get_blob(self, fingerprint: str, key: bytes, resume_point: bool = True) -> Blob | None:
        """Like :meth:`get`, with the layout and checksum too."""
        request = kvstore_pb2.GetRequest(
            model_fingerprint=fingerprint, key=kvstore_pb2.PageKey(hash=key, resume_point=resume_point)
        )
        if await self.shared_dir():
            got = await self._get_shared(request)
            if got is not _STREAM:
                return got  # type: ignore[return-value]
        parts: list[bytes] = []
        first: kvstore_pb2.PageChunk | None = None
        received = 0
        try:
            async for chunk in self._stub.Get(request, timeout=self.timeout_s):
                if first is None:
                    first = chunk
                if chunk.offset != received:
                    raise KVStoreDataLoss(f"blob {key.hex()}: chunk at offset {chunk.offset}, expected {received}")
                parts.append(chunk.data)
                received += len(chunk.data)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if exc.code() == grpc.StatusCode.DATA_LOSS:
                raise KVStoreDataLoss(exc.details() or "data loss") from None
            raise
        if first is None or received != first.total_bytes:
            expected = first.total_bytes if first is not None else "some"
            raise KVStoreDataLoss(f"blob {key.hex()}: received {received} bytes, expected {expected}")
        data = b"".join(parts)
        if zlib.crc32(data) != first.crc32:
            raise KVStoreDataLoss(f"blob {key.hex()}: checksum mismatch after transfer")
        return Blob(BlobKey(fingerprint, key, resume_point), data, first.layout, dict(first.meta), first.crc32)

    async def _get_shared(self, request: kvstore_pb2.GetRequest) -> Blob | None | object:
        """One blob through a file of the shared directory: the blob, None (not stored), or ``_STREAM``."""
        directory, key = self._shared, request.key.hash
        assert directory is not None
        try:
            answer = await self._stub.GetShared(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return None
            if code == grpc.StatusCode.DATA_LOSS:
                raise KVStoreDataLoss(exc.details() or "data loss") from None
            if code in _NO_SHARED_PATH:
                self._shared = None
            elif code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # (too many bytes wait in files: this one streams)
                raise
            return _STREAM
        h = answer.header
        try:
            data, crc = await asyncio.to_thread(_read_file, directory, answer.file, h.total_bytes)
        except (OSError, SharedFileError) as exc:  # (a kvstore restarted with another directory, say): stream it
            log.warning("kvstore_shared_read_failed", key=key.hex()[:16], error=str(exc))
            self._forget_shared()
            return _STREAM
        if crc != h.crc32:
            raise KVStoreDataLoss(f"blob {key.hex()}: checksum mismatch after transfer")
        blob_key = BlobKey(request.model_fingerprint, key, request.key.resume_point)
        return Blob(blob_key, data, h.layout, dict(h.meta), h.crc32)

    def _forget_shared(self, backoff_s: float = 0.0) -> None:
        """Ask again (``Describe``) before the next transfer, the directory may have moved or gone; after
        ``backoff_s`` (a full directory: stream until then)."""
        self._shared, self._ask_again_at = None, time.monotonic() + backoff_s

    async def lookup(self, fingerprint: str, keys: Sequence[bytes], resume_point: bool = True) -> list[Tier | None]:
        """The fastest tier holding each key (``None``: not stored)."""
        request = kvstore_pb2.LookupRequest(model_fingerprint=fingerprint, keys=_page_keys(keys, resume_point))
        response = await self._stub.Lookup(request, timeout=self.timeout_s)
        return [_TIERS.get(t) for t in response.tiers]

    async def remove(self, fingerprint: str, keys: Sequence[bytes], resume_point: bool = True) -> int:
        """Remove blobs from every tier; returns how many were stored."""
        request = kvstore_pb2.RemoveRequest(model_fingerprint=fingerprint, keys=_page_keys(keys, resume_point))
        return (await self._stub.Remove(request, timeout=self.timeout_s)).removed

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


MAP_MIN_BYTES = 4 << 20  # a blob's file this large or larger is mapped, not read (below, the map costs more)


def _read_file(directory: str, name: str, size: int) -> tuple[bytes | memoryview, int]:
    """A blob's file of the shared directory and its CRC-32: a large one mapped (a read-only view: no copy, freed with
    its last reference), a small one read."""
    if size < MAP_MIN_BYTES:
        data: bytes | memoryview = read_taken(directory, name, "get", size)
    else:
        data = memoryview(map_taken(directory, name, "get", size))
    return data, zlib.crc32(data)


def _meta(meta: Mapping[str, object] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (meta or {}).items()}


def _page_keys(keys: Sequence[bytes], resume_point: bool) -> list[kvstore_pb2.PageKey]:
    return [kvstore_pb2.PageKey(hash=k, resume_point=resume_point) for k in keys]
