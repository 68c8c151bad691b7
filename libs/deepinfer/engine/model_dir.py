"""Where the served model is: its local directory and its parsed config, for every service that needs them (the
worker loads it; the scheduler and the balancer read its config and tokenizer, without torch)."""

from __future__ import annotations

from pathlib import Path

from deepinfer import envs
from deepinfer.checkpoint.hub import check_architecture, local_model, resolve_model
from deepinfer.engine.model_api import ModelConfig
from deepinfer.engine.models import parse_config


def _named(model: str | Path | None) -> str | Path | None:
    """``model``, or the settings' hub id where neither it nor ``DEEPINFER_HF_MODEL_DIR`` names the model."""
    return envs.DEEPINFER_MODEL if model is None and envs.DEEPINFER_HF_MODEL_DIR is None else model


def resolve_model_dir(model: str | Path | None) -> tuple[Path, ModelConfig]:
    """The model's local directory (downloading if ``model`` is a hub id) and its parsed config (by the family of
    config.json's ``model_type``)."""
    path = resolve_model(_named(model), envs.DEEPINFER_HF_MODEL_DIR, envs.DEEPINFER_CACHE_DIR)
    return path, parse_config(check_architecture(path))


def local_model_dir(model: str | Path | None) -> Path | None:
    """The directory ``resolve_model_dir`` takes ``model`` from when it is on this host already; None for a hub id
    (nothing is downloaded or parsed)."""
    return local_model(_named(model), envs.DEEPINFER_HF_MODEL_DIR)


__all__ = ["local_model_dir", "resolve_model_dir"]
