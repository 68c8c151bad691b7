"""DeepSeek-V4.1 config parsing and layer typing, compared with NeMo AutoModel's own derivation."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.checkpoint.hub import ModelUnavailable, check_architecture
from deepinfer.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.layout import layer_specs
from models.tiny_v41 import NAMES, text_config


def _nemo_text(nemo, raw: dict):
    kw = {k: v for k, v in raw.items() if k != "model_type"}
    return nemo["config"].DeepseekV41TextConfig(**kw)


def _nemo_typing(nemo, cfg) -> list[tuple]:
    """Per layer, what NeMo's modules say: built on the meta device, read back, state flow replayed."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention
    from nemo_automodel.components.models.deepseek_v41.dspark import _DeepseekV41DSparkAttention

    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    out, owner, selector = [], None, None
    n = cfg.num_hidden_layers
    with torch.device("meta"):
        for i in range(n + cfg.num_nextn_predict_layers):
            a = (DeepseekV41Attention if i < n else _DeepseekV41DSparkAttention)(cfg, i, backend)
            r = a.compress_ratio
            if a.compressor is not None:  # a Full layer publishes a new compressed-KV state
                owner = i
            if a.indexer is not None:  # an index source replaces the top-k in that state
                selector = i
            kind = "swa" if not r else "full" if a.is_kv_source else "reindex" if a.is_index_source else "reuse"
            ix = a.indexer
            out.append(
                (
                    i,
                    r,
                    kind,
                    owner if r else None,
                    selector if r else None,
                    bool(ix is not None and ix.is_candidate_source),
                    bool(ix is not None and ix.uses_candidates),
                    i < n and i in cfg.engram_layer_ids,  # DeepseekV41Block builds an Engram exactly there
                )
            )
    return out


def _ours(specs) -> list[tuple]:
    return [
        (s.index, s.ratio, s.kind, s.kv_source, s.topk_source, s.candidate_source, s.uses_candidates, s.engram)
        for s in specs
    ]


