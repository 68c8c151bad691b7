"""Host memory the processes of one host share: tensors backed by files in ``/dev/shm`` that every process maps
(``torch.from_file(..., shared=True)``), named by a key the processes agree on.

A worker of several ranks keeps DeepSeek-V4.1's Engram tables (hundreds of GiB in host memory with
``DEEPINFER_ENGRAM_TABLES=host``) there once per host instead of once per rank: one rank fills them, the others map
the same pages. Once every process has mapped them, ``release`` removes the files' names; the memory stays until
the last process unmaps it (exits), so nothing is left behind in ``/dev/shm``. A process killed between the two
leaves its files (``deepinfer-<key>-*``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

SHM = Path("/dev/shm")


def check_room(num_bytes: int, where: Path = SHM) -> None:
    """Raise unless ``where`` exists and has ``num_bytes`` free (a container's ``/dev/shm`` is often 64 MiB)."""
    if not where.is_dir():
        raise RuntimeError(f"shared host memory needs {where}, which this host lacks")
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < num_bytes:
        raise RuntimeError(f"shared host memory: {num_bytes / 2**30:.2f} GiB needed in {where}, {free / 2**30:.2f} GiB "
                           "free (a container: raise its shm size, e.g. docker --shm-size)")  # fmt: skip


def tensor(key: str, name: str, shape: Sequence[int], dtype: torch.dtype, where: Path = SHM) -> torch.Tensor:
    """The shared tensor ``name`` of ``key``, created zeroed by the first process to map it."""
    path = where / f"deepinfer-{key}-{name}"
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(*shape)


def release(key: str, where: Path = SHM) -> None:
    """Remove the names of ``key``'s files (mapped memory stays until unmapped). Idempotent."""
    for path in where.glob(f"deepinfer-{key}-*"):
        path.unlink(missing_ok=True)


def mapping_of(t: torch.Tensor) -> str | None:
    """The file of this module's that ``t``'s memory maps (as this process's memory map names it), else None."""
    ptr = t.data_ptr()
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 and "/deepinfer-" in fields[5] else None
    return None


__all__ = ["SHM", "check_room", "mapping_of", "release", "tensor"]
