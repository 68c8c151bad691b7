"""Loading DeepSeek-V4 checkpoints (docs/deepseek_v4.md, "Checkpoint format"): official and transformers names,
FP8 / MXFP4 / bf16 / fp32 storage, sharding, every error naming what is wrong; plus ``checkpoint.hub`` and config
parsing.

Expected values are computed here from the stored bytes with an independent decoder and name mapping.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from deepinfer.checkpoint.hub import ModelUnavailable, check_architecture, resolve_model
from deepinfer.checkpoint.loader import CheckpointError, load_checkpoint
from deepinfer.checkpoint.mtp import has_mtp
from deepinfer.checkpoint.references import hf_config, hf_state_dict
from deepinfer.checkpoint.tiny import TINY_V4, make_tiny_model
from deepinfer.models.deepseek_v4.config import DeepseekV4Config, YarnParams
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.quant.formats import quantize_fp8_blocks, quantize_mxfp4

FILE = "model.safetensors"

# ---------------------------------------------------------------------------------------------------------------
# an independent decoder and name mapping (docs/deepseek_v4.md, "Checkpoint format")
# ---------------------------------------------------------------------------------------------------------------

_E8M0 = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan], dtype=torch.float64)
_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def ref_fp8(w8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    s = _E8M0[scale.view(torch.uint8).long()]
    s = s[torch.arange(w8.shape[0]) // block][:, torch.arange(w8.shape[1]) // block]
    return (w8.float().double() * s).float()


def ref_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = b & 0xF, b >> 4
    s = _E8M0[scale.view(torch.uint8).long()][:, torch.arange(codes.shape[1]) // 32]
    return (_LUT[codes] * s).float()


def scale_name(weight: str) -> str:
    assert weight.endswith(".weight")
    return weight[: -len("weight")] + "scale"


def decoded(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The value of an official tensor: FP8 / MXFP4 decoded with its scale, others as stored (fp32 or int64)."""
    t = stored[name]
    if t.dtype == torch.float8_e4m3fn:
        return ref_fp8(t, stored[scale_name(name)])
    if t.dtype == torch.int8:
        return ref_mxfp4(t, stored[scale_name(name)])
    return t if t.dtype == torch.int64 else t.float()


def official_names(param: str, n_experts: int) -> list[str]:
    """The checkpoint tensors behind one of our parameters (stacked routed experts: one per expert)."""
    m = re.fullmatch(r"(.*\.ffn)\.(w[123])", param)
    if m:
        return [f"{m[1]}.experts.{e}.{m[2]}.weight" for e in range(n_experts)]
    m = re.fullmatch(r"(.*\.ffn)\.shared_(w[123])\.weight", param)
    if m:
        return [f"{m[1]}.shared_experts.{m[2]}.weight"]
    return [param]


def model_tensors(model: DeepseekV4Model) -> dict[str, torch.Tensor]:
    out = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {k: v for k, v in out.items() if not k.startswith("rope_")}


# ---------------------------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def config(ckpt) -> DeepseekV4Config:
    return DeepseekV4Config.from_file(ckpt / "config.json")


@pytest.fixture(scope="module")
def stored(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / FILE))


def load(path: Path, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> DeepseekV4Model:
    model = DeepseekV4Model(config)
    load_checkpoint(model, path, dtype=dtype, progress=False)
    return model


@pytest.fixture(scope="module")
def model32(ckpt, config) -> DeepseekV4Model:
    return load(ckpt, config, torch.float32)


@pytest.fixture(scope="module")
def model16(ckpt, config) -> DeepseekV4Model:
    return load(ckpt, config, torch.bfloat16)


SMALL_VOCAB = 512


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, DeepseekV4Config, dict[str, torch.Tensor]]:
    """The tiny model with a small vocabulary: the error tests write many variants of it."""
    path = make_tiny_model(tmp_path_factory.mktemp("small"), overrides={"vocab_size": SMALL_VOCAB})
    return path, DeepseekV4Config.from_file(path / "config.json"), load_file(str(path / FILE))


def write(path: Path, tensors: dict[str, torch.Tensor], ckpt: Path, name: str = FILE) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone() for k, v in tensors.items()}, str(path / name), metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", path / "config.json")
    return path


