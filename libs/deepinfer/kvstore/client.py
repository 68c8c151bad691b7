"""An asyncio client of the kvstore service.

::

    async with KVStoreClient("127.0.0.1:50081") as kv:
        await kv.put("fp", key, payload, {"position": "512"}, "deepinfer-resume-v1")
        got = await kv.get("fp", key)  # (payload, meta) or None
        tiers = await kv.lookup("fp", [key, other])  # [Tier.HOST, None]

Payloads are streamed in 1 MiB chunks with their CRC-32; ``get`` checks the CRC again on arrival. Every
call has a deadline (``timeout_s``). ``get`` returns ``None`` for NOT_FOUND and raises
:class:`KVStoreDataLoss` for DATA_LOSS (a stored copy failed its checks and was removed, or the bytes
arrived damaged); ``put`` raises :class:`KVStoreRefused` when the service refuses the blob. Other gRPC
failures propagate as ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from deepinfer.kvstore.assembly import CHUNK_BYTES, blob_chunks
from deepinfer.kvstore.blob import Blob, BlobKey, Tier
from deepinfer.rpc.channel import open_channel
from deepinfer.v1 import kvstore_pb2, kvstore_pb2_grpc

__all__ = ["KVStoreClient", "KVStoreDataLoss", "KVStoreError", "KVStoreRefused", "PutResult"]

_TIERS = {kvstore_pb2.TIER_HOST: Tier.HOST, kvstore_pb2.TIER_DISK: Tier.DISK}


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

    def __init__(self, address: str, timeout_s: float = 60.0, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.address, self.timeout_s, self.chunk_bytes = address, timeout_s, chunk_bytes
        self._channel = open_channel(address)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

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

        async def chunks() -> AsyncIterator[kvstore_pb2.PageChunk]:
            for blob in blobs:
                for chunk in blob_chunks(blob, self.chunk_bytes):
                    yield chunk

        response = await self._stub.Put(chunks(), timeout=self.timeout_s)
        return PutResult(response.stored, list(response.refused))

    async def get(self, fingerprint: str, key: bytes, resume_point: bool = True) -> tuple[bytes, dict[str, str]] | None:
        """``(payload, meta)``, or ``None`` if the blob is not stored; :class:`KVStoreDataLoss` if it is damaged."""
        blob = await self.get_blob(fingerprint, key, resume_point)
        return None if blob is None else (blob.data, blob.meta)

    async def get_blob(self, fingerprint: str, key: bytes, resume_point: bool = True) -> Blob | None:
        """Like :meth:`get`, with the layout and checksum too."""
        request = kvstore_pb2.GetRequest(
            model_fingerprint=fingerprint, key=kvstore_pb2.PageKey(hash=key, resume_point=resume_point)
        )
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


def _meta(meta: Mapping[str, object] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (meta or {}).items()}


def _page_keys(keys: Sequence[bytes], resume_point: bool) -> list[kvstore_pb2.PageKey]:
    return [kvstore_pb2.PageKey(hash=k, resume_point=resume_point) for k in keys]
