"""The architectures the engine serves, picked by config.json's ``model_type``: DeepSeek-V4 and DeepSeek-V4.1.

Both models present the same engine interface — ``model(ForwardBatch, PagedKVCache) -> hidden [T, D]``,
``model.logits(rows) -> fp32``, ``model.config`` (``vocab_size``, ``eos_token_id``, ``max_position_embeddings``,
``cache_layout()``, ``page_multiple``, ``min_replay()``) and ``set_quant_sim`` — so everything past this module treats
them alike. V4.1 only: the Engram token map comes from the checkpoint's tokenizer, its cache formats (FP8 window, FP4
compressed rows and index keys; docs/deepseek_v41.md ("Cache formats")) are part of the released model and stay on, and
prompt chunks may run the decoder layers on their tail only (``SeqChunk.decoder_from``; V4 ignores it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import torch

from deepinfer import envs
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.layers import set_w8a8
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v41.config import MODEL_TYPE as V41_MODEL_TYPE
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.ops import Ops
from deepinfer.quant.native import prepare_native
from deepinfer.quant.w4a8 import set_w4a8

ModelConfig: TypeAlias = DeepseekV4Config | DeepseekV41Config
Model: TypeAlias = DeepseekV4Model | DeepseekV41Model


def model_type_of(raw: dict) -> str | None:
    """config.json's ``model_type`` (a composite config may carry it in ``text_config`` only)."""
    return raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")


def parse_config(raw: dict) -> ModelConfig:
    """The config of either architecture from a parsed config.json."""
    if model_type_of(raw) == V41_MODEL_TYPE:
        return DeepseekV41Config.from_dict(raw)
    return DeepseekV4Config.from_dict(raw)


def is_v41(config: ModelConfig) -> bool:
    return isinstance(config, DeepseekV41Config)


def build_model(
    path: Path, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device, quant_sim: bool | None
) -> Model:
    """Construct the model of ``config``, load the checkpoint at ``path`` in ``dtype`` and move it to ``device``.
    With ``ops.native_weights`` the FP8 linears and MXFP4 experts stay in their stored formats (``quant.native``),
    then ``ops.prepare_weights`` arranges them for its kernels.

    ``quant_sim``: V4 simulates the official quantisation points only when asked (``DEEPINFER_QUANT_SIM`` when
    None); V4.1 keeps its cache formats on unless ``quant_sim`` is explicitly False (the variable does not apply)."""
    if isinstance(config, DeepseekV41Config):
        from deepinfer.checkpoint.engram_vocab import engram_token_map_of
        from deepinfer.checkpoint.loader_v41 import load_v41_checkpoint

        has_engram = bool(config.text_config.engram_layer_ids)
        token_map = engram_token_map_of(path)[0] if has_engram else None
        with torch.device("meta"):  # nothing allocated until the loader fills it (Flash: 552B parameters)
            net: Model = DeepseekV41Model(config, ops, token_map)
            if getattr(ops, "native_weights", False):
                prepare_native(net, tuple(config.weight_block_size), quantize=False)
        load_v41_checkpoint(net, path, dtype)
        net.to(device)
        set_w8a8(net, envs.DEEPINFER_W8A8)  # before prepare_weights: projections join only with equal roundings
        set_w4a8(net, envs.DEEPINFER_W4A8)  # before prepare_weights: W4A8 experts keep their codes as stored
        ops.prepare_weights(net)
        net.set_quant_sim(quant_sim is not False)
        return net
    from deepinfer.checkpoint.loader import load_checkpoint

    net = DeepseekV4Model(config, ops)
    if getattr(ops, "native_weights", False):
        prepare_native(net, tuple(config.weight_block_size), quantize=False)
    load_checkpoint(net, path, dtype=dtype)
    net.to(device)
    sim = envs.DEEPINFER_QUANT_SIM if quant_sim is None else quant_sim
    set_w8a8(net, envs.DEEPINFER_W8A8)
    set_w4a8(net, envs.DEEPINFER_W4A8)
    net.set_quant_sim(sim)  # before prepare_weights, which joins projections of equal activation roundings
    ops.prepare_weights(net)
    return net
