"""What the kvstore stores: a blob under a :class:`BlobKey`, its checks, and the errors of the store.

A key is ``(model fingerprint, hash bytes, resume_point)``: the same hash stored for another fingerprint is
another blob (a fingerprint mismatch is simply not found). :func:`check_blob` holds every per-blob rule of
``Put``; a blob that breaks one is refused with a :class:`BlobRefused` whose ``reason`` is a short label
(also the metric label) and whose message names the field.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "MAX_FINGERPRINT_CHARS",
    "MAX_HASH_BYTES",
    "MAX_LAYOUT_CHARS",
    "MAX_META_BYTES",
    "Blob",
    "BlobKey",
    "BlobNotFound",
    "BlobRefused",
    "CorruptBlob",
    "Tier",
    "check_blob",
    "check_key",
]

MAX_HASH_BYTES = 64
MAX_FINGERPRINT_CHARS = 256
MAX_LAYOUT_CHARS = 128
MAX_META_BYTES = 16 * 1024  # keys + values, UTF-8: meta is "small facts", published in every KV event


class Tier(StrEnum):
    """Where a blob lives; the value is the label used in metrics and KV events."""

    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class BlobKey:
    """The identity of one blob."""

    fingerprint: str
    hash: bytes
    resume_point: bool = True

    @property
    def hex(self) -> str:
        return self.hash.hex()

    def __str__(self) -> str:  # for log lines and refusal messages (never the whole fingerprint)
        return f"{self.hex[:16]}{'…' if len(self.hash) > 8 else ''}{'/rp' if self.resume_point else ''}"


@dataclass(frozen=True)
class Blob:
    """One stored payload with what the writer said about it (``crc32`` is ``zlib.crc32`` of ``data``)."""

    key: BlobKey
    data: bytes | memoryview  # (a client's get on the same-host path: a read-only view of the mapped file)
    layout: str = ""
    meta: dict[str, str] = field(default_factory=dict)
    crc32: int = 0

    @classmethod
    def build(cls, key: BlobKey, data: bytes, layout: str = "", meta: dict[str, str] | None = None) -> Blob:
        """A blob with its checksum computed."""
        return cls(key, data, layout, dict(meta or {}), zlib.crc32(data))


class BlobRefused(ValueError):
    """A blob ``Put`` does not accept; ``reason`` is a short label (``bad_key``, ``too_large``, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BlobNotFound(LookupError):
    """No blob under this key (or it expired)."""


class CorruptBlob(RuntimeError):
    """A stored blob failed its header or checksum check; it has been removed and is never served."""


def check_key(fingerprint: str, key_hash: bytes) -> None:
    """``BlobRefused`` unless the fingerprint and the hash are acceptable identities."""
    if not fingerprint:
        raise BlobRefused("bad_fingerprint", "model_fingerprint: must not be empty")
    if len(fingerprint) > MAX_FINGERPRINT_CHARS:
        raise BlobRefused("bad_fingerprint", f"model_fingerprint: longer than {MAX_FINGERPRINT_CHARS} characters")
    if not key_hash:
        raise BlobRefused("bad_key", "key.hash: must not be empty")
    if len(key_hash) > MAX_HASH_BYTES:
        raise BlobRefused("bad_key", f"key.hash: {len(key_hash)} bytes, at most {MAX_HASH_BYTES} allowed")


def check_blob(key: BlobKey, layout: str, meta: dict[str, str], total_bytes: int, max_blob_bytes: int) -> None:
    """Every rule a blob's first chunk can be checked against (the checksum is checked once all data is in)."""
    check_key(key.fingerprint, key.hash)
    if total_bytes <= 0:
        raise BlobRefused("empty", "total_bytes: an empty blob is not stored")
    if total_bytes > max_blob_bytes:
        raise BlobRefused("too_large", f"total_bytes: {total_bytes} exceeds the limit of {max_blob_bytes} bytes")
    if len(layout) > MAX_LAYOUT_CHARS:
        raise BlobRefused("bad_meta", f"layout: longer than {MAX_LAYOUT_CHARS} characters")
    if sum(len(k.encode()) + len(v.encode()) for k, v in meta.items()) > MAX_META_BYTES:
        raise BlobRefused("bad_meta", f"meta: larger than {MAX_META_BYTES} bytes")
