"""Suite-wide settings: one torch thread (the tiny models' ops are too small to gain from more, and CI has 2
cores shared with subprocess tests); without a GPU, Triton kernels run in Triton's interpreter (set before
any module imports triton: ``@triton.jit`` reads it when a kernel is defined)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton_interpreter  # noqa: E402

triton_interpreter.patch()

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One tiny checkpoint per configuration of ``models.tiny_configs``."""
    from deepinfer.checkpoint.tiny import make_tiny_model
    from models.tiny_configs import CONFIGS

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(root / name, seed=i, overrides=o) for i, (name, o) in enumerate(CONFIGS.items())}