def assert_same_params(got: DeepseekV4Model, want: DeepseekV4Model, skip: tuple[str, ...] = ()) -> None:
    g, w = model_tensors(got), model_tensors(want)
    assert set(g) == {k for k in w if not k.startswith(skip)}
    for k, v in g.items():
        assert v.dtype == w[k].dtype, k
        assert torch.equal(v, w[k]), k


# ---------------------------------------------------------------------------------------------------------------
# official checkpoints: values and dtypes
# ---------------------------------------------------------------------------------------------------------------

# (parameter, expert, official tensor, stored dtype): a hand-written sample of the official naming
# (docs/deepseek_v4.md, "Tensor names")
REPRESENTATIVE = [
    ("layers.2.ffn.w1", 3, "layers.2.ffn.experts.3.w1.weight", torch.int8),
    ("layers.4.ffn.w2", 7, "layers.4.ffn.experts.7.w2.weight", torch.int8),
    ("layers.0.ffn.w3", 0, "layers.0.ffn.experts.0.w3.weight", torch.int8),
    ("layers.3.ffn.shared_w2.weight", None, "layers.3.ffn.shared_experts.w2.weight", torch.float8_e4m3fn),
    ("layers.1.ffn.shared_w1.weight", None, "layers.1.ffn.shared_experts.w1.weight", torch.float8_e4m3fn),
    ("layers.1.attn.wq_b.weight", None, "layers.1.attn.wq_b.weight", torch.float8_e4m3fn),
    ("layers.3.attn.wo_a.weight", None, "layers.3.attn.wo_a.weight", torch.float8_e4m3fn),
    ("layers.2.attn.indexer.wq_b.weight", None, "layers.2.attn.indexer.wq_b.weight", torch.float8_e4m3fn),
    ("layers.5.attn.attn_sink", None, "layers.5.attn.attn_sink", torch.float32),
    ("layers.4.hc_ffn_fn", None, "layers.4.hc_ffn_fn", torch.float32),
    ("hc_head_fn", None, "hc_head_fn", torch.float32),
    ("layers.1.ffn.gate.tid2eid", None, "layers.1.ffn.gate.tid2eid", torch.int64),
    ("layers.5.ffn.gate.bias", None, "layers.5.ffn.gate.bias", torch.float32),
    ("layers.3.attn.compressor.ape", None, "layers.3.attn.compressor.ape", torch.float32),
    ("layers.3.attn.compressor.wkv.weight", None, "layers.3.attn.compressor.wkv.weight", torch.bfloat16),
    ("embed.weight", None, "embed.weight", torch.bfloat16),
    ("mtp.0.e_proj.weight", None, "mtp.0.e_proj.weight", torch.float8_e4m3fn),
    ("mtp.0.ffn.w1", 5, "mtp.0.ffn.experts.5.w1.weight", torch.int8),
    ("mtp.0.ffn.shared_w3.weight", None, "mtp.0.ffn.shared_experts.w3.weight", torch.float8_e4m3fn),
    ("mtp.0.hc_head_scale", None, "mtp.0.hc_head_scale", torch.float32),
    ("mtp.0.enorm.weight", None, "mtp.0.enorm.weight", torch.bfloat16),
]


