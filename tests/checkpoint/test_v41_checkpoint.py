"""DeepSeek-V4.1 checkpoints (docs/deepseek_v41.md, "Checkpoint names and formats"): released names ↔ ours, storage
formats, the tiny writer and the loader.

Reference points: the released Flash layout (tensor count and size published by TRT-LLM, shapes of the table in
docs/deepseek_v41.md), NeMo AutoModel 0.7.0's state-dict adapters (released names, shapes, quantized layouts,
dequantization) and an independent decoder written here from the format description.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bench.harness import NEMO_DIR
from deepinfer.checkpoint.loader import CheckpointError
from deepinfer.checkpoint.loader_v41 import load_v41_checkpoint
from deepinfer.checkpoint.names_v41 import (
    TensorSpec,
    expected_tensors,
    internal_parameters,
    internal_to_released,
    keeps_fp32,
    released_to_internal,
    stored_tensors,
)
from deepinfer.checkpoint.references import NemoUnavailable, ensure_nemo, nemo_backend
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.checkpoint.tiny_v41 import (
    IMAGE_PLACEHOLDER,
    encode,
    random_weights_v41,
    tiny_v41_config,
    v41_tokenizer_json,
)
from deepinfer.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.engram import bucket_primes, compressed_token_map
from deepinfer.models.deepseek_v41.layout import layer_specs

FILE = "model.safetensors"
SEED = 3

# -- an independent decoder (docs/deepseek_v41.md, "Checkpoint names and formats") -----------------------------------
_E8M0 = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan], dtype=torch.float64)
_FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def ref_decode(w: torch.Tensor, scale: torch.Tensor, rows_per_scale: int) -> torch.Tensor:
    s = _E8M0[scale.view(torch.uint8).long()]
    if w.dtype == torch.int8:  # even column = low nibble
        b = w.view(torch.uint8).long()
        vals = torch.stack([_FP4[b & 15], _FP4[b >> 4]], dim=-1).flatten(-2)
    else:
        vals = w.double()
    r, c = vals.shape
    return (vals * s[torch.arange(r) // rows_per_scale][:, torch.arange(c) // 32]).float()


def tree(params: dict[str, TensorSpec], device: str = "meta") -> nn.Module:
    """A plain module tree with our parameter paths (what DeepseekV41Model exposes)."""
    root = nn.Module()
    for name, spec in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.empty(spec.shape, device=device), requires_grad=False))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v41") / "m", arch="deepseek_v41", seed=SEED)


@pytest.fixture(scope="module")
def config(tiny: Path) -> DeepseekV41Config:
    return DeepseekV41Config.from_file(tiny / "config.json")


@pytest.fixture(scope="module")
def stored(tiny: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny / FILE))


def _loaded(
    config: DeepseekV41Config, path: Path, dtype: torch.dtype = torch.float32, device: str = "meta", **kw: object
) -> nn.Module:
    model = tree(internal_parameters(config), device)
    load_v41_checkpoint(model, path, dtype, **kw)
    return model


# -- names ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["flash", "tiny"])
def test_v41_name_round_trip(which: str, config: DeepseekV41Config) -> None:
    cfg = DeepseekV41TextConfig() if which == "flash" else config
    expected = expected_tensors(cfg)
    params = internal_parameters(cfg)
    seen: dict[str, set[int]] = {}
    for name, spec in expected.items():
        target, expert = released_to_internal(name)
        assert internal_to_released(target, expert) == name
        assert target in params
        if expert is None:
            assert params[target] == spec
        else:
            assert params[target].shape == (params[target].shape[0], *spec.shape)
            seen.setdefault(target, set()).add(expert)
    assert all(rows == set(range(params[t].shape[0])) for t, rows in seen.items())
    assert {internal_to_released(p) for p in params if p not in seen} | {
        internal_to_released(t, e) for t, rows in seen.items() for e in rows
    } == set(expected)


def test_v41_flash_layout_matches_release() -> None:
    """The released Flash checkpoint: 96,085 tensors, 475.2 GiB, ~6.9 GiB of dense FP8; the released shapes."""
    cfg = DeepseekV41Config()
    st = stored_tensors(cfg)
    assert len(st) == 96085
    size = sum(math.prod(s) * d.itemsize for s, d in st.values()) / 2**30
    assert round(size, 1) == 475.2
    dense = (
        sum(
            math.prod(s) * d.itemsize
            for n, (s, d) in st.items()
            if ".experts." not in n and "engram.embed" not in n and d in (torch.float8_e4m3fn, torch.float8_e8m0fnu)
        )
        / 2**30
    )
    assert 6.85 < dense < 6.95
    i8, e8, f8 = torch.int8, torch.float8_e8m0fnu, torch.float8_e4m3fn
    for name, want in {
        "layers.0.attn.wq_a.weight": ((1280, 5120), f8),
        "layers.0.attn.wq_a.scale": ((40, 160), e8),
        "layers.0.attn.wq_b.scale": ((1024, 40), e8),
        "layers.0.attn.wkv.scale": ((16, 160), e8),
        "layers.0.attn.wo_a.weight": ((8192, 4096), f8),
        "layers.0.attn.wo_a.scale": ((256, 128), e8),
        "layers.0.attn.wo_b.scale": ((160, 256), e8),
        "layers.0.attn.attn_sink": ((64,), torch.float32),
        "layers.0.hc_attn_fn": ((24, 20480), torch.float32),
        "layers.5.ffn.experts.383.w1.weight": ((2304, 2560), i8),
        "layers.5.ffn.experts.383.w1.scale": ((2304, 160), e8),
        "layers.5.ffn.experts.0.w2.weight": ((5120, 1152), i8),
        "layers.5.ffn.experts.0.w2.scale": ((5120, 72), e8),
        "layers.1.engram.embed.weight": ((384006168, 256), f8),
        "layers.14.engram.embed.scale": ((384016682, 8), e8),
        "layers.14.engram.wkv.weight": ((25600, 6144), f8),
        "layers.20.attn.indexer.wq_b.weight": ((4096, 1280), f8),
        "layers.36.attn.indexer.weights_proj.weight": ((32, 5120), torch.bfloat16),
        "layers.20.attn.indexer.wk.weight": ((128, 512), torch.bfloat16),
        "mtp.0.main_proj.weight": ((5120, 15360), f8),
        "mtp.2.ffn.experts.127.w3.weight": ((2304, 2560), i8),
        "mtp.2.confidence_head.proj.weight": ((1, 5376), torch.float32),
        "mtp.2.markov_head.embed.weight": ((129280, 256), torch.bfloat16),
        "vision.blocks.31.mlp.w1.weight": ((5632, 1024), torch.bfloat16),
        "aligner.w1.weight": ((5120, 9216), torch.bfloat16),
    }.items():
        assert st[name] == want, name
    owners = lambda key: sorted({int(n.split(".")[1]) for n in st if n.startswith("layers.") and key in n})  # noqa: E731
    assert owners(".compressor.wkv.") == [2, 8, 14, 20]
    assert owners(".compressor.wgate.") == [2, 8, 14]
    assert owners(".indexer.wk.") == [2, 8, 14, 20]
    assert owners(".indexer.wq_b.") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert owners(".engram.") == [1, 14]
    assert not any(n.startswith("mtp.") and ("indexer" in n or "compressor" in n) for n in st)
    assert not any("hc_head" in n or "tid2eid" in n for n in st)


def test_v41_keeps_fp32() -> None:
    for name in (
        "layers.3.hc_attn.fn",
        "layers.3.hc_ffn_base",
        "mtp.0.attn.attn_sink",
        "layers.0.ffn.gate.bias",
        "layers.0.ffn.gate.bias_vl",
        "layers.2.attn.compressor.wgate.weight",
        "head.weight",
        "layers.0.attn.q_norm.weight",
        "vision.blocks.0.norm1.weight",
        "mtp.2.confidence_head.proj.weight",
    ):
        assert keeps_fp32(name), name
    for name in (
        "embed.weight",
        "layers.0.ffn.w1",
        "layers.0.ffn.gate.weight",
        "layers.1.engram.embed.weight",
        "mtp.2.markov_head.head.weight",
        "layers.0.attn.wq_a.weight",
        "aligner.w1.bias",
    ):
        assert not keeps_fp32(name), name


# -- formats -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,shape", [("fp8", (80, 96)), ("fp8", (40, 24)), ("fp8_row", (37, 64)), ("mxfp4", (48, 96))]
)
def test_v41_quant_round_trip_bit_exact(kind: str, shape: tuple[int, int], tmp_path: Path) -> None:
    from deepinfer.checkpoint.loader_v41 import decode_tensor

    name = "layers.1.engram.embed.weight" if kind == "fp8_row" else "layers.0.attn.wq_a.weight"
    spec = TensorSpec(shape, kind)  # type: ignore[arg-type]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, shape[0]).unsqueeze(1)
    q, s = encode(spec, w)
    assert [(tuple(q.shape), q.dtype), (tuple(s.shape), s.dtype)] == [(x[1], x[2]) for x in spec.stored(name)]
    deq = decode_tensor(name, q, s)
    assert torch.equal(deq, ref_decode(q, s, 32 if kind == "fp8" else 1))
    tol = 2.0**-3 if kind == "mxfp4" else 2.0**-4  # half an ulp of e2m1 / e4m3, relative to the block max
    assert ((deq - w).abs() <= tol * w.abs().amax() + 1e-30).all()
    # decoded values are representable: they survive a second encoding exactly (the bytes may differ when the block
    # maximum rounded down to a power of two times 224, halving the next scale)
    assert torch.equal(decode_tensor(name, *encode(spec, deq)), deq)
    # a stored tensor survives safetensors bit for bit
    path = Path(tmp_path) / "q.safetensors"
    save_file({"w": q, "s": s}, str(path))
    back = load_file(str(path))
    assert torch.equal(back["w"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
        back["s"].view(torch.uint8), s.view(torch.uint8)
    )


def test_v41_mxfp4_nibble_order() -> None:
    from deepinfer.checkpoint.loader_v41 import decode_tensor

    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8).view(torch.int8)  # low nibble 1 (0.5), high 2 (1.0)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^1
    assert decode_tensor("layers.0.ffn.experts.0.w1.weight", packed, scale)[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]


# -- the tiny checkpoint -----------------------------------------------------------------------------------------------
def test_v41_tiny_config_and_tokenizer(tiny: Path, config: DeepseekV41Config) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and raw["architectures"] == ["DeepseekV41ForCausalLM"]
    assert raw["quantization_config"] == {
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
        "expert_dtype": "fp4",
    }
    t = config.text_config
    specs = layer_specs(t)
    assert [s.kind for s in specs] == ["swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse"] + ["swa"] * 3
    assert [s.ratio for s in specs[:8]] == [0, 0, 2, 2, 1, 1, 1, 1]
    assert specs[4].candidate_source and specs[6].uses_candidates
    assert [s.index for s in specs if s.engram] == [1, 2] and [s.stage for s in specs[-3:]] == ["draft"] * 3
    assert config.vision_config.num_hidden_layers == 2 and config.image_token_id == 129264
    assert t.hidden_size % 32 == 0 and t.moe_intermediate_size % 32 == 0 and t.engram_head_dim % 32 == 0
    rows = [sum(p) for p in bucket_primes(t.engram_layer_ids, t.engram_vocab_size, t.engram_n_heads, 4)]
    assert list(t.engram_num_embeddings) == rows and max(rows) < 2000
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert (tiny / "tokenizer.json").read_text(encoding="utf-8") == v41_tokenizer_json()
    assert tok.token_to_id(IMAGE_PLACEHOLDER) == 129264 and tok.get_vocab_size() == t.vocab_size == 129280
    assert tok.encode(f"a {IMAGE_PLACEHOLDER} b").ids.count(129264) == 1
    assert tok.id_to_token(t.dspark_noise_token_id) is not None
    assert t.engram_compressed_vocab_size == 99092 == compressed_token_map(tok)[1]


def test_v41_tiny_checkpoint_round_trip(tiny: Path, config: DeepseekV41Config, stored: dict[str, torch.Tensor]) -> None:
    assert {k: (tuple(v.shape), v.dtype) for k, v in stored.items()} == stored_tensors(config)
    model = _loaded(config, tiny, torch.bfloat16, device="cpu")  # allocated fp32 targets: filled in place
    params = dict(model.named_parameters())
    written = random_weights_v41(config, SEED)
    for name, spec in expected_tensors(config).items():
        target, expert = released_to_internal(name)
        got = params[target] if expert is None else params[target][expert]
        assert got.dtype == (torch.float32 if keeps_fp32(target) else torch.bfloat16), name
        if spec.kind in ("bf16", "fp32"):
            want = stored[name].float()
        else:
            scale = stored[name.removesuffix(".weight") + ".scale"]
            want = ref_decode(stored[name], scale, 32 if spec.kind == "fp8" else 1)
        assert torch.equal(got.float(), want), name
        w = written[target] if expert is None else written[target][expert]
        assert torch.allclose(want, w, rtol=0.26, atol=0.26 * w.abs().max().item()), name
    assert params["embed.weight"].std() > 0.5 and params["head.weight"].std() > 0.2  # peaky random head


def test_v41_cli_and_overrides(tmp_path: Path) -> None:
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["make-tiny-model", str(tmp_path / "c"), "--arch", "deepseek_v41", "--seed", "1"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "c" / "config.json").read_text())["model_type"] == "deepseek_v41"
    raw = tiny_v41_config(
        {
            "text_config": {"num_nextn_predict_layers": 1, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0]},
            "vision_config": {"num_hidden_layers": 0},
        }
    )
    names = expected_tensors(DeepseekV41Config.from_dict(raw))
    assert not any(n.startswith(("vision.", "aligner.", "image_", "mtp.1.")) for n in names)
    assert "mtp.0.main_proj.weight" in names and "mtp.0.markov_head.head.weight" in names


# -- the loader --------------------------------------------------------------------------------------------------------
def _write(tmp: Path, tensors: dict[str, torch.Tensor], src: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / FILE))
    (tmp / "config.json").write_bytes((src / "config.json").read_bytes())
    return tmp


def test_v41_loader_sharded_and_skip(
    tmp_path: Path, tiny: Path, config: DeepseekV41Config, stored: dict[str, torch.Tensor]
) -> None:
    names = sorted(stored)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}  # a weight and its scale in different files
    for fname, keys in shards.items():
        save_file({k: stored[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ref = dict(_loaded(config, tiny).named_parameters())
    got = dict(_loaded(config, tmp_path).named_parameters())
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    got = dict(_loaded(config, tiny / FILE).named_parameters())  # a single file
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # a text-only model without the drafter: skip the namespaces it lacks
    params = {
        k: v
        for k, v in internal_parameters(config).items()
        if not k.startswith(("mtp.", "vision.", "aligner.", "image_"))
    }
    load_v41_checkpoint(tree(params), tiny, skip=("mtp.", "vision.", "aligner.", "image_"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\.0\..*' in model\.safetensors"):
        load_v41_checkpoint(tree(params), tiny, skip=("vision.", "aligner.", "image_"))
    weight_map[names[0]] = "c.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="c.safetensors is listed in model.safetensors.index.json but missing"):
        _loaded(config, tmp_path)


def _drop(stored: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in stored.items() if k not in names}


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("missing", r"lacks 1 tensors.*layers\.2\.attn\.compressor\.wgate\.weight"),
        ("missing_expert", r"lacks 1 tensors.*mtp\.1\.ffn\.experts\.3\.w2\.weight"),
        ("missing_scale", r"quantized tensor 'layers\.0\.attn\.wq_a\.weight' in model\.safetensors has no scale"),
        ("orphan_scale", r"scale tensor 'layers\.0\.attn\.bogus\.scale' in model\.safetensors has no weight"),
        ("wrong_shape", r"'layers\.3\.ffn\.gate\.bias_vl' in model\.safetensors has shape \(9,\), expected \(8,\)"),
        ("wrong_scale", r"'layers\.1\.engram\.embed\.weight' in model\.safetensors: .*scale shape"),
        ("unexpected", r"unexpected tensor 'layers\.0\.attn\.compressor\.wkv\.weight' in model\.safetensors"),
        ("corrupt", r"cannot read model\.safetensors"),
    ],
)
def test_v41_loader_errors(
    case: str, pattern: str, tmp_path: Path, tiny: Path, config: DeepseekV41Config, stored: dict[str, torch.Tensor]
) -> None:
    t = dict(stored)
    if case == "missing":
        t = _drop(t, "layers.2.attn.compressor.wgate.weight")
    elif case == "missing_expert":
        t = _drop(t, "mtp.1.ffn.experts.3.w2.weight", "mtp.1.ffn.experts.3.w2.scale")
    elif case == "missing_scale":
        t = _drop(t, "layers.0.attn.wq_a.scale")
    elif case == "orphan_scale":
        t["layers.0.attn.bogus.scale"] = t["layers.0.attn.wq_a.scale"].clone()
    elif case == "wrong_shape":
        t["layers.3.ffn.gate.bias_vl"] = torch.zeros(9)
    elif case == "wrong_scale":
        t["layers.1.engram.embed.scale"] = t["layers.1.engram.embed.scale"][:-1].contiguous()
    elif case == "unexpected":
        t["layers.0.attn.compressor.wkv.weight"] = t["layers.2.attn.compressor.wkv.weight"].clone()
    path = _write(tmp_path / case, t, tiny)
    if case == "corrupt":
        data = (path / FILE).read_bytes()
        (path / FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=pattern):
        _loaded(config, path)


# -- NeMo AutoModel's adapters as the reference for names, layouts and dequantization ----------------------------------
@pytest.fixture(scope="module")
def nemo(tiny: Path) -> dict:
    try:
        ensure_nemo(NEMO_DIR)
        from nemo_automodel.components.models.deepseek_v41 import config as ncfg
        from nemo_automodel.components.models.deepseek_v41 import state_dict_adapter as nsda
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    except (NemoUnavailable, ImportError) as e:
        pytest.fail(f"the V4.1 checkpoint parity test needs NeMo AutoModel 0.7.0: {e}", pytrace=False)
    from transformers import PreTrainedTokenizerFast

    raw = json.loads((tiny / "config.json").read_text())
    cfg = ncfg.DeepseekV41Config(
        text_config=raw["text_config"], vision_config=raw["vision_config"], image_token_id=raw["image_token_id"]
    )
    backend = nemo_backend()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"))
    model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=tokenizer)
    t = cfg.text_config
    opts = dict(
        num_draft_layers=t.num_nextn_predict_layers,
        target_layer_ids=t.dspark_target_layer_ids,
        block_size=t.dspark_block_size,
        num_anchors=1,
        mask_token_id=t.dspark_noise_token_id,
        markov_rank=t.dspark_markov_rank,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
        confidence_head_stop_gradient=False,
    )
    draft = cfg.build_dspark_draft(type("Options", (), opts)())
    f32 = torch.float32
    return {
        "model": model,
        "draft": draft,
        "sda": nsda,
        "backbone": nsda.DeepseekV41StateDictAdapter(cfg, model.model.moe_config, backend, dtype=f32),
        "dspark": nsda.DeepseekV41DSparkStateDictAdapter(t, draft.moe_config, backend, dtype=f32),
    }


def test_v41_names_match_nemo(nemo: dict, config: DeepseekV41Config) -> None:
    sd, dsd = nemo["model"].state_dict(), nemo["draft"].state_dict()
    plain = {**nemo["backbone"].to_hf(sd), **nemo["dspark"].to_hf(dsd)}
    assert {k: tuple(v.shape) for k, v in plain.items()} == {k: s.shape for k, s in expected_tensors(config).items()}
    # NeMo holds the compressor projections (and, once initialised, the head) in fp32; the release stores them bf16
    # (see names_v41); every other plain tensor has NeMo's dtype
    kinds = {"bf16": torch.bfloat16, "fp32": torch.float32}
    differ = {k for k, s in expected_tensors(config).items() if s.kind in kinds and plain[k].dtype != kinds[s.kind]}
    assert differ - {"head.weight"} == {k for k in plain if ".compressor.w" in k} != set()
    kw = {"quantization": True, "for_checkpoint_load": True}
    quant = {**nemo["backbone"].to_hf(sd, **kw), **nemo["dspark"].to_hf(dsd, **kw)}
    ours = stored_tensors(config)
    assert set(quant) == set(ours)
    for k, v in quant.items():
        assert tuple(v.shape) == ours[k][0], k
        if v.dtype not in kinds.values():
            assert v.dtype == ours[k][1], k


def test_v41_dequantization_matches_nemo(nemo: dict, tiny: Path, config: DeepseekV41Config) -> None:
    """NeMo's from_hf (dequantize, rename, stack) then to_hf (split) of our file == what our loader loads."""
    params = dict(_loaded(config, tiny).named_parameters())
    released: dict[str, torch.Tensor] = {}
    for adapter in ("backbone", "dspark"):
        native = nemo[adapter].from_hf(load_file(str(tiny / FILE)))
        released.update(nemo[adapter].to_hf(native))
    assert set(released) == set(expected_tensors(config))
    for name, value in released.items():
        target, expert = released_to_internal(name)
        got = params[target] if expert is None else params[target][expert]
        assert torch.equal(got, value.float()), name
    stored = load_file(str(tiny / FILE))
    for name in ("layers.1.engram.embed.weight", "layers.0.ffn.experts.1.w2.weight", "layers.2.engram.wkv.weight"):
        direct = nemo["sda"].dequantize_checkpoint_weight(
            stored[name],
            stored[name.removesuffix("weight") + "scale"],
            dtype=torch.float32,
            rowwise="engram.embed" in name,
        )
        target, expert = released_to_internal(name)
        assert torch.equal(direct, params[target] if expert is None else params[target][expert])


