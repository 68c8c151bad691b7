"""Turning a ``Put`` stream of ``PageChunk`` messages back into blobs, and blobs into ``Get`` chunks.

A Put stream is a sequence of blobs, each a run of chunks with the same key: the first chunk has offset 0
and carries the fingerprint, layout, meta, total_bytes and crc32; every later one continues at the byte
where the previous ended, until total_bytes are in. Later chunks repeat the key; they may leave
fingerprint and total_bytes empty, but may not change them.

Two kinds of failure:

- a **bad blob** (empty or oversized key, empty fingerprint, too large, checksum mismatch, ...) is consumed
  to its end and refused: :meth:`PutAssembler.feed` returns a :class:`BlobRefused`; the stream goes on;
- a **malformed stream** (a chunk for another key before a blob is complete, a gap or overlap in offsets,
  data past total_bytes, the stream ending mid-blob) raises :class:`StreamError`, whose message names the
  field; the service answers INVALID_ARGUMENT. Blobs completed before that point stay stored.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from deepinfer.kvstore.blob import Blob, BlobKey, BlobRefused, check_blob
from deepinfer.v1 import kvstore_pb2

__all__ = ["CHUNK_BYTES", "PutAssembler", "StreamError", "blob_chunks"]

CHUNK_BYTES = 1024 * 1024


class StreamError(ValueError):
    """A malformed Put stream; the message starts with the offending field."""


@dataclass
class _Pending:
    key: BlobKey
    layout: str
    meta: dict[str, str]
    total: int
    crc32: int
    refusal: BlobRefused | None
    parts: list[bytes] = field(default_factory=list)
    received: int = 0
    running_crc: int = 0


class PutAssembler:
    """Feeds chunks in order; yields each blob (or its refusal) once its last chunk is in."""

    def __init__(self, max_blob_bytes: int) -> None:
        self.max_blob_bytes = max_blob_bytes
        self.blobs = 0  # blobs started so far (the index of a refusal in its message)
        self.last_key: BlobKey | None = None  # the key of the blob started last
        self._pending: _Pending | None = None

    def feed(self, chunk: kvstore_pb2.PageChunk) -> Blob | BlobRefused | None:
        """The completed blob or refusal this chunk finishes, else ``None``; ``StreamError`` if malformed."""
        p = self._pending
        if p is None:
            p = self._pending = self._start(chunk)
        else:
            self._check_continuation(p, chunk)
        end = p.received + len(chunk.data)
        if end > p.total:
            raise StreamError(f"data: chunk ends at byte {end}, past total_bytes {p.total} of blob {p.key}")
        if p.refusal is None:
            p.parts.append(chunk.data)
            p.running_crc = zlib.crc32(chunk.data, p.running_crc)
        p.received = end
        if end < p.total:
            return None
        self._pending = None
        return self._complete(p)

    def finish(self) -> None:
        """The stream ended: ``StreamError`` if a blob is incomplete."""
        p = self._pending
        if p is not None:
            raise StreamError(f"total_bytes: the stream ended after {p.received} of {p.total} bytes of blob {p.key}")

    def _start(self, chunk: kvstore_pb2.PageChunk) -> _Pending:
        key = BlobKey(chunk.model_fingerprint, chunk.key.hash, chunk.key.resume_point)
        if chunk.offset != 0:
            raise StreamError(f"offset: the first chunk of blob {key} has offset {chunk.offset}, expected 0")
        self.blobs += 1
        self.last_key = key
        meta = dict(chunk.meta)
        refusal = None
        try:
            check_blob(key, chunk.layout, meta, chunk.total_bytes, self.max_blob_bytes)
        except BlobRefused as exc:
            refusal = exc
        return _Pending(key, chunk.layout, meta, chunk.total_bytes, chunk.crc32, refusal)

    @staticmethod
    def _check_continuation(p: _Pending, chunk: kvstore_pb2.PageChunk) -> None:
        if chunk.key.hash != p.key.hash or chunk.key.resume_point != p.key.resume_point:
            raise StreamError(
                f"key: a chunk for another key arrived while blob {p.key} is incomplete "
                f"({p.received} of {p.total} bytes); chunks of different blobs must not interleave"
            )
        if chunk.model_fingerprint and chunk.model_fingerprint != p.key.fingerprint:
            raise StreamError(f"model_fingerprint: changed within blob {p.key}")
        if chunk.total_bytes and chunk.total_bytes != p.total:
            raise StreamError(f"total_bytes: changed within blob {p.key} ({p.total} -> {chunk.total_bytes})")
        if chunk.offset != p.received:
            raise StreamError(
                f"offset: expected {p.received}, got {chunk.offset} in blob {p.key} (chunks must be contiguous)"
            )

    def _complete(self, p: _Pending) -> Blob | BlobRefused:
        if p.refusal is not None:
            return p.refusal
        if p.running_crc != p.crc32:
            return BlobRefused(
                "crc_mismatch", f"crc32: payload has {p.running_crc:#010x}, the first chunk said {p.crc32:#010x}"
            )
        data = p.parts[0] if len(p.parts) == 1 else b"".join(p.parts)
        return Blob(p.key, data, p.layout, p.meta, p.crc32)


def blob_chunks(blob: Blob, chunk_bytes: int = CHUNK_BYTES) -> Iterator[kvstore_pb2.PageChunk]:
    """The chunks of one blob: the first carries layout, meta and crc32; every one carries key and size."""
    key = kvstore_pb2.PageKey(hash=blob.key.hash, resume_point=blob.key.resume_point)
    total, view = len(blob.data), memoryview(blob.data)
    offset = 0
    while True:
        part = bytes(view[offset : offset + chunk_bytes])
        first = offset == 0
        yield kvstore_pb2.PageChunk(
            key=key,
            model_fingerprint=blob.key.fingerprint,
            layout=blob.layout if first else "",
            offset=offset,
            total_bytes=total,
            data=part,
            crc32=blob.crc32 if first else 0,
            meta=blob.meta if first else None,
        )
        offset += len(part)
        if offset >= total:
            return
