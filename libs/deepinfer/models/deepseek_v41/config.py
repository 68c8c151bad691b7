"""DeepSeek-V4.1 configuration, parsed from the composite HF ``config.json`` (docs/deepseek_v41.md ("Configuration")).

Top level ``model_type: deepseek_v41`` with ``text_config`` and ``vision_config``; field names are those of the
released config (= NeMo AutoModel's ``DeepseekV41TextConfig`` / ``DeepseekV41VisionConfig``), defaults the
released Flash values. Ratios here are CSA2 ratios {0, 1, 2}: never read them with V4's CSA/HCA logic. The
per-layer typing derived from the raw lists lives in :mod:`deepinfer.models.deepseek_v41.layout`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deepinfer.models.deepseek_v4.config import CacheStore, YarnParams

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"

_FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3


@dataclass(frozen=True)
class DeepseekV41TextConfig:
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: YarnParams | None = field(default_factory=YarnParams)
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    sliding_window: int = 128
    # one entry per backbone layer, then one per DSpark stage (mtp.0..): 0 = SWA-only, else the CSA2 ratio
    compress_ratios: tuple[int, ...] = _FLASH_RATIOS
    compress_rope_theta: float = 160000.0
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20  # -1 disables the hierarchical candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000  # start of the prime search, not a vocabulary
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = 2

    def __post_init__(self) -> None:
        _validate_text(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41TextConfig:
        mt = raw.get("model_type", "deepseek_v41_text")
        if mt != "deepseek_v41_text":
            raise ValueError(f"text_config.model_type must be 'deepseek_v41_text', got {mt!r}")
        kw = _known(cls, raw, exclude=("rope_scaling",))
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            if name in kw:
                kw[name] = _int_tuple(name, kw[name])
        for name in ("engram_num_embeddings", "dspark_target_layer_ids"):
            if name in kw:
                kw[name] = _int_tuple(name, kw[name])
        if "engram_layer_ids" in kw and "engram_num_embeddings" not in kw and not kw["engram_layer_ids"]:
            kw["engram_num_embeddings"] = ()
        if "rope_scaling" in raw:
            kw["rope_scaling"] = _parse_yarn(raw["rope_scaling"])
        elif isinstance(raw.get("rope_parameters"), dict):  # transformers 5 writes it so (NeMo's save_pretrained)
            kw["rope_scaling"] = _parse_yarn(raw["rope_parameters"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        y = self.rope_scaling
        d["rope_scaling"] = None if y is None else {"rope_type": "yarn", **y.__dict__}
        d["model_type"] = "deepseek_v41_text"
        return d

    @property
    def num_engram_hashes(self) -> int:
        """Row ids per token and Engram layer: n-gram sizes 2..max × heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads


