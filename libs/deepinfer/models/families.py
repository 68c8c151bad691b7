"""The model families this build serves, by config.json's ``model_type``: where each one's
:class:`~deepinfer.engine.model_api.ModelFamily` lives (``"module:attribute"``, imported on first use, so that
looking one up loads no other). ``engine.models`` finds them here; a config.json without a ``model_type`` is
:data:`DEFAULT_MODEL_TYPE`'s."""

from __future__ import annotations

FAMILIES: dict[str, str] = {
    "deepseek_v4": "deepinfer.models.deepseek_v4.family:FAMILY",
    "deepseek_v41": "deepinfer.models.deepseek_v41.family:FAMILY",
}
DEFAULT_MODEL_TYPE = "deepseek_v4"