def test_v41_tiny_checkpoint_parity_with_nemo(nemo: dict, tiny: Path, config: DeepseekV41Config) -> None:
    """The tiny checkpoint end to end: NeMo's model loaded through its own adapter and ours through
    ``load_v41_checkpoint`` (with the Engram map of the real DeepSeek tokenizer) give the same prompt logprobs
    (fp32, cache formats off, the documented top-k tie rule): every tensor lands where NeMo puts it."""
    from tokenizers import Tokenizer

    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model
    from models.nemo_v41 import nemo_logits, reference_rules

    theirs = nemo["model"]
    missing, unexpected = theirs.load_state_dict(nemo["backbone"].from_hf(load_file(str(tiny / FILE))), strict=False)
    assert not unexpected and all("e_score_correction_bias" in k or "bias_vl" in k for k in missing), missing
    theirs.float().eval()
    token_map = compressed_token_map(Tokenizer.from_file(str(tiny / "tokenizer.json")))[0]
    ours = DeepseekV41Model(config, engram_token_map=token_map)
    load_v41_checkpoint(ours, tiny, torch.float32)
    ours.set_quant_sim(False)
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    with reference_rules():
        ref = nemo_logits(theirs, torch.tensor([ids]))[0]
    chunk = SeqChunk(SequenceState(), 0, len(ids), torch.arange(8))
    got = ours.logits(ours(ForwardBatch.build([chunk], [ids]), PagedKVCache(config, 8, 16)))
    assert float((got.log_softmax(-1) - ref.log_softmax(-1)).abs().max()) <= 1e-4


def test_v41_model_built_on_meta_loads_to_the_same_logits(tiny: Path, config: DeepseekV41Config) -> None:
    """The engine builds the V4.1 model on the meta device (no host copy of weights before loading): the loader
    materialises every tensor, the host-side tables (RoPE, Engram hash) are real, and the logits are those of a
    model built in host memory."""
    from tokenizers import Tokenizer

    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model

    token_map = compressed_token_map(Tokenizer.from_file(str(tiny / "tokenizer.json")))[0]
    out = []
    for meta in (False, True):
        with torch.device("meta" if meta else "cpu"):
            m = DeepseekV41Model(config, engram_token_map=token_map)
        load_v41_checkpoint(m, tiny, torch.float32)
        assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
        chunk = SeqChunk(SequenceState(), 0, 29, torch.arange(8))
        out.append(m.logits(m(ForwardBatch.build([chunk], [list(range(100, 129))]), PagedKVCache(config, 8, 16))))
    assert torch.equal(out[0], out[1])