@dataclass(frozen=True)
class DeepseekV41VisionConfig:
    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "intermediate_size", "patch_size", "downsample_ratio"):
            _positive_int(f"vision_config.{name}", getattr(self, name))
        for name in ("max_image_tokens", "min_pixels"):
            _positive_int(f"vision_config.{name}", getattr(self, name))
        if type(self.num_hidden_layers) is not int or self.num_hidden_layers < 0:
            raise ValueError(f"vision_config.num_hidden_layers must be an integer >= 0, got {self.num_hidden_layers!r}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                "vision_config.hidden_size / num_attention_heads must be an integer divisible by 4 (2D RoPE), "
                f"got {self.hidden_size} / {self.num_attention_heads}"
            )
        _positive_float("vision_config.rope_theta", self.rope_theta)
        if self.max_wh_ratio is not None and not (math.isfinite(self.max_wh_ratio) and self.max_wh_ratio >= 1):
            raise ValueError(f"vision_config.max_wh_ratio must be null or >= 1, got {self.max_wh_ratio!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41VisionConfig:
        mt = raw.get("model_type", "deepseek_v41_vision")
        if mt != "deepseek_v41_vision":
            raise ValueError(f"vision_config.model_type must be 'deepseek_v41_vision', got {mt!r}")
        return cls(**_known(cls, raw))


@dataclass(frozen=True)
class DeepseekV41Config:
    """The composite checkpoint config: text backbone, vision tower, image token, quantization."""

    text_config: DeepseekV41TextConfig = field(default_factory=DeepseekV41TextConfig)
    vision_config: DeepseekV41VisionConfig = field(default_factory=DeepseekV41VisionConfig)
    image_token_id: int = 129264
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = 2
    tie_word_embeddings: bool = False
    weight_block_size: tuple[int, int] = (32, 32)  # dense FP8 tensors only (not experts, not Engram tables)
    expert_dtype: str = "fp4"
    scale_fmt: str = "ue8m0"
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be false for DeepSeek-V4.1 (separate embed and head)")
        if not 0 <= self.image_token_id < self.text_config.vocab_size:
            raise ValueError(
                f"image_token_id {self.image_token_id} lies outside "
                f"text_config.vocab_size={self.text_config.vocab_size}"
            )
        if self.expert_dtype not in ("fp4", "fp8", "bf16"):
            raise ValueError(f"quantization_config.expert_dtype must be fp4, fp8 or bf16, got {self.expert_dtype!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41Config:
        mt = raw.get("model_type")
        if mt != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {mt!r}")
        archs = raw.get("architectures")
        if archs is not None and ARCHITECTURE not in archs:
            raise ValueError(f"architectures must contain {ARCHITECTURE!r}, got {archs!r}")
        for key in ("text_config", "vision_config"):
            if not isinstance(raw.get(key, {}), dict):
                raise ValueError(f"{key} must be a JSON object, got {type(raw[key]).__name__}")
        kw: dict[str, Any] = _known(cls, raw, exclude=("text_config", "vision_config", "model_type"))
        kw["text_config"] = DeepseekV41TextConfig.from_dict(raw.get("text_config") or {})
        kw["vision_config"] = DeepseekV41VisionConfig.from_dict(raw.get("vision_config") or {})
        q = raw.get("quantization_config") or {}
        if q.get("weight_block_size"):
            kw["weight_block_size"] = _int_tuple("quantization_config.weight_block_size", q["weight_block_size"])
            if len(kw["weight_block_size"]) != 2:
                raise ValueError(
                    f"quantization_config.weight_block_size must have 2 entries, got {q['weight_block_size']}"
                )
        for key in ("expert_dtype", "scale_fmt"):
            if q.get(key) is not None:
                kw[key] = str(q[key])
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Config:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    # -- what the engine reads (the same names as the V4 config) -------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text_config.max_position_embeddings

    def cache_layout(self) -> list[CacheStore]:
        """Paged stores: each KV-source (Full) layer's compressed rows and index keys (docs/deepseek_v41.md
        ("Inference state per layer"))."""
        t = self.text_config
        return [CacheStore(i, t.compress_ratios[i], t.head_dim, t.index_head_dim) for i in t.kv_source_layer_ids]

    @property
    def page_multiple(self) -> int:
        return math.lcm(1, *(s.ratio for s in self.cache_layout()))

    def min_replay(self) -> int:
        """A bounded replay must rebuild the pending half group of every ratio-2 owner."""
        return max([1] + [s.ratio - 1 for s in self.cache_layout()])


# -- helpers ---------------------------------------------------------------------------------------------------
def _known(cls: type, raw: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of ``raw`` that are fields of ``cls`` (unknown checkpoint metadata is ignored)."""
    names = {f.name for f in fields(cls)} - set(exclude)
    return {k: v for k, v in raw.items() if k in names and not (v is None and k != "pad_token_id")}


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(type(v) is not int for v in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(value)


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")


def _parse_yarn(rs: Any) -> YarnParams | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"text_config.rope_scaling must be an object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"text_config.rope_scaling.rope_type must be 'yarn' or 'default', got {kind!r}")
    d = YarnParams()
    return YarnParams(
        factor=float(rs.get("factor", d.factor)),
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", d.original_max_position_embeddings)
        ),
        beta_fast=float(rs.get("beta_fast", d.beta_fast)),
        beta_slow=float(rs.get("beta_slow", d.beta_slow)),
    )


def _validate_text(c: DeepseekV41TextConfig) -> None:
    """The checks of NeMo's DeepseekV41TextConfig, each naming the offending field."""
    p = "text_config."
    for name in (
        "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim q_lora_rank "
        "o_lora_rank o_groups n_routed_experts num_experts_per_tok sliding_window index_n_heads index_head_dim "
        "index_topk hc_mult hc_sinkhorn_iters max_position_embeddings"
    ).split():
        _positive_int(p + name, getattr(c, name))
    for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        _positive_float(p + name, getattr(c, name))
    if c.num_key_value_heads != 1:
        raise ValueError(f"{p}num_key_value_heads must be 1 (shared K=V latent), got {c.num_key_value_heads!r}")
    if c.n_shared_experts != 1:
        raise ValueError(f"{p}n_shared_experts must be 1, got {c.n_shared_experts!r}")
    if c.num_attention_heads % c.o_groups:
        raise ValueError(f"{p}o_groups={c.o_groups} must divide num_attention_heads={c.num_attention_heads}")
    r = c.qk_rope_head_dim
    if type(r) is not int or r <= 0 or r % 2 or r > min(c.head_dim, c.index_head_dim):
        raise ValueError(f"{p}qk_rope_head_dim must be positive, even and <= head_dim and index_head_dim, got {r!r}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(f"{p}num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts")
    if c.scoring_func != "sqrtsoftplus":
        raise ValueError(f"{p}scoring_func must be 'sqrtsoftplus', got {c.scoring_func!r}")
    if type(c.num_nextn_predict_layers) is not int or c.num_nextn_predict_layers < 0:
        raise ValueError(f"{p}num_nextn_predict_layers must be an integer >= 0, got {c.num_nextn_predict_layers!r}")
    if type(c.dspark_block_size) is not int or c.dspark_block_size < 0:
        raise ValueError(f"{p}dspark_block_size must be an integer >= 0, got {c.dspark_block_size!r}")
    _validate_schedule(c)
    _validate_engram(c)


def _validate_schedule(c: DeepseekV41TextConfig) -> None:
    p = "text_config."
    n, ratios = c.num_hidden_layers, c.compress_ratios
    total = n + c.num_nextn_predict_layers
    if len(ratios) < total:
        raise ValueError(
            f"{p}compress_ratios has {len(ratios)} entries, "
            f"needs num_hidden_layers + num_nextn_predict_layers = {total}"
        )
    if any(x not in (0, 1, 2) for x in ratios):
        raise ValueError(f"{p}compress_ratios entries must be CSA2 ratios 0, 1 or 2, got {list(ratios)}")
    if any(ratios[i] for i in range(n, total)):
        raise ValueError(f"{p}compress_ratios: DSpark layers {n}..{total - 1} must be SWA-only (ratio 0)")
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(c, name)
        if any(i < 0 for i in ids) or list(ids) != sorted(set(ids)):
            raise ValueError(f"{p}{name} must be strictly increasing non-negative layer ids, got {list(ids)}")
        if any(i >= len(ratios) for i in ids):
            raise ValueError(f"{p}{name} refers to layers beyond compress_ratios ({len(ratios)} entries): {list(ids)}")
    if not set(c.kv_source_layer_ids) <= set(c.index_source_layer_ids):
        raise ValueError(f"{p}kv_source_layer_ids must be a subset of index_source_layer_ids")
    owner_ratio = None
    for i in range(n):
        is_src = i in c.kv_source_layer_ids
        if ratios[i] == 0:
            if is_src or i in c.index_source_layer_ids:
                raise ValueError(f"{p}kv/index_source_layer_ids: SWA-only layer {i} (ratio 0) cannot be a source")
            continue
        if is_src:
            owner_ratio = ratios[i]
        if owner_ratio != ratios[i]:
            raise ValueError(
                f"{p}compress_ratios: compressed layer {i} (ratio {ratios[i]}) has no preceding KV source "
                "(kv_source_layer_ids) with the same ratio"
            )
    cand = c.candidate_source_layer_id
    if type(cand) is not int or cand < -1:
        raise ValueError(f"{p}candidate_source_layer_id must be -1 (disabled) or a layer id, got {cand!r}")
    if cand >= 0:
        if cand not in c.kv_source_layer_ids:
            raise ValueError(f"{p}candidate_source_layer_id={cand} must be one of kv_source_layer_ids")
        _positive_int(p + "candidate_block_size", c.candidate_block_size)
        _positive_int(p + "candidate_topk_blocks", c.candidate_topk_blocks)
        later = [i for i in c.kv_source_layer_ids if cand < i < n]
        if later:  # the candidate pool indexes the candidate source's compressed rows
            raise ValueError(f"{p}kv_source_layer_ids {later} follow candidate_source_layer_id={cand}")
    if any(i >= n for i in c.dspark_target_layer_ids if c.num_nextn_predict_layers):
        raise ValueError(
            f"{p}dspark_target_layer_ids must be backbone layers < {n}, got {list(c.dspark_target_layer_ids)}"
        )


def _validate_engram(c: DeepseekV41TextConfig) -> None:
    p = "text_config."
    if len(c.engram_layer_ids) != len(c.engram_num_embeddings):
        raise ValueError(
            f"{p}engram_num_embeddings needs one row count per engram_layer_ids entry, "
            f"got {list(c.engram_num_embeddings)} for {list(c.engram_layer_ids)}"
        )
    for rows in c.engram_num_embeddings:
        _positive_int(p + "engram_num_embeddings[]", rows)
    if not c.engram_layer_ids:
        return
    for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
        _positive_int(p + name, getattr(c, name))
    if type(c.engram_max_ngram_size) is not int or c.engram_max_ngram_size < 2:
        raise ValueError(f"{p}engram_max_ngram_size must be an integer >= 2, got {c.engram_max_ngram_size!r}")
    if c.engram_vocab_size < 2:
        raise ValueError(f"{p}engram_vocab_size must be >= 2, got {c.engram_vocab_size!r}")
    if not 0 <= c.engram_pad_token_id < c.vocab_size:
        raise ValueError(f"{p}engram_pad_token_id={c.engram_pad_token_id} lies outside vocab_size={c.vocab_size}")
