"""Tensor names: the official release, transformers' renaming (docs/deepseek_v4.md ("transformers names")), and our
modules.

Official names are the canonical form. ``hf_to_official`` undoes transformers' renaming (its stacked
experts are split by the loader), in memory (``model.layers.0.self_attn.kv_norm.weight``) and as its
``save_pretrained`` writes it back (``model.layers.0.attn.norm.weight``: its reverse renaming keeps the ``model.``
prefix and turns ``kv_norm`` into ``norm``); ``official_to_internal`` maps to a parameter of
:class:`~deepinfer.models.deepseek_v4.model.DeepseekV4Model` plus an expert index for routed experts.
"""

from __future__ import annotations

import re

# (pattern, replacement) applied in order to a transformers name
_HF_RULES: list[tuple[str, str]] = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^model\.norm\.", "norm."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # what save_pretrained writes back for self_attn.kv_norm
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"compressor\.kv_proj\.", "compressor.wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.position_bias$", "compressor.ape"),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
    (r"\.weight_scale_inv$", ".scale"),
]
_HF_COMPILED = [(re.compile(p), r) for p, r in _HF_RULES]


def is_hf_name(name: str) -> bool:
    return name.startswith(("model.", "lm_head."))


def hf_to_official(name: str) -> str:
    """Official spelling of a transformers tensor name (stacked experts keep ``experts.gate_up_proj``)."""
    for pat, rep in _HF_COMPILED:
        name = pat.sub(rep, name)
    return name


def official_to_hf(name: str) -> str:
    """transformers spelling of an official name (per-expert names map to the stacked tensors)."""
    rev = [
        (r"^embed\.", "model.embed_tokens."),
        (r"^head\.", "lm_head."),
        (r"^norm\.", "model.norm."),
        (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
        (r"^layers\.", "model.layers."),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
        (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
        (r"compressor\.wkv\.", "compressor.kv_proj."),
        (r"compressor\.wgate\.", "compressor.gate_proj."),
        (r"compressor\.ape$", "compressor.position_bias"),
        (r"compressor\.norm\.", "compressor.kv_norm."),
        (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
        (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
        (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
        (r"\.attn\.wq_a\.", ".self_attn.q_a_proj."),
        (r"\.attn\.q_norm\.", ".self_attn.q_a_norm."),
        (r"\.attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.attn\.wo_a\.", ".self_attn.o_a_proj."),
        (r"\.attn\.wo_b\.", ".self_attn.o_b_proj."),
        (r"\.attn\.attn_sink$", ".self_attn.sinks"),
        (r"\.attn\.wkv\.", ".self_attn.kv_proj."),
        (r"\.attn\.kv_norm\.", ".self_attn.kv_norm."),
        (r"\.attn\.compressor\.", ".self_attn.compressor."),
        (r"\.ffn\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.ffn\.shared_experts\.w1\.", ".mlp.shared_experts.gate_proj."),
        (r"\.ffn\.shared_experts\.w3\.", ".mlp.shared_experts.up_proj."),
        (r"\.ffn\.shared_experts\.w2\.", ".mlp.shared_experts.down_proj."),
        (r"\.ffn\.", ".mlp."),
    ]
    for pat, rep in rev:
        name = re.sub(pat, rep, name)
    return name


_EXPERT = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"^(.*\.ffn)\.shared_experts\.(w[123])\.weight$")


def official_to_internal(name: str) -> tuple[str, int | None]:
    """Parameter name in our model (and the expert index for a routed expert's weight)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    m = _SHARED.match(name)
    if m:
        return f"{m.group(1)}.shared_{m.group(2)}.weight", None
    return name, None


def internal_to_official(name: str, expert: int | None = None) -> str:
    m = re.match(r"^(.*\.ffn)\.shared_(w[123])\.weight$", name)
    if m:
        return f"{m.group(1)}.shared_experts.{m.group(2)}.weight"
    m = re.match(r"^(.*\.ffn)\.(w[123])$", name)
    if m:
        if expert is None:
            raise ValueError(f"{name} is a stacked expert tensor: an expert index is required")
        return f"{m.group(1)}.experts.{expert}.{m.group(2)}.weight"
    return name
