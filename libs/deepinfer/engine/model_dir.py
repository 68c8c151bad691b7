"""Where the served model is: its local directory and its parsed config, for every service that needs them (the
worker loads it; the scheduler and the balancer read its config and tokenizer, without torch)."""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs
from deepinfer.checkpoint.hub import check_architecture, resolve_model
from deepinfer.engine.model_api import ModelConfig
from deepinfer.engine.models import parse_config


def resolve_model_dir(model: str | Path | None) -> tuple[Path, ModelConfig]:
    """The model's local directory (downloading if ``model`` is a hub id) and its parsed config (by the family of
    config.json's ``model_type``)."""
    if model is None and envs.DEEPINFER_HF_MODEL_DIR is None:
        model = envs.DEEPINFER_MODEL
    path = resolve_model(model, envs.DEEPINFER_HF_MODEL_DIR, envs.DEEPINFER_CACHE_DIR)
    return path, parse_config(check_architecture(path))


__all__ = ["resolve_model_dir"]
