"""The disk tier's file format and directory: one file per blob, written atomically, checked on every read.

File layout (little-endian)::

    magic  b"DIKVBLOB"            8 bytes
    version                       u16  (FORMAT_VERSION)
    header length                 u32
    header crc32                  u32  (zlib.crc32 of the header bytes)
    header                        UTF-8 JSON: fingerprint, key (hex), resume_point, layout, meta, size, crc32,
                                  stored_at, last_access (unix seconds)
    payload                       ``size`` bytes, zlib.crc32 == header crc32

File names come only from hex digests (``<sha256(fingerprint)[:32]>-<key hex>-<r|p>.kvb``), never from
user-controlled text. A blob is written to a ``.tmp-*`` file in the same directory, fsynced, then renamed
over its final name, so a reader sees either the old file or the new one, never a half-written one.
Last access is persisted as the file's mtime (``os.utime``), so an access costs no rewrite; the index
takes the later of it and the header's ``last_access``. Any mismatch (magic, version, header checksum,
JSON, key, name, length, payload checksum) raises :class:`CorruptBlob`; the caller removes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from deepinfer.kvstore.blob import BlobKey, CorruptBlob

__all__ = ["FORMAT_VERSION", "MAGIC", "DiskDir", "Header", "ScanResult", "file_name"]

MAGIC = b"DIKVBLOB"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHII")
MAX_HEADER_BYTES = 1024 * 1024
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"


def file_name(key: BlobKey) -> str:
    """The blob's file name: hex digests only, so no part of it is a path the client controls."""
    fp = hashlib.sha256(key.fingerprint.encode()).hexdigest()[:32]
    return f"{fp}-{key.hex}-{'r' if key.resume_point else 'p'}{SUFFIX}"


@dataclass(frozen=True)
class Header:
    """The JSON header of a blob file."""

    key: BlobKey
    size: int
    crc32: int
    layout: str = ""
    meta: dict[str, str] = field(default_factory=dict)
    stored_at: float = 0.0
    last_access: float = 0.0

    def encode(self) -> bytes:
        """Prefix + JSON header: everything in the file before the payload."""
        body = json.dumps(
            {
                "fingerprint": self.key.fingerprint,
                "key": self.key.hex,
                "resume_point": self.key.resume_point,
                "layout": self.layout,
                "meta": self.meta,
                "size": self.size,
                "crc32": self.crc32,
                "stored_at": self.stored_at,
                "last_access": self.last_access,
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> Header:
        """Parse the JSON header; :class:`CorruptBlob` naming the first bad field."""
        try:
            raw: Any = json.loads(body)
        except ValueError as exc:
            raise CorruptBlob(f"header is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CorruptBlob("header is not a JSON object")
        try:
            key = BlobKey(_typed(raw, "fingerprint", str), bytes.fromhex(_typed(raw, "key", str)),
                          _typed(raw, "resume_point", bool))  # fmt: skip
        except ValueError as exc:
            raise CorruptBlob(f"header field key: {exc}") from None
        meta = _typed(raw, "meta", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CorruptBlob("header field meta: not a map of strings")
        size, crc = _typed(raw, "size", int), _typed(raw, "crc32", int)
        if size < 0 or not 0 <= crc < 2**32:
            raise CorruptBlob("header field size or crc32 out of range")
        stored_at, last_access = float(_typed(raw, "stored_at", float)), float(_typed(raw, "last_access", float))
        return cls(key, size, crc, _typed(raw, "layout", str), meta, stored_at, last_access)


def _typed(raw: dict[str, Any], name: str, kind: type) -> Any:
    value = raw.get(name)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise CorruptBlob(f"header field {name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptBlob(f"file truncated in the {what} ({len(data)} of {n} bytes)")
    return data


def _read_header(f: BinaryIO) -> tuple[Header, int]:
    """The header of an open blob file and the payload's offset."""
    magic, version, length, crc = _PREFIX.unpack(_read_exact(f, _PREFIX.size, "prefix"))
    if magic != MAGIC:
        raise CorruptBlob("bad magic: not a kvstore blob file")
    if version != FORMAT_VERSION:
        raise CorruptBlob(f"unsupported format version {version}")
    if length > MAX_HEADER_BYTES:
        raise CorruptBlob(f"header length {length} is implausible")
    body = _read_exact(f, length, "header")
    if zlib.crc32(body) != crc:
        raise CorruptBlob("header checksum mismatch")
    return Header.decode(body), _PREFIX.size + length


@dataclass(frozen=True)
class ScanResult:
    """One blob file found by :meth:`DiskDir.scan`: its header, or why it is unusable (``error``)."""

    path: Path
    header: Header | None
    file_bytes: int
    mtime: float
    error: str = ""


class DiskDir:
    """The data directory. Stateless apart from the path: the index of what is in it lives in the store."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: BlobKey) -> Path:
        return self.root / file_name(key)

    def write_temp(self, header: Header, data: bytes) -> Path:
        """Write header + payload to a temporary file beside the final one (fsynced); ``commit`` renames it."""
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header.encode())
                f.write(data)
                f.flush()
                os.utime(f.fileno(), (header.last_access, header.last_access))  # mtime = last access
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return Path(tmp)

    def commit(self, tmp: Path, key: BlobKey) -> int:
        """Atomically move a temporary file to ``key``'s name; returns the file's size."""
        final = self.path(key)
        os.replace(tmp, final)
        return final.stat().st_size

    def read(self, key: BlobKey) -> tuple[Header, bytes]:
        """Header and verified payload of ``key``'s file; ``FileNotFoundError`` if absent, else ``CorruptBlob``."""
        with open(self.path(key), "rb") as f:
            header, _ = _read_header(f)
            if header.key != key:
                raise CorruptBlob(f"header names another blob ({header.key}), not {key}")
            data = _read_exact(f, header.size, "payload")
            if f.read(1):
                raise CorruptBlob("trailing bytes after the payload")
        if zlib.crc32(data) != header.crc32:
            raise CorruptBlob(f"payload checksum mismatch (header {header.crc32:#010x}, data {zlib.crc32(data):#010x})")
        return header, data

    def remove(self, key: BlobKey) -> None:
        self.path(key).unlink(missing_ok=True)

    def touch(self, key: BlobKey, when: float) -> None:
        """Persist a last access as the file's mtime (best effort: a missing file is ignored)."""
        try:
            os.utime(self.path(key), (when, when))
        except OSError:
            pass

    def scan(self) -> Iterator[ScanResult]:
        """Every blob file with its header (payloads are not read); deletes leftover temporary files."""
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    Path(entry.path).unlink(missing_ok=True)  # a write that never committed
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    result = _scan_file(entry)
                    if result is not None:
                        yield result


def _scan_file(entry: os.DirEntry[str]) -> ScanResult | None:
    """The header of one blob file, or why it is unusable; ``None`` if it vanished or cannot be read."""
    path = Path(entry.path)
    try:
        st = entry.stat(follow_symlinks=False)
        with open(path, "rb") as f:
            header, offset = _read_header(f)
        if file_name(header.key) != entry.name:
            raise CorruptBlob("file name does not match the key in its header")
        if st.st_size != offset + header.size:
            raise CorruptBlob(f"file is {st.st_size} bytes, header says {offset + header.size}")
    except CorruptBlob as exc:
        return ScanResult(path, None, 0, 0.0, str(exc))
    except OSError:  # vanished or unreadable: not ours to judge
        return None
    return ScanResult(path, header, st.st_size, st.st_mtime)
