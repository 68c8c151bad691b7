"""Shared fixtures of the model tests: one tiny checkpoint per configuration of ``tiny_configs``."""

from __future__ import annotations

import pytest

from models.tiny_configs import CONFIGS


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from deepinfer.checkpoint.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(root / name, seed=i, overrides=o) for i, (name, o) in enumerate(CONFIGS.items())}
