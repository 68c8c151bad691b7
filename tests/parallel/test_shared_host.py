"""Host memory the processes of one host share (``runtime/shared_host.py``); the Engram tables of a worker of
several ranks in it: ``test_rank_group_v41.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deepinfer.runtime import shared_host


def test_a_tensor_another_process_maps_and_its_release(tmp_path) -> None:
    t = shared_host.tensor("k1", "t", (3, 4), torch.float32, where=tmp_path)
    t.copy_(torch.arange(12.0).view(3, 4))
    code = ("import sys, torch; from pathlib import Path; from deepinfer.runtime import shared_host; "
            "t = shared_host.tensor('k1', 't', (3, 4), torch.float32, where=Path(sys.argv[1])); "
            "print(float(t.sum())); t[0, 0] = 100.0")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert float(out.stdout) == 66.0 and float(t[0, 0]) == 100.0  # the same pages, both ways
    shared_host.release("k1", where=tmp_path)
    assert not list(tmp_path.iterdir())
    t[1, 1] = 7.0  # the mapping outlives the name
    assert float(t[1, 1]) == 7.0
    shared_host.release("k1", where=tmp_path)  # idempotent


def test_too_little_room_is_refused(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="--shm-size"):
        shared_host.check_room(2**62, where=tmp_path)
    with pytest.raises(RuntimeError, match="lacks"):
        shared_host.check_room(1, where=tmp_path / "absent")
    shared_host.check_room(1, where=tmp_path)