@pytest.mark.parametrize("param,expert,official,dtype", REPRESENTATIVE, ids=[r[2] for r in REPRESENTATIVE])
def test_representative_tensors(model32, stored, param, expert, official, dtype):
    t = stored[official]
    assert t.dtype == dtype
    if dtype == torch.float8_e4m3fn:
        s = stored[scale_name(official)]
        assert s.dtype == torch.float8_e8m0fnu
        assert tuple(s.shape) == (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128))
        want = ref_fp8(t, s)
    elif dtype == torch.int8:
        s = stored[scale_name(official)]
        assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (t.shape[0], 2 * t.shape[1] // 32)
        want = ref_mxfp4(t, s)
    elif dtype == torch.int64:
        want = t
    else:
        want = t.float()
    p = model_tensors(model32)[param]
    got = p[expert] if expert is not None else p
    assert got.dtype == (torch.int64 if dtype == torch.int64 else torch.float32)
    assert torch.equal(got, want)
    assert want.abs().max() > 0


def test_every_parameter_equals_its_decoded_tensor(model32, stored, config):
    used: set[str] = set()
    for name, p in model_tensors(model32).items():
        names = official_names(name, config.n_routed_experts)
        want = [decoded(stored, n) for n in names]
        want = torch.stack(want) if p.dim() == 3 and len(names) > 1 else want[0]
        assert p.dtype == (torch.int64 if want.dtype == torch.int64 else torch.float32), name
        assert torch.equal(p, want), name
        for n in names:
            used.add(n)
            if stored[n].dtype in (torch.float8_e4m3fn, torch.int8):
                used.add(scale_name(n))
    assert used == set(stored)  # nothing in the checkpoint went unchecked


KEPT_FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.ape|attn_sink|gate\.bias|norm\.weight)$")
# docs/deepseek_v4.md, "Tensors kept in bf16 or fp32": the official runtime up-casts the compressor projections to
# fp32; they are stored in bf16 and kept so (exact values; ops.linear_fp32 multiplies them in fp32)
COMPRESSOR = re.compile(r"compressor\.w(kv|gate)\.weight$")


def test_bfloat16_load_same_values_and_fp32_exceptions(model32, model16):
    m32, m16 = model_tensors(model32), model_tensors(model16)
    assert set(m32) == set(m16)
    kinds = {"fp32": 0, "bf16": 0}
    for name, p in m16.items():
        ref = m32[name]
        if ref.dtype == torch.int64:
            assert p.dtype == torch.int64, name
        elif KEPT_FP32.search(name):
            assert p.dtype == torch.float32, name
            kinds["fp32"] += 1
        else:
            assert p.dtype == torch.bfloat16, name
            kinds["bf16"] += 1
            assert torch.equal(ref.to(torch.bfloat16).float(), ref), name  # decoded values are exact in bf16
        assert torch.equal(p.float() if p.is_floating_point() else p, ref), name
    assert kinds["fp32"] > 50 and kinds["bf16"] > 50
    names = ("layers.2.ffn.w1", "layers.2.attn.wq_b.weight", "mtp.0.e_proj.weight", "embed.weight")
    compressors = [n for n in m16 if COMPRESSOR.search(n)]
    assert compressors
    for name in (*names, *compressors):
        assert m16[name].dtype == torch.bfloat16
    for name in ("layers.2.hc_attn_fn", "hc_head_base", "layers.2.attn.compressor.ape", "layers.4.attn.attn_sink"):
        assert m16[name].dtype == torch.float32
    for name in ("layers.3.ffn.gate.bias", "layers.2.attn.kv_norm.weight", "mtp.0.hnorm.weight", "norm.weight"):
        assert m16[name].dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# transformers names
# ---------------------------------------------------------------------------------------------------------------

# official name -> transformers name (docs/deepseek_v4.md, "transformers names"), for the FP8 weights stored in the
# transformers variant
HF_FP8 = {
    "layers.2.attn.wq_b.weight": "model.layers.2.self_attn.q_b_proj.weight",
    "layers.3.attn.wo_a.weight": "model.layers.3.self_attn.o_a_proj.weight",
    "layers.0.ffn.shared_experts.w2.weight": "model.layers.0.mlp.shared_experts.down_proj.weight",
    "layers.4.attn.indexer.wq_b.weight": "model.layers.4.self_attn.compressor.indexer.q_b_proj.weight",
    "layers.5.attn.wkv.weight": "model.layers.5.self_attn.kv_proj.weight",
}
HF_SPELLINGS = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.hc_head.hc_fn",
    "model.layers.0.attn_hc.fn",
    "model.layers.1.ffn_hc.scale",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.2.self_attn.sinks",
    "model.layers.2.self_attn.q_a_norm.weight",
    "model.layers.2.self_attn.compressor.position_bias",
    "model.layers.2.self_attn.compressor.kv_norm.weight",
    "model.layers.2.self_attn.compressor.indexer.kv_norm.weight",
    "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
    "model.layers.3.mlp.gate.e_score_correction_bias",
    "model.layers.0.mlp.gate.tid2eid",
    "model.layers.2.mlp.experts.gate_up_proj",
    "model.layers.2.mlp.experts.down_proj",
    "model.layers.2.mlp.shared_experts.up_proj.weight",
]


