"""DeepSeek-V4 model configuration, parsed from an HF-style ``config.json``.

Accepts both spellings found in the wild:
- official checkpoints: ``compress_ratios`` (one entry per layer, then one per MTP layer),
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``;
- transformers: ``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor``, ``rope_parameters`` = {"main": ..., "compress": ...}.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)

_LAYER_TYPE_NAMES = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class YarnParams:
    """YaRN on the compressed-attention rotary table (no attention factor, as the reference)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class CacheStore:
    """One paged store of long-term state: ``layer``'s compressed rows (``row_dim`` wide, one per ``ratio`` tokens)
    and, when ``index_dim`` > 0, its indexer keys (same row ids). Models describe theirs with ``cache_layout()``."""

    layer: int
    ratio: int
    row_dim: int
    index_dim: int = 0


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # one entry per trunk layer, then one per MTP layer: 0 = SWA, 4 (or any m with overlap) = CSA, else HCA
    compress_ratios: tuple[int, ...] = ()
    csa_ratio: int = 4
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnParams | None = field(default_factory=YarnParams)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"
    model_type: str = "deepseek_v4"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, need at least num_hidden_layers={n}"
            )
        if self.head_dim % 2 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must be divisible by o_groups")
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported (only 'sqrtsoftplus')")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok must be <= n_routed_experts")
        for r in self.compress_ratios:
            if r < 0:
                raise ValueError(f"compress_ratios entries must be >= 0, got {r}")

    # -- derived -------------------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        """Compression ratio of trunk layer ``layer`` (or MTP layer ``num_hidden_layers + k``)."""
        if layer < len(self.compress_ratios):
            return self.compress_ratios[layer]
        return 0

    def layer_kind(self, layer: int) -> str:
        r = self.ratio(layer)
        if r == 0:
            return "swa"
        return "csa" if r == self.csa_ratio else "hca"

    @property
    def mtp_layer_ids(self) -> list[int]:
        return [self.num_hidden_layers + k for k in range(self.num_nextn_predict_layers)]

    @property
    def compressed_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.ratio(i) > 0]

    @property
    def page_multiple(self) -> int:
        """A page (in tokens) must hold a whole number of rows of every compressed layer."""
        m = 1
        for r in set(self.compress_ratios):
            if r > 0:
                m = m * r // _gcd(m, r)
        return m

    def cache_layout(self) -> list[CacheStore]:
        """The paged stores of compressed state: one per compressed layer, index keys for CSA layers."""
        return [
            CacheStore(i, self.ratio(i), self.head_dim, self.index_head_dim if self.layer_kind(i) == "csa" else 0)
            for i in self.compressed_layers
        ]

    def min_replay(self) -> int:
        """The shortest bounded replay that rebuilds every compressor's pending tokens: ``2m - 1`` for a CSA
        compressor (its partial window and the complete one before it, for the overlap), ``m - 1`` for an HCA one."""
        need = 1
        for layer in self.compressed_layers:
            m = self.ratio(layer)
            need = max(need, 2 * m - 1 if self.layer_kind(layer) == "csa" else m - 1)
        return need

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    # -- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported yet (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        n = int(raw["num_hidden_layers"])
        kw: dict[str, Any] = {}
        for f in (
            "vocab_size hidden_size num_attention_heads head_dim q_lora_rank o_groups o_lora_rank "
            "sliding_window rope_theta compress_rope_theta max_position_embeddings index_n_heads "
            "index_head_dim index_topk n_routed_experts num_experts_per_tok n_shared_experts "
            "moe_intermediate_size scoring_func norm_topk_prob routed_scaling_factor swiglu_limit hc_mult "
            "hc_sinkhorn_iters hc_eps rms_norm_eps num_nextn_predict_layers bos_token_id eos_token_id"
        ).split():
            if raw.get(f) is not None:
                kw[f] = raw[f]
        kw["num_hidden_layers"] = n
        if "qk_rope_head_dim" in raw:
            kw["qk_rope_head_dim"] = int(raw["qk_rope_head_dim"])
        elif raw.get("partial_rotary_factor") is not None:
            kw["qk_rope_head_dim"] = int(raw.get("head_dim", 512) * raw["partial_rotary_factor"])
        n_mtp = int(raw.get("num_nextn_predict_layers", 1) or 0)
        rates = raw.get("compress_rates") or {}
        kw["csa_ratio"] = int(rates.get("compressed_sparse_attention", 4))
        if raw.get("compress_ratios") is not None:
            ratios = [int(r) for r in raw["compress_ratios"]]
        elif raw.get("layer_types") is not None:
            hca = int(rates.get("heavily_compressed_attention", 128))
            by_type = {"sliding_attention": 0, "compressed_sparse_attention": kw["csa_ratio"]}
            by_type["heavily_compressed_attention"] = hca
            unknown = sorted({t for t in raw["layer_types"] if t not in by_type})
            if unknown:
                raise ValueError(f"unknown layer_types {unknown} (expected one of {', '.join(by_type)})")
            ratios = [by_type[t] for t in raw["layer_types"]] + [0] * n_mtp
        else:
            raise ValueError("config.json carries neither compress_ratios nor layer_types")
        if len(ratios) < n:  # only the MTP entries may be left out (they default to sliding-window)
            raise ValueError(f"compress_ratios/layer_types have {len(ratios)} entries, need num_hidden_layers={n}")
        kw["compress_ratios"] = tuple(ratios[: n + n_mtp] + [0] * max(0, n + n_mtp - len(ratios)))
        if raw.get("num_hash_layers") is not None:
            kw["num_hash_layers"] = int(raw["num_hash_layers"])
        elif raw.get("mlp_layer_types") is not None:
            kw["num_hash_layers"] = sum(1 for t in raw["mlp_layer_types"] if t == "hash_moe")
        kw["yarn"] = _parse_yarn(raw)
        # transformers' nested rope_parameters carry the thetas it actually uses (top-level keys may be absent)
        rp = raw.get("rope_parameters")
        for sub, key in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
            if isinstance(rp, dict) and isinstance(rp.get(sub), dict) and rp[sub].get("rope_theta") is not None:
                kw[key] = float(rp[sub]["rope_theta"])
        q = raw.get("quantization_config") or {}
        if q.get("weight_block_size"):
            kw["weight_block_size"] = tuple(int(x) for x in q["weight_block_size"])
        kw["expert_dtype"] = str(raw.get("expert_dtype") or q.get("expert_dtype") or "fp4")
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _parse_yarn(raw: dict[str, Any]) -> YarnParams | None:
    rp = raw.get("rope_parameters")
    scaling = None
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        scaling = rp["compress"]
    elif isinstance(raw.get("rope_scaling"), dict):
        scaling = raw["rope_scaling"]
    elif isinstance(rp, dict):
        scaling = rp
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return None
    return YarnParams(
        factor=float(scaling.get("factor", 1.0)),
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", scaling.get("original_seq_len", 0))
        ),
        beta_fast=float(scaling.get("beta_fast", 32)),
        beta_slow=float(scaling.get("beta_slow", 1)),
    )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
