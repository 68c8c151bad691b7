"""The model families this build serves, by config.json's ``model_type``: where each one's
:class:`~deepinfer.engine.model_api.ModelFamily` lives (``"module:attribute"``, imported on first use, so that
looking one up loads no other). ``engine.models`` finds them here; a config.json without a ``model_type`` is
:data:`DEFAULT_MODEL_TYPE`'s."""

from __future__ import annotations

FAMILIES: dict[str, str] = {
    "deepseek_v4": "deepinfer.models.deepseek_v4.family:FAMILY",
    "deepseek_v41": "deepinfer.models.deepseek_v41.family:FAMILY",
}
# each family's config class (``from_dict``), importable without the model code or torch: what the scheduler and the
# balancer parse a config.json with (``engine.models.parse_config``); the family's own ``parse_config`` is the same
CONFIGS: dict[str, str] = {
    "deepseek_v4": "deepinfer.models.deepseek_v4.config:DeepseekV4Config",
    "deepseek_v41": "deepinfer.models.deepseek_v41.config:DeepseekV41Config",
}
DEFAULT_MODEL_TYPE = "deepseek_v4"
