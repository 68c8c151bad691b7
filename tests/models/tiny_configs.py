"""Tiny random DeepSeek-V4 configurations (overrides of ``deepinfer.checkpoint.tiny.TINY_V4``)."""

from __future__ import annotations

CONFIGS = {
    # the default tiny model: SWA, SWA, CSA, HCA(8), CSA, HCA(8); hash MoE on 2 layers; YaRN; MTP
    "base": {},
    # odd shapes: 3 heads of 48, 3 mHC streams, a CSA first layer, HCA ratio 16, top-3 of 6 experts
    "odd": {
        "hidden_size": 96,
        "num_attention_heads": 3,
        "head_dim": 48,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 24,
        "o_groups": 3,
        "o_lora_rank": 8,
        "sliding_window": 6,
        "compress_ratios": [4, 0, 16, 4, 16, 4, 0],
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 2,
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "num_hash_layers": 1,
        "hc_mult": 3,
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    # wide heads, single output group, HCA first, three hash layers, no YaRN
    "wide": {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 64,
        "o_groups": 1,
        "o_lora_rank": 32,
        "sliding_window": 16,
        "compress_ratios": [8, 4, 0, 4, 8, 0],
        "num_hidden_layers": 5,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 5,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "num_hash_layers": 3,
        "rope_scaling": None,
    },
}


def in_memory(name: str, ops: object, **overrides: object) -> object:
    """A tiny model of ``CONFIGS[name]`` (and ``overrides``) on ``ops`` with random fp32 weights, built in memory (no
    checkpoint, no tokenizer: the GPU image lacks the tokenizer package that the ``tiny_dirs`` fixture needs)."""
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    config = DeepseekV4Config.from_dict({**TINY_V4, **CONFIGS[name], **overrides})
    model = DeepseekV4Model(config, ops)
    model.step_graphs = FAMILY.step_graphs()  # the runtime's choice of graphs, as the engine's build attaches it
    model.load_state_dict(random_weights(config, seed=list(CONFIGS).index(name)))
    return model