def test_transformers_named_checkpoint_loads(tmp_path, ckpt, config, stored, model32):
    sd = hf_state_dict(model32)
    assert all(k.startswith(("model.", "lm_head.")) for k in sd)
    assert set(HF_SPELLINGS) <= set(sd)
    # transformers' FP8 naming: the e4m3 weight plus `<module>.weight_scale_inv` (the stored UE8M0 scale)
    for off, hf in HF_FP8.items():
        assert sd[hf].shape == stored[off].shape
        sd[hf] = stored[off]
        sd[hf[: -len("weight")] + "weight_scale_inv"] = stored[scale_name(off)]
    # a float32 scale (as V3-era FP8 checkpoints store it) is multiplicative too, despite the name
    off, hf = "layers.5.attn.wkv.weight", HF_FP8["layers.5.attn.wkv.weight"]
    sd[hf[: -len("weight")] + "weight_scale_inv"] = stored[scale_name(off)].float()
    # transformers ignores `mtp.*`; the release keeps them under their official names
    sd.update({k: v for k, v in stored.items() if k.startswith("mtp.")})
    path = write(tmp_path / "hf", sd, ckpt)
    assert_same_params(load(path, config), model32)


def test_transformers_checkpoint_without_mtp(tmp_path, ckpt, model32):
    """transformers' names without MTP (all dequantised) load into a model without MTP, or into one with MTP that
    then loses it (tests/checkpoint/test_transformers_save.py loads what its save_pretrained really writes)."""
    path = write(tmp_path / "hf", hf_state_dict(model32), ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    no_mtp = DeepseekV4Config.from_dict({**raw, "num_nextn_predict_layers": 0})
    assert_same_params(load(path, no_mtp), model32, skip=("mtp.",))
    # a model built with MTP loses it (no tensor of the block at all), with a warning; the rest is loaded
    with capture_logs() as logs:
        with_mtp = load(path, DeepseekV4Config.from_dict(raw))
    assert [e["event"] for e in logs] == ["checkpoint has no MTP block: speculative decoding is off for this model"]
    assert len(with_mtp.mtp) == 0 and not has_mtp(with_mtp) and has_mtp(model32)
    assert_same_params(with_mtp, model32, skip=("mtp.",))
    # one tensor of the block: the block is there in part, an error naming the rest
    partial = write(
        tmp_path / "partial",
        {**hf_state_dict(model32), "mtp.0.hnorm.weight": torch.ones(model32.config.hidden_size)},
        ckpt,
    )
    with pytest.raises(CheckpointError, match=r"mtp\.0\."):
        load(partial, DeepseekV4Config.from_dict(raw))


def test_transformers_names_load_in_bfloat16(tmp_path, ckpt, config, stored, model32, model16):
    sd = hf_state_dict(model32)
    sd.update({k: v for k, v in stored.items() if k.startswith("mtp.")})
    path = write(tmp_path / "hf", sd, ckpt)
    assert_same_params(load(path, config, torch.bfloat16), model16)


# ---------------------------------------------------------------------------------------------------------------
# sharded checkpoints
# ---------------------------------------------------------------------------------------------------------------


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_sharded(path: Path, stored: dict[str, torch.Tensor], ckpt: Path, n: int = 3) -> list[str]:
    """Round-robin over sorted names, so every weight and its scale land in different shards."""
    path.mkdir(parents=True)
    keys = sorted(stored)
    weight_map = {k: shard_name(i % n, n) for i, k in enumerate(keys)}
    for i in range(n):
        part = {k: stored[k] for k in keys if weight_map[k] == shard_name(i, n)}
        save_file(part, str(path / shard_name(i, n)), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(ckpt / "config.json", path / "config.json")
    return [shard_name(i, n) for i in range(n)]


def test_sharded_checkpoint_loads(tmp_path, ckpt, config, stored, model32):
    path = tmp_path / "sharded"
    write_sharded(path, stored, ckpt)
    (path / "leftover.safetensors").write_bytes(b"not listed in the index, never read")
    assert_same_params(load(path, config), model32)


def test_sharded_missing_shard(tmp_path, small):
    ckpt, config, stored = small
    path = tmp_path / "sharded"
    shards = write_sharded(path, stored, ckpt)
    (path / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=re.escape(shards[1])):
        load(path, config)


def test_sharded_corrupt_shard(tmp_path, small):
    ckpt, config, stored = small
    path = tmp_path / "sharded"
    shards = write_sharded(path, stored, ckpt)
    data = (path / shards[2]).read_bytes()
    (path / shards[2]).write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=re.escape(shards[2])):
        load(path, config)


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


def without(stored: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    assert all(n in stored for n in names)
    return {k: v for k, v in stored.items() if k not in names}


@pytest.mark.parametrize(
    "name",
    [
        "layers.3.attn.wq_a.weight",
        "layers.1.attn.attn_sink",
        "layers.0.ffn.gate.tid2eid",
        "layers.2.ffn.shared_experts.w1.weight",
        "layers.4.ffn.experts.5.w2.weight",
        "mtp.0.e_proj.weight",
        "head.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path, small, name):
    ckpt, config, stored = small
    drop = [name] + ([scale_name(name)] if name.endswith(".weight") and scale_name(name) in stored else [])
    path = write(tmp_path / "ckpt", without(stored, *drop), ckpt)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors") as e:
        load(path, config)
    assert name in str(e.value)


def test_missing_routed_experts_are_named_one_by_one(tmp_path, small):
    ckpt, config, stored = small
    drop = [f"layers.2.ffn.experts.{e}.w3.{k}" for e in (1, 6) for k in ("weight", "scale")]
    path = write(tmp_path / "ckpt", without(stored, *drop), ckpt)
    with pytest.raises(CheckpointError, match="lacks 2 tensors") as e:
        load(path, config)
    assert "layers.2.ffn.experts.1.w3.weight" in str(e.value)
    assert "layers.2.ffn.experts.6.w3.weight" in str(e.value)


def fp8_like(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_blocks(torch.randn(shape))


@pytest.mark.parametrize(
    "name,replacement,want",
    [
        ("layers.1.attn_norm.weight", {"": torch.ones(65, dtype=torch.bfloat16)}, (64,)),
        ("layers.0.hc_attn_base", {"": torch.zeros(25)}, (24,)),
        ("layers.0.ffn.gate.tid2eid", {"": torch.zeros(SMALL_VOCAB, 3, dtype=torch.int64)}, (SMALL_VOCAB, 2)),
        ("layers.2.attn.wq_b.weight", dict(zip(("", "scale"), fp8_like((256, 48)))), (256, 32)),
        ("layers.2.ffn.experts.1.w2.weight", dict(zip(("", "scale"), quantize_mxfp4(torch.randn(64, 64)))), (64, 32)),
    ],
    ids=["norm", "hc_base", "tid2eid", "fp8", "mxfp4"],
)
def test_wrong_shape_names_tensor_file_and_shapes(tmp_path, small, name, replacement, want):
    ckpt, config, stored = small
    tensors = dict(stored)
    for suffix, t in replacement.items():
        tensors[scale_name(name) if suffix else name] = t
    path = write(tmp_path / "ckpt", tensors, ckpt)
    with pytest.raises(CheckpointError) as e:
        load(path, config)
    msg = str(e.value)
    assert name in msg and FILE in msg
    assert str(want) in msg
    got = tuple(replacement[""].shape)
    if replacement[""].dtype == torch.int8:
        got = (got[0], 2 * got[1])  # the logical (decoded) shape of packed FP4
    assert str(got) in msg


@pytest.mark.parametrize(
    "name", ["layers.2.attn.wq_b.weight", "mtp.0.h_proj.weight", "layers.3.ffn.experts.2.w1.weight"]
)
def test_quantised_weight_without_scale(tmp_path, small, name):
    ckpt, config, stored = small
    path = write(tmp_path / "ckpt", without(stored, scale_name(name)), ckpt)
    with pytest.raises(CheckpointError, match="no scale") as e:
        load(path, config)
    assert name in str(e.value) and FILE in str(e.value)


def test_scale_of_wrong_shape(tmp_path, small):
    ckpt, config, stored = small
    name = "layers.2.attn.wq_b.weight"  # [256, 32]: scale [2, 1]
    bad = torch.full((3, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    path = write(tmp_path / "ckpt", {**stored, scale_name(name): bad}, ckpt)
    with pytest.raises(CheckpointError, match="scale shape") as e:
        load(path, config)
    assert name in str(e.value) and FILE in str(e.value)


@pytest.mark.parametrize("corruption", ["truncate_half", "truncate_tail", "garbage", "empty"])
def test_corrupt_file_is_named(tmp_path, small, corruption):
    ckpt, config, _ = small
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(ckpt / "config.json", path / "config.json")
    data = (ckpt / FILE).read_bytes()
    name = "model-00001-of-00001.safetensors"
    bad = {
        "truncate_half": data[: len(data) // 2],
        "truncate_tail": data[:-7],
        "garbage": bytes(range(256)) * 64,
        "empty": b"",
    }[corruption]
    (path / name).write_bytes(bad)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load(path, config)


def test_unexpected_tensor_is_named(tmp_path, small):
    ckpt, config, stored = small
    path = write(tmp_path / "ckpt", {**stored, "layers.0.attn.bogus.weight": torch.zeros(4)}, ckpt)
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load(path, config)
    assert "layers.0.attn.bogus.weight" in str(e.value) and FILE in str(e.value)


def test_expert_index_out_of_range(tmp_path, small):
    ckpt, config, stored = small
    extra = {
        "layers.2.ffn.experts.8.w1.weight": stored["layers.2.ffn.experts.0.w1.weight"],
        "layers.2.ffn.experts.8.w1.scale": stored["layers.2.ffn.experts.0.w1.scale"],
    }
    path = write(tmp_path / "ckpt", {**stored, **extra}, ckpt)
    with pytest.raises(CheckpointError, match="expert 8") as e:
        load(path, config)
    assert "layers.2.ffn.experts.8.w1.weight" in str(e.value)


def test_tolerated_extra_tensors(tmp_path, small):
    """MTP copies of embed/head and MTP stages beyond the ones the model runs are skipped."""
    ckpt, config, stored = small
    extra = {
        "mtp.0.embed.weight": stored["embed.weight"],
        "mtp.0.head.weight": stored["head.weight"],
        "mtp.1.attn_norm.weight": stored["mtp.0.attn_norm.weight"],
    }
    path = write(tmp_path / "ckpt", {**stored, **extra}, ckpt)
    assert_same_params(load(path, config), load(ckpt, config))


def test_directory_without_safetensors(tmp_path, small):
    ckpt, config, _ = small
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load(tmp_path, config)


# ---------------------------------------------------------------------------------------------------------------
# checkpoint.hub
# ---------------------------------------------------------------------------------------------------------------


def test_resolve_model_offline_hub_id(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(ModelUnavailable) as e:
        resolve_model("deepinfer-test/no-such-model", None, cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "deepinfer-test/no-such-model" in msg
    assert "DEEPINFER_HF_MODEL_DIR" in msg and "make-tiny-model" in msg


def test_resolve_model_local_paths(tmp_path, ckpt):
    assert resolve_model(ckpt, None) == ckpt
    assert resolve_model(str(ckpt), None) == ckpt
    assert resolve_model(None, str(ckpt)) == ckpt  # DEEPINFER_HF_MODEL_DIR when no model is given
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(ModelUnavailable, match="not a directory") as e:
            resolve_model(str(bad), None)
        assert "DEEPINFER_HF_MODEL_DIR" in str(e.value)


def test_check_architecture(tmp_path, ckpt):
    raw = check_architecture(ckpt)
    assert raw["model_type"] == "deepseek_v4" and raw["compress_ratios"] == TINY_V4["compress_ratios"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelUnavailable, match="'llama'") as e:
        check_architecture(tmp_path)
    assert "make-tiny-model" in str(e.value)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelUnavailable, match="config.json"):
        check_architecture(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# DeepseekV4Config.from_dict: official and transformers spellings
# ---------------------------------------------------------------------------------------------------------------


def official_raw(**changes) -> dict:
    return {**TINY_V4, "rope_theta": 5000.0, "compress_rope_theta": 40000.0, **changes}


def transformers_raw(**changes) -> dict:
    raw = {
        k: v
        for k, v in TINY_V4.items()
        if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")
        and k not in ("rope_theta", "compress_rope_theta")
    }
    raw.update(
        layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4,
        partial_rotary_factor=0.25,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 5000.0},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 40000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "attention_factor": 1.0,
            },
        },
    )
    raw.update(changes)
    return raw


def test_config_official_and_transformers_keys_agree():
    off = DeepseekV4Config.from_dict(official_raw())
    hf = DeepseekV4Config.from_dict(transformers_raw())
    assert off == hf
    assert off.compress_ratios == (0, 0, 4, 8, 4, 8, 0)
    assert [off.layer_kind(i) for i in range(7)] == ["swa", "swa", "csa", "hca", "csa", "hca", "swa"]
    assert off.num_hash_layers == 2 and off.qk_rope_head_dim == 16
    assert off.rope_theta == 5000.0 and off.compress_rope_theta == 40000.0
    assert off.yarn == YarnParams(16.0, 64, 32.0, 1.0)
    assert off.weight_block_size == (128, 128) and off.expert_dtype == "fp4"


def test_config_from_transformers_config_object(config):
    """What transformers itself writes (top-level thetas plus nested rope_parameters) parses back."""
    assert DeepseekV4Config.from_dict(hf_config(config).to_dict()) == config


def test_config_variants():
    no_yarn = official_raw(rope_scaling=None)
    assert DeepseekV4Config.from_dict(no_yarn).yarn is None
    default = {"rope_type": "default"}
    hf_no_yarn = transformers_raw(rope_parameters={"main": default, "compress": default})
    assert DeepseekV4Config.from_dict(hf_no_yarn).yarn is None
    v41 = official_raw(quantization_config={"weight_block_size": [32, 32], "expert_dtype": "fp4"}, expert_dtype=None)
    assert DeepseekV4Config.from_dict(v41).weight_block_size == (32, 32)
    # legacy official keys win over transformers ones when both are present
    both = {**transformers_raw(), "compress_ratios": [0] * 6 + [0], "num_hash_layers": 1, "qk_rope_head_dim": 8}
    c = DeepseekV4Config.from_dict(both)
    assert c.compress_ratios == (0,) * 7 and c.num_hash_layers == 1 and c.qk_rope_head_dim == 8
    # HCA ratio from compress_rates
    c = DeepseekV4Config.from_dict(transformers_raw(compress_rates={"heavily_compressed_attention": 128}))
    assert c.compress_ratios == (0, 0, 4, 128, 4, 128, 0)


@pytest.mark.parametrize(
    "raw",
    [
        official_raw(model_type="llama"),
        official_raw(compress_ratios=[0, 0, 4]),
        official_raw(compress_ratios=[0, 0, 4, -8, 4, 8, 0]),
        official_raw(qk_rope_head_dim=15),
        official_raw(qk_rope_head_dim=128),
        official_raw(scoring_func="softmax"),
        official_raw(num_experts_per_tok=9),
        official_raw(o_groups=3),
        {k: v for k, v in official_raw().items() if k != "compress_ratios"},
        transformers_raw(layer_types=["sliding_attention"] * 5 + ["full_attention"]),
        transformers_raw(partial_rotary_factor=1.5),
    ],
    ids=[
        "model_type",
        "short_ratios",
        "negative_ratio",
        "odd_rope_dim",
        "rope_dim_gt_head_dim",
        "scoring",
        "topk_gt_experts",
        "o_groups",
        "no_layer_schedule",
        "unknown_layer_type",
        "rotary_factor",
    ],
)
def test_config_bad_values(raw):
    with pytest.raises(ValueError):
        DeepseekV4Config.from_dict(raw)
