"""The files of the kvstore's same-host path, as both sides handle them (``PutShared`` / ``GetShared``).

On one host a blob need not cross gRPC: the writer puts its bytes in a file of the kvstore's shared directory (a
tmpfs, so the file is memory) and sends only the header and the file's name; the reader takes the file and removes
it. A name is never a path: 32 hex digits and ``.put`` (the client wrote it) or ``.get`` (the kvstore did), so a
name cannot leave the directory. Whoever takes a file opens it without following a symbolic link and without
blocking on a FIFO, removes its name at once, and refuses it unless it is a plain file of the announced size that
no other name links to (a hard link into the directory cannot make the kvstore read another file).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from pathlib import Path

__all__ = [
    "PROBE",
    "SharedFileError",
    "check_name",
    "map_taken",
    "new_name",
    "probe_matches",
    "read_taken",
    "take",
    "write_new",
]

PROBE = "probe"  # the file whose content Describe returns: a reader of the same content shares the directory
_NAME = re.compile(r"[0-9a-f]{32}\.(put|get)")


class SharedFileError(ValueError):
    """A shared file that may not be used; the message starts with the field (``file`` or ``total_bytes``)."""


def new_name(kind: str) -> str:
    """A fresh file name: ``kind`` is ``put`` or ``get``."""
    return f"{secrets.token_hex(16)}.{kind}"


def check_name(name: str, kind: str) -> None:
    """``SharedFileError`` unless ``name`` is a file name of this kind (never a path)."""
    if not _NAME.fullmatch(name) or not name.endswith("." + kind):
        raise SharedFileError(f"file: {name[:80]!r} is not a shared file name (32 hex digits and .{kind})")


def write_new(directory: str | Path, name: str, data: bytes | memoryview | mmap.mmap) -> None:
    """Create ``directory/name`` (it must not exist; mode 0600) holding ``data``; a partial file is removed."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        _remove(path)
        raise
    os.close(fd)


def take(directory: str | Path, name: str, kind: str, size: int) -> int:
    """Open ``directory/name`` for reading and remove its name; the open descriptor, or ``SharedFileError`` (the
    name is removed then too) unless it is a plain file of ``size`` bytes with no other link."""
    check_name(name, kind)
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SharedFileError(f"file: {name} is not in the shared directory") from None
    except OSError as exc:  # ELOOP: a symbolic link
        _remove(path)
        raise SharedFileError(f"file: {name} cannot be opened as a plain file ({exc.strerror})") from None
    _remove(path)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = f"file: {name} is not a plain file"
    elif st.st_nlink != 0:
        problem = f"file: {name} has another link"
    elif st.st_size != size:
        problem = f"total_bytes: {size}, but {name} holds {st.st_size} bytes"
    if problem is not None:
        os.close(fd)
        raise SharedFileError(problem)
    return fd


def read_taken(directory: str | Path, name: str, kind: str, size: int) -> bytes:
    """The bytes of a file (``take``), read whole."""
    fd = take(directory, name, kind, size)
    try:
        parts, got = [], 0
        while got < size:
            part = os.read(fd, size - got)
            if not part:
                raise SharedFileError(f"total_bytes: {name} ended after {got} of {size} bytes")
            parts.append(part)
            got += len(part)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def map_taken(directory: str | Path, name: str, kind: str, size: int) -> mmap.mmap:
    """The bytes of a file (``take``), mapped read-only: no copy (the memory is freed once the map is dropped)."""
    fd = take(directory, name, kind, size)
    try:
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def probe_matches(directory: str, probe: str) -> bool:
    """Whether this process reads ``probe`` in ``directory``'s probe file: it shares the kvstore's directory."""
    if not directory or not probe:
        return False
    try:
        fd = os.open(os.path.join(directory, PROBE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            return os.read(fd, 256).decode(errors="replace") == probe
        finally:
            os.close(fd)
    except OSError:
        return False


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
