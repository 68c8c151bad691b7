"""The model families the engine serves, looked up by config.json's ``model_type``.

Each family (:class:`~deepinfer.engine.model_api.ModelFamily`) parses its config, builds its model and makes the
engine-side objects of its state, so everything past this module treats every model alike. The built-in families
are listed in ``deepinfer.models.families`` as ``"module:attribute"`` strings and imported on first lookup (the
engine imports no model package by name); :func:`register` adds one (a third model, a test's fake).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.engine.model_api import ModelConfig, ModelFamily, ServedModel
from deepinfer.models.families import CONFIGS, DEFAULT_MODEL_TYPE, FAMILIES

if TYPE_CHECKING:  # (parsing a config loads no torch: the scheduler and the balancer read configs)
    import torch

_registered: dict[str, ModelFamily] = {}  # registered, or built-in ones already imported


def register(family: ModelFamily) -> None:
    """Serve ``family.model_type`` with ``family`` (in place of any family of that type)."""
    _registered[family.model_type] = family


def unregister(model_type: str) -> None:
    _registered.pop(model_type, None)


def known_model_types() -> list[str]:
    return sorted({*FAMILIES, *_registered})


def not_served(model_type: str) -> str:
    """Why ``model_type`` is refused (no family of this build serves it)."""
    return f"model_type {model_type!r} is not served by this build (known: {', '.join(known_model_types())})"


def family_for(model_type: str | None) -> ModelFamily:
    """The family of ``model_type`` (None: the default's); ValueError naming the known ones for any other."""
    model_type = model_type or DEFAULT_MODEL_TYPE
    family = _registered.get(model_type)
    if family is not None:
        return family
    if model_type not in FAMILIES:
        raise ValueError(not_served(model_type))
    module, _, attr = FAMILIES[model_type].partition(":")
    family = getattr(importlib.import_module(module), attr)
    _registered[model_type] = family
    return family


def model_type_of(raw: dict) -> str | None:
    """config.json's ``model_type`` (a composite config may carry it in ``text_config`` only)."""
    return raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")


def family_of(config: Any) -> ModelFamily:
    """The family of a parsed config (its ``model_type``)."""
    return family_for(config.model_type)


def parse_config(raw: dict) -> ModelConfig:
    """The config of the model in a parsed config.json, by its family (a built-in family's config class alone, so
    that no model code is imported: ``models.families.CONFIGS``)."""
    model_type = model_type_of(raw) or DEFAULT_MODEL_TYPE
    if model_type in CONFIGS and model_type not in _registered:
        module, _, attr = CONFIGS[model_type].partition(":")
        return getattr(importlib.import_module(module), attr).from_dict(raw)
    return family_for(model_type).parse_config(raw)


def build_model(
    path: Path, config: ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, quant_sim: bool | None
) -> ServedModel:
    """Construct the model of ``config``, load the checkpoint at ``path`` in ``dtype`` and move it to ``device``
    (``ModelFamily.build``; ``quant_sim`` None: the family's default)."""
    return family_of(config).build(path, config, ops, dtype, device, quant_sim)