@pytest.mark.parametrize("name", [*NAMES, "flash"])
def test_v41_layer_typing_parity_nemo(nemo, name):
    raw = text_config(name) if name != "flash" else {}
    ours = layer_specs(DeepseekV41TextConfig.from_dict(raw))
    assert _ours(ours) == _nemo_typing(nemo, _nemo_text(nemo, raw))
    n = len(ours) - sum(s.is_draft for s in ours)
    assert [s.stage for s in ours] == ["encoder"] * (n // 2) + ["decoder"] * (n - n // 2) + ["draft"] * (len(ours) - n)


def test_v41_flash_layer_table():
    """docs/deepseek_v41.md, "Layer roles (SWA, Full, Reindex, Reuse)", spelled out."""
    specs = layer_specs(DeepseekV41TextConfig())
    assert len(specs) == 43
    kinds = "".join({"swa": "S", "full": "F", "reindex": "I", "reuse": "u"}[s.kind] for s in specs)
    assert kinds == "SS" + "Fuuuuu" * 3 + "Fuuu" + "Iuuu" * 4 + "SSS"
    assert [s.ratio for s in specs] == [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    assert [s.index for s in specs if s.engram] == [1, 14]
    assert [s.index for s in specs if s.candidate_source] == [20]
    assert [s.index for s in specs if s.uses_candidates] == [24, 28, 32, 36]
    assert [s.kv_source for s in specs[20:40]] == [20] * 20
    assert [s.topk_source for s in specs[20:40]] == [20] * 4 + [24] * 4 + [28] * 4 + [32] * 4 + [36] * 4
    assert [s.kv_source for s in specs[2:20]] == [2] * 6 + [8] * 6 + [14] * 6
    assert all(s.compress_rope == (s.ratio != 0) for s in specs)
    assert [s.is_draft for s in specs] == [False] * 40 + [True] * 3


def test_v41_flash_defaults_match_nemo(nemo):
    ours = DeepseekV41TextConfig().to_dict()
    nemo_cfg = nemo["config"].DeepseekV41TextConfig()
    theirs = nemo_cfg.to_dict()
    for key, value in ours.items():
        if key in ("model_type", "rope_scaling"):
            continue
        assert theirs[key] == value, key
    rs = nemo_cfg.rope_scaling
    assert {k: rs[k] for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")} == {
        k: ours["rope_scaling"][k] for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")
    }


def _composite(text: dict, **top) -> dict:
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "vision_config": {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 48,
            "min_pixels": 1764,
        },
        "image_token_id": 3,
        "quantization_config": {
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
            "expert_dtype": "fp4",
        },
        "transformers_version": "5.23.0",  # unknown keys are ignored
        **top,
    }


@pytest.mark.parametrize("name", NAMES)
def test_v41_composite_config_parsing(nemo, name):
    raw = _composite(dict(text_config(name), gate_temp=1.0))
    cfg = DeepseekV41Config.from_dict(raw)
    theirs = nemo["config"].DeepseekV41Config(**{k: v for k, v in raw.items() if k != "model_type"})
    t = cfg.text_config
    assert t.num_hidden_layers == theirs.text_config.num_hidden_layers
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_num_embeddings", "compress_ratios"):
        assert list(getattr(t, key)) == list(getattr(theirs.text_config, key)), key
    assert cfg.vision_config.hidden_size == theirs.vision_config.hidden_size == 32
    assert cfg.image_token_id == 3 and cfg.weight_block_size == (32, 32) and cfg.expert_dtype == "fp4"
    assert DeepseekV41TextConfig.from_dict(t.to_dict()) == t


BAD = [
    ("compress_ratios", [0, 0, 4, 2, 1, 1, 1, 1, 0, 0, 0], "compress_ratios"),
    ("compress_ratios", [0, 0, 2, 2, 1, 1, 1, 1, 0, 0], "compress_ratios"),  # DSpark entry missing
    ("kv_source_layer_ids", [2], "compress_ratios"),  # layer 4 (ratio 1) has no ratio-1 owner
    ("index_source_layer_ids", [2, 6], "kv_source_layer_ids"),  # KV source 4 not an index source
    ("index_source_layer_ids", [1, 2, 4, 6], "source"),  # SWA layer as index source
    ("candidate_source_layer_id", 6, "candidate_source_layer_id"),
    ("engram_num_embeddings", [100], "engram_num_embeddings"),
    ("engram_max_ngram_size", 1, "engram_max_ngram_size"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("o_groups", 3, "o_groups"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("hidden_size", 0, "hidden_size"),
    ("engram_layer_ids", [3, 1], "engram_layer_ids"),
]


@pytest.mark.parametrize("field,value,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_v41_config_validation_names_the_field(nemo, field, value, match):
    raw = dict(text_config("sketch"), **{field: value})
    with pytest.raises(ValueError, match=match):
        DeepseekV41TextConfig.from_dict(raw)
    if field != "compress_ratios" or len(value) != 10:  # NeMo validates DSpark entries only when building DSpark
        with pytest.raises(ValueError):
            _nemo_text(nemo, raw)


def test_v41_composite_config_errors():
    with pytest.raises(ValueError, match="model_type"):
        DeepseekV41Config.from_dict({"model_type": "deepseek_v4"})
    with pytest.raises(ValueError, match="image_token_id"):
        DeepseekV41Config.from_dict(_composite(text_config("sketch"), image_token_id=10**6))
    with pytest.raises(ValueError, match="vision_config.hidden_size"):
        DeepseekV41Config.from_dict(_composite(text_config("sketch"), vision_config={"hidden_size": 30}))
    with pytest.raises(ValueError, match="text_config.model_type"):
        DeepseekV41Config.from_dict(_composite({"model_type": "deepseek_v4"}))


def test_v41_check_architecture_accepts_valid_and_refuses_invalid(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_composite(text_config("sketch"))))
    assert check_architecture(tmp_path)["model_type"] == "deepseek_v41"  # served (issue 7)
    (tmp_path / "config.json").write_text(json.dumps(_composite(dict(text_config("sketch"), hidden_size=0))))
    with pytest.raises(ModelUnavailable, match="hidden_size"):
        check_architecture(tmp_path)
