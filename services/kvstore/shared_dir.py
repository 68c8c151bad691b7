"""The kvstore's shared directory: where the same-host path's files live (``deepinfer.kvstore.shared``).

``DEEPINFER_KVSTORE_SHARED_DIR``: ``auto`` (the default) makes a private directory under ``/dev/shm`` (mode 0700,
removed at exit; directories left by a kvstore that died are removed by the next one started on the host), ``off``
has none, and a path names one (created 0700 if missing), e.g. a tmpfs volume mounted into the kvstore's and the
workers' containers. The directory holds a probe file with a random content, which ``Describe`` returns: a client
that reads the same content there shares the directory (same host, same mount), else it streams.

Files a client wrote (``.put``) are taken by ``PutShared``; files written for a client (``.get``) are its to remove
once read. Either kind left behind (a client that died between writing and asking, or between asking and reading)
is removed once older than ``ttl_s`` (:meth:`SharedDir.sweep`, run with the store's sweep, and by a ``give``
that would pass the cap). Files waiting to be read hold at most ``cap_bytes``; past it ``give`` refuses and the
client streams.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from deepinfer.kvstore.shared import PROBE, check_name, map_taken, new_name, write_new
from deepinfer.telemetry import get_logger

__all__ = ["SharedDir", "SharedFull"]

log = get_logger(__name__)
AUTO_PARENT = Path("/dev/shm")
AUTO_PREFIX = "deepinfer-kvstore-"
_AUTO_NAME = re.compile(re.escape(AUTO_PREFIX) + r"(\d+)-\w+")
TTL_S = 60.0


class SharedFull(RuntimeError):
    """More bytes wait in files not yet read than the directory may hold: the client streams instead."""


class SharedDir:
    def __init__(self, path: Path, owned: bool, cap_bytes: int, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.path, self.owned, self.cap_bytes, self.ttl_s, self.clock = path, owned, cap_bytes, ttl_s, clock
        self.probe = secrets.token_hex(16)
        write_probe = path / f".{PROBE}.{self.probe}"
        write_probe.write_text(self.probe)
        os.replace(write_probe, path / PROBE)  # (a kvstore restarted on the same directory: a new probe)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[int, float]] = {}  # .get files written: name -> (bytes, written at)

    @classmethod
    def open(cls, setting: str, cap_bytes: int) -> SharedDir | None:
        """The directory ``DEEPINFER_KVSTORE_SHARED_DIR`` names (module docstring), or None."""
        if setting == "off":
            return None
        if setting == "auto":
            if not AUTO_PARENT.is_dir() or not os.access(AUTO_PARENT, os.W_OK):
                log.info("kvstore_shared_dir_off", reason=f"{AUTO_PARENT} is not a writable directory")
                return None
            _remove_orphans(AUTO_PARENT)
            path = Path(tempfile.mkdtemp(prefix=f"{AUTO_PREFIX}{os.getpid()}-", dir=AUTO_PARENT))
            return cls(path, True, cap_bytes)
        path = Path(setting).expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(path, False, cap_bytes)

    def take(self, name: str, size: int) -> object:
        """The bytes of the client's file ``name`` (``.put``), mapped without a copy; the file is gone afterwards.
        ``SharedFileError`` if it may not be used."""
        return map_taken(self.path, name, "put", size)

    def discard(self, name: str) -> None:
        """Remove the client's file ``name`` unread (its blob was refused)."""
        check_name(name, "put")
        (self.path / name).unlink(missing_ok=True)

    def give(self, data: object) -> str:
        """Write ``data`` to a new ``.get`` file for a client; its name. ``SharedFull`` past ``cap_bytes``."""
        size = len(data)  # type: ignore[arg-type]
        if self.waiting_bytes + size > self.cap_bytes:  # (files their clients removed count until a sweep)
            self.sweep()
        with self._lock:
            waiting = sum(n for n, _ in self._waiting.values())
            if waiting + size > self.cap_bytes:
                raise SharedFull(f"{waiting} bytes wait in files not yet read; {size} more exceed {self.cap_bytes}")
            name = new_name("get")
            self._waiting[name] = (size, self.clock())
        try:
            write_new(self.path, name, data)  # type: ignore[arg-type]
        except BaseException:
            with self._lock:
                self._waiting.pop(name, None)
            raise
        return name

    def sweep(self) -> int:
        """Forget the ``.get`` files their clients removed; remove files of either kind older than ``ttl_s``.
        Returns how many were removed."""
        now, removed = self.clock(), 0
        with self._lock:
            for name, (_, written) in list(self._waiting.items()):
                path = self.path / name
                if not path.exists():
                    del self._waiting[name]
                elif now - written > self.ttl_s:
                    path.unlink(missing_ok=True)
                    del self._waiting[name]
                    removed += 1
        for entry in os.scandir(self.path):
            if not entry.name.endswith(".put"):
                continue
            try:  # (a link or a FIFO left there goes too: the name is removed, never followed)
                if now - entry.stat(follow_symlinks=False).st_mtime > self.ttl_s:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:  # (gone meanwhile, or a directory)
                continue
        if removed:
            log.info("kvstore_shared_files_removed", files=removed, reason="not taken within ttl")
        return removed

    @property
    def waiting_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _ in self._waiting.values())

    def close(self) -> None:
        """Remove the directory (``auto``), or the probe and the files this kvstore wrote (a named one)."""
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with self._lock:
            for name in [PROBE, *self._waiting]:
                (self.path / name).unlink(missing_ok=True)
            self._waiting.clear()


def _remove_orphans(parent: Path) -> None:
    """Remove the ``auto`` directories of kvstores of this user that are no longer running."""
    for entry in os.scandir(parent):
        m = _AUTO_NAME.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("kvstore_shared_dir_orphan_removed", path=entry.path)
        except PermissionError:
            continue
