"""Suite-wide settings: one torch thread (the tiny models' ops are too small to gain from more, and CI has 2
cores shared with subprocess tests), in the subprocesses the tests start too (``OMP_NUM_THREADS``, inherited: a
benchmark's smoke run or a service beside another test worker's otherwise runs an OpenMP thread per core, and
oversubscribed threads spin: two such smoke runs side by side took 120 s against 32 s with a thread each); without
a GPU, Triton kernels run in Triton's interpreter (set before any module imports triton: ``@triton.jit`` reads it
when a kernel is defined)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch is imported, here and in every subprocess)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton_interpreter  # noqa: E402

triton_interpreter.patch()

torch.set_num_threads(1)

pytest_plugins = ["file_order"]  # the files longest first (tests/file_order.py)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One tiny checkpoint per configuration of ``models.tiny_configs``."""
    from deepinfer.checkpoint.tiny import make_tiny_model
    from models.tiny_configs import CONFIGS

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(root / name, seed=i, overrides=o) for i, (name, o) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_v41_dir(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The tiny random DeepSeek-V4.1 checkpoint (``make_tiny_model(arch="deepseek_v41")``, seed 0): every CSA2 layer
    kind, Engram, DSpark stages, a vision tower and the real DeepSeek tokenizer."""
    from deepinfer.checkpoint.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_v41") / "m", arch="deepseek_v41", seed=0)
