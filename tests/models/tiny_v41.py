"""Tiny DeepSeek-V4.1 text configurations (raw ``text_config`` dicts) and a tiny fast tokenizer for Engram.

Each config keeps every layer kind (SWA, Full, Reuse, Reindex, candidate source) and Engram on two layers;
``engram_num_embeddings`` / ``engram_compressed_vocab_size`` are derived so NeMo accepts them.
"""

from __future__ import annotations

from deepinfer.models.deepseek_v41.engram import bucket_primes, compressed_token_map

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


def build_tokenizer(extra_words: int = 59):
    """Word-level fast tokenizer, ids 0/1/2 = BOS/EOS/PAD; some words collide after normalization."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<pad>", IMAGE_PLACEHOLDER, "<mask>"]
    words += [f"w{i}" for i in range(extra_words)]
    words += ["Hello", "hello", "HELLO", "Ünï", "uni", "Ｗ3", " a\t b ", "Crème", "creme", "\u00a0"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER]})
    return fast


_BASE = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=24,
    o_lora_rank=16,
    o_groups=2,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    sliding_window=4,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=3,
    candidate_topk_blocks=2,
    candidate_block_size=2,
    engram_head_dim=8,
    engram_pad_token_id=2,
    dspark_block_size=3,
    dspark_markov_rank=8,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 64,
    },
)

# name -> (schedule overrides, engram (vocab_size, n_heads, max_ngram_size))
_SCHEDULES = {
    # the reference sketch: SWA SWA+E Full2 Reuse2+E Full1(cand) Reuse1 Reindex1 Reuse1 | 3 DSpark
    "sketch": (
        dict(
            num_hidden_layers=8,
            compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
            kv_source_layer_ids=[2, 4],
            index_source_layer_ids=[2, 4, 6],
            candidate_source_layer_id=4,
            engram_layer_ids=[1, 3],
            num_nextn_predict_layers=3,
            dspark_target_layer_ids=[5, 6, 7],
        ),
        (11, 2, 3),
    ),
    # Full ratio-1 first, Reindex without a candidate pool, two ratio-2 owners, Engram at 0 and 5, n=2..4
    "mixed": (
        dict(
            num_hidden_layers=10,
            compress_ratios=[1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0],
            kv_source_layer_ids=[0, 4, 7],
            index_source_layer_ids=[0, 2, 4, 6, 7],
            candidate_source_layer_id=-1,
            engram_layer_ids=[0, 5],
            num_nextn_predict_layers=1,
            dspark_target_layer_ids=[8],
        ),
        (29, 3, 4),
    ),
    # Engram with the released shape (n = 2..4, 8 heads), one layer, candidate source the last Full layer
    "heads8": (
        dict(
            num_hidden_layers=6,
            compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0],
            kv_source_layer_ids=[1, 3],
            index_source_layer_ids=[1, 3, 5],
            candidate_source_layer_id=3,
            engram_layer_ids=[2],
            num_nextn_predict_layers=2,
            dspark_target_layer_ids=[3, 4, 5],
        ),
        (101, 8, 4),
    ),
}


def text_config(name: str, tokenizer=None) -> dict:
    """The raw ``text_config`` dict of a tiny configuration (as it would appear in config.json)."""
    tokenizer = tokenizer or build_tokenizer()
    schedule, (eng_vocab, heads, ngram) = _SCHEDULES[name]
    _, compressed = compressed_token_map(tokenizer)
    layers = schedule["engram_layer_ids"]
    rows = [sum(p) for p in bucket_primes(layers, eng_vocab, heads, ngram)]
    return dict(
        _BASE,
        **schedule,
        model_type="deepseek_v41_text",
        vocab_size=len(tokenizer),
        dspark_noise_token_id=tokenizer.convert_tokens_to_ids("<mask>"),
        engram_vocab_size=eng_vocab,
        engram_n_heads=heads,
        engram_max_ngram_size=ngram,
        engram_num_embeddings=rows,
        engram_compressed_vocab_size=compressed,
    )


NAMES = list(_SCHEDULES)


def random_model(tokenizer, ops, name: str = "sketch", dtype=None, dev: str = "cpu"):
    """A tiny ``DeepseekV41Model`` of configuration ``name`` on ``ops`` with seeded random weights (norms at 1, mHC
    scales around 1), its family's step graphs attached as the engine's build attaches them; ``dtype`` (default
    fp32) with the weights the checkpoint keeps in fp32 kept so."""
    import torch

    from deepinfer.checkpoint.names_v41 import keeps_fp32
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.models.deepseek_v41.family import FAMILY
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model

    dtype = dtype or torch.float32
    raw = {"model_type": "deepseek_v41", "text_config": text_config(name, tokenizer),
           "vision_config": {"num_hidden_layers": 0}, "image_token_id": 3}  # fmt: skip
    m = DeepseekV41Model(DeepseekV41Config.from_dict(raw), ops, engram_token_map=compressed_token_map(tokenizer)[0])
    m.step_graphs = FAMILY.step_graphs()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("norm.weight", "q_weight", "k_weight")):
                p.fill_(1.0)
            elif n.endswith(("hc_attn.scale", "hc_ffn.scale")):
                p.uniform_(0.5, 1.5, generator=g)
            elif p.dim() == 1 or n.endswith(".fn"):
                p.normal_(0, 0.3, generator=g)
            else:
                p.normal_(0, p.shape[-1] ** -0.5, generator=g)
    m = m.to(dev, dtype)
    if dtype != torch.float32:
        for n, p in m.named_parameters():
            if keeps_fp32(n):
                p.data = p.data.float()
    return m.eval()
