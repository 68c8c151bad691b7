"""DeepSeek-V4.1 tensor names and storage formats: the released checkpoint ↔ our modules
(docs/deepseek_v41.md ("Checkpoint names and formats")).

Released names (the official inference tree; NeMo AutoModel's ``DeepseekV41StateDictAdapter`` reads and writes
exactly these) are the canonical checkpoint form. Our parameters differ in three places only:

- routed experts are stacked: ``ffn.experts.{j}.w{1,2,3}.weight`` → ``ffn.w{1,2,3}`` ``[E, out, in]`` row ``j``;
- shared expert: ``ffn.shared_experts.w{1,2,3}.weight`` → ``ffn.shared_w{1,2,3}.weight``;
- mHC mixers: ``hc_attn_{fn,base,scale}`` / ``hc_ffn_*`` → ``hc_attn.{fn,base,scale}`` / ``hc_ffn.*``.

``expected_tensors(config)`` lists every released tensor of a config (logical shape + storage kind), derived from
:func:`~deepinfer.models.deepseek_v41.layout.layer_specs`; the tiny writer and the loader both use it.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from deepinfer.models.deepseek_v41.layout import LayerSpec, layer_specs

# bf16 / fp32: stored as is. fp8: e4m3 + UE8M0 scale per 32×32 block (dense). mxfp4: packed e2m1 int8 [out, in/2] +
# UE8M0 scale per row and 32 columns. fp8_row: e4m3 + UE8M0 scale per row and 32 columns (Engram tables).
Kind = Literal["bf16", "fp32", "fp8", "mxfp4", "fp8_row"]
QUANTIZED: tuple[Kind, ...] = ("fp8", "mxfp4", "fp8_row")


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]  # logical (dequantized) shape
    kind: Kind

    def stored(self, name: str, block: tuple[int, int] = (32, 32)) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The on-disk tensors of released weight ``name``: (name, shape, dtype), the scale after the weight."""
        if self.kind in ("bf16", "fp32"):
            return [(name, self.shape, torch.bfloat16 if self.kind == "bf16" else torch.float32)]
        rows, cols = self.shape
        scale = name.removesuffix(".weight") + ".scale"
        if self.kind == "fp8":
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            return [(name, self.shape, torch.float8_e4m3fn), (scale, grid, torch.float8_e8m0fnu)]
        if self.kind == "mxfp4":
            return [(name, (rows, cols // 2), torch.int8), (scale, (rows, cols // 32), torch.float8_e8m0fnu)]
        return [(name, self.shape, torch.float8_e4m3fn), (scale, (rows, -(-cols // 32)), torch.float8_e8m0fnu)]


# -- released ↔ internal ------------------------------------------------------------------------------------------
_EXPERT = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"^(.*\.ffn)\.shared_experts\.(w[123])\.weight$")
_HC = re.compile(r"^(.*)\.hc_(attn|ffn)_(fn|base|scale)$")
_INT_EXPERT = re.compile(r"^(.*\.ffn)\.(w[123])$")
_INT_SHARED = re.compile(r"^(.*\.ffn)\.shared_(w[123])\.weight$")
_INT_HC = re.compile(r"^(.*)\.hc_(attn|ffn)\.(fn|base|scale)$")


def released_to_internal(name: str) -> tuple[str, int | None]:
    """Our parameter path for a released weight name, plus the expert index of a routed expert."""
    if m := _EXPERT.match(name):
        return f"{m[1]}.{m[3]}", int(m[2])
    if m := _SHARED.match(name):
        return f"{m[1]}.shared_{m[2]}.weight", None
    if m := _HC.match(name):
        return f"{m[1]}.hc_{m[2]}.{m[3]}", None
    return name, None


def internal_to_released(name: str, expert: int | None = None) -> str:
    """The released name of our parameter ``name`` (``expert`` selects a row of a stacked expert tensor)."""
    if m := _INT_EXPERT.match(name):
        if expert is None:
            raise ValueError(f"{name} is a stacked expert tensor: an expert index is required")
        return f"{m[1]}.experts.{expert}.{m[2]}.weight"
    if expert is not None:
        raise ValueError(f"{name} is not a stacked expert tensor, got expert index {expert}")
    if m := _INT_SHARED.match(name):
        return f"{m[1]}.shared_experts.{m[2]}.weight"
    if m := _INT_HC.match(name):
        return f"{m[1]}.hc_{m[2]}_{m[3]}"
    return name


def is_stacked_expert(internal_name: str) -> bool:
    return _INT_EXPERT.match(internal_name) is not None


# parameters the reference keeps in fp32 whatever the model dtype: mHC mixers, sinks, router biases, the compressor
# projections, the output head, the DSpark confidence head (NeMo) and every RMSNorm weight (lossless from bf16)
_FP32 = re.compile(
    r"(\.hc_(attn|ffn)[._](fn|base|scale)|\.attn_sink|\.gate\.bias(_vl)?|compressor\.w(kv|gate)\.weight"
    r"|^head\.weight|confidence_head\.proj\.weight|norm\d?\.weight)$"
)


def keeps_fp32(name: str) -> bool:
    """True for tensors (internal or released name) loaded in fp32 whatever the model dtype."""
    return _FP32.search(name) is not None


# -- expected tensors -----------------------------------------------------------------------------------------------
# On-disk kinds. NeMo holds the head and the compressor projections in fp32, but the released Flash checkpoint's size
# (475.2 GiB, 96,085 tensors [TRT]) is only met with both stored bf16 (fp32 head: 476.5 GiB); the loader widens them.
def _block(
    out: dict[str, TensorSpec], p: str, c: DeepseekV41TextConfig, spec: LayerSpec, n_experts: int, expert: Kind
) -> None:
    """The tensors of one transformer block (backbone layer or DSpark stage) under prefix ``p``."""
    d, hc, hd = c.hidden_size, c.hc_mult, c.head_dim
    h, g, inter = c.num_attention_heads, c.o_groups, c.moe_intermediate_size
    mix = (2 + hc) * hc
    out[p + "attn_norm.weight"] = TensorSpec((d,), "bf16")
    out[p + "ffn_norm.weight"] = TensorSpec((d,), "bf16")
    for sub in ("attn", "ffn"):
        out[f"{p}hc_{sub}_fn"] = TensorSpec((mix, hc * d), "fp32")
        out[f"{p}hc_{sub}_base"] = TensorSpec((mix,), "fp32")
        out[f"{p}hc_{sub}_scale"] = TensorSpec((3,), "fp32")
    a = p + "attn."
    out[a + "wq_a.weight"] = TensorSpec((c.q_lora_rank, d), "fp8")
    out[a + "q_norm.weight"] = TensorSpec((c.q_lora_rank,), "bf16")
    out[a + "wq_b.weight"] = TensorSpec((h * hd, c.q_lora_rank), "fp8")
    out[a + "wkv.weight"] = TensorSpec((hd, d), "fp8")
    out[a + "kv_norm.weight"] = TensorSpec((hd,), "bf16")
    out[a + "wo_a.weight"] = TensorSpec((g * c.o_lora_rank, h * hd // g), "fp8")
    out[a + "wo_b.weight"] = TensorSpec((d, g * c.o_lora_rank), "fp8")
    out[a + "attn_sink"] = TensorSpec((h,), "fp32")
    if spec.kind == "full":
        out[a + "compressor.wkv.weight"] = TensorSpec((hd, d), "bf16")
        if spec.ratio > 1:
            out[a + "compressor.wgate.weight"] = TensorSpec((hd, d), "bf16")
        out[a + "compressor.norm.weight"] = TensorSpec((hd,), "bf16")
        out[a + "indexer.wk.weight"] = TensorSpec((c.index_head_dim, hd), "bf16")
        out[a + "indexer.k_norm.weight"] = TensorSpec((c.index_head_dim,), "bf16")
    if spec.is_index_source:
        out[a + "indexer.wq_b.weight"] = TensorSpec((c.index_n_heads * c.index_head_dim, c.q_lora_rank), "fp8")
        out[a + "indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, d), "bf16")
    f = p + "ffn."
    out[f + "gate.weight"] = TensorSpec((n_experts, d), "bf16")
    out[f + "gate.bias"] = TensorSpec((n_experts,), "fp32")
    out[f + "gate.bias_vl"] = TensorSpec((n_experts,), "fp32")
    for j in range(n_experts):
        out[f"{f}experts.{j}.w1.weight"] = TensorSpec((inter, d), expert)
        out[f"{f}experts.{j}.w2.weight"] = TensorSpec((d, inter), expert)
        out[f"{f}experts.{j}.w3.weight"] = TensorSpec((inter, d), expert)
    shared = inter * c.n_shared_experts
    out[f + "shared_experts.w1.weight"] = TensorSpec((shared, d), "fp8")
    out[f + "shared_experts.w2.weight"] = TensorSpec((d, shared), "fp8")
    out[f + "shared_experts.w3.weight"] = TensorSpec((shared, d), "fp8")


def _engram(out: dict[str, TensorSpec], p: str, c: DeepseekV41TextConfig, rows: int) -> None:
    d, hc = c.hidden_size, c.hc_mult
    out[p + "engram.embed.weight"] = TensorSpec((rows, c.engram_head_dim), "fp8_row")
    out[p + "engram.wkv.weight"] = TensorSpec(((hc + 1) * d, c.num_engram_hashes * c.engram_head_dim), "fp8")
    out[p + "engram.q_weight"] = TensorSpec((hc, d), "bf16")
    out[p + "engram.k_weight"] = TensorSpec((hc, d), "bf16")


def _vision(out: dict[str, TensorSpec], v: DeepseekV41VisionConfig, text_hidden: int) -> None:
    dv, inter = v.hidden_size, v.intermediate_size
    out["vision.patch_embed.proj.weight"] = TensorSpec((dv, 3 * v.patch_size**2), "bf16")
    out["vision.patch_embed.proj.bias"] = TensorSpec((dv,), "bf16")
    for j in range(v.num_hidden_layers):
        b = f"vision.blocks.{j}."
        out[b + "norm1.weight"] = TensorSpec((dv,), "fp32")
        out[b + "attn.wqkv.weight"] = TensorSpec((3 * dv, dv), "bf16")
        out[b + "attn.wqkv.bias"] = TensorSpec((3 * dv,), "bf16")
        out[b + "attn.wo.weight"] = TensorSpec((dv, dv), "bf16")
        out[b + "attn.wo.bias"] = TensorSpec((dv,), "bf16")
        out[b + "norm2.weight"] = TensorSpec((dv,), "fp32")
        out[b + "mlp.w1.weight"] = TensorSpec((2 * inter, dv), "bf16")
        out[b + "mlp.w2.weight"] = TensorSpec((dv, inter), "bf16")
    out["vision.norm.weight"] = TensorSpec((dv,), "fp32")
    out["aligner.w1.weight"] = TensorSpec((text_hidden, dv * v.downsample_ratio**2), "bf16")
    out["aligner.w1.bias"] = TensorSpec((text_hidden,), "bf16")
    out["aligner.w2.weight"] = TensorSpec((text_hidden, text_hidden), "bf16")
    out["aligner.w2.bias"] = TensorSpec((text_hidden,), "bf16")
    for name in ("image_start", "image_end", "image_newline"):
        out[name] = TensorSpec((text_hidden,), "bf16")


def expected_tensors(config: DeepseekV41Config | DeepseekV41TextConfig) -> dict[str, TensorSpec]:
    """Every released weight of ``config`` (scales excluded: see :meth:`TensorSpec.stored`), in checkpoint order.

    A composite config adds the vision tower when ``vision_config.num_hidden_layers > 0`` (NeMo builds none
    otherwise) and takes the routed-expert format from ``expert_dtype`` (fp4 → mxfp4, fp8 → 32×32 fp8, bf16).
    """
    full = config if isinstance(config, DeepseekV41Config) else None
    c = config.text_config if isinstance(config, DeepseekV41Config) else config
    expert: Kind = {"fp4": "mxfp4", "fp8": "fp8", "bf16": "bf16"}[full.expert_dtype if full else "fp4"]
    d, n = c.hidden_size, c.num_hidden_layers
    out: dict[str, TensorSpec] = {"embed.weight": TensorSpec((c.vocab_size, d), "bf16")}
    rows = dict(zip(c.engram_layer_ids, c.engram_num_embeddings))
    specs = layer_specs(c)
    for spec in specs[:n]:
        p = f"layers.{spec.index}."
        _block(out, p, c, spec, c.n_routed_experts, expert)
        if spec.engram:
            _engram(out, p, c, rows[spec.index])
    out["norm.weight"] = TensorSpec((d,), "bf16")
    out["head.weight"] = TensorSpec((c.vocab_size, d), "bf16")
    stages = specs[n:]
    for k, spec in enumerate(stages):
        p = f"mtp.{k}."
        _block(out, p, c, spec, c.dspark_n_routed_experts, expert)
        if k == 0:
            out[p + "main_proj.weight"] = TensorSpec((d, d * len(c.dspark_target_layer_ids)), "fp8")
            out[p + "main_norm.weight"] = TensorSpec((d,), "bf16")
        if k == len(stages) - 1:
            r = c.dspark_markov_rank
            out[p + "norm.weight"] = TensorSpec((d,), "bf16")
            out[p + "markov_head.embed.weight"] = TensorSpec((c.vocab_size, r), "bf16")
            out[p + "markov_head.head.weight"] = TensorSpec((c.vocab_size, r), "bf16")
            out[p + "confidence_head.proj.weight"] = TensorSpec((1, d + r), "fp32")
    if full is not None and full.vision_config.num_hidden_layers > 0:
        _vision(out, full.vision_config, d)
    return out


def stored_tensors(
    config: DeepseekV41Config | DeepseekV41TextConfig,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every on-disk tensor (weights and scales): name → (shape, dtype)."""
    block = config.weight_block_size if isinstance(config, DeepseekV41Config) else (32, 32)
    return {
        name: (shape, dtype)
        for weight, spec in expected_tensors(config).items()
        for name, shape, dtype in spec.stored(weight, block)
    }


def internal_parameters(config: DeepseekV41Config | DeepseekV41TextConfig) -> dict[str, TensorSpec]:
    """Our parameter paths and shapes (routed experts stacked ``[E, out, in]``), derived from the released list."""
    out: dict[str, TensorSpec] = {}
    counts: dict[str, int] = {}
    for name, spec in expected_tensors(config).items():
        target, expert = released_to_internal(name)
        if expert is None:
            out[target] = spec
        else:
            counts[target] = max(counts.get(target, 0), expert + 1)
            out[target] = TensorSpec((counts[target], *spec.shape), spec.kind)
    return out
