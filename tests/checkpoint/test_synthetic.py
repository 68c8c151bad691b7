"""Random checkpoints written tensor by tensor (``checkpoint.synthetic``): the names and storage formats of the
official checkpoint (the same as the tiny writer's), shards with an index the loader follows, MXFP4 experts of
about unit-norm rows, and the V4-Flash config it writes parsing to V4-Flash's widths."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.synthetic import flash_config, write_random_checkpoint
from deepinfer.checkpoint.tiny import TINY_V4, random_weights, to_official_tensors
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.quant.formats import dequantize_mxfp4


def test_the_flash_config_is_v4_flash_at_reduced_depth() -> None:
    c = DeepseekV4Config.from_dict(flash_config(4, mtp=1))
    flash = DeepseekV4Config(num_hidden_layers=4, compress_ratios=(0, 0, 4, 128, 0), num_nextn_predict_layers=1)
    assert c == DeepseekV4Config(**{**flash.__dict__, "num_hash_layers": 2})  # V4-Flash has 3; 2 of 4 here
    assert (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.head_dim) == (4096, 256, 2048, 512)
    ratios = json.loads(json.dumps(flash_config(43)))["compress_ratios"]
    assert len(ratios) == 43 and ratios[:4] == [0, 0, 4, 128] and set(ratios[2:]) == {4, 128}


def test_a_sharded_checkpoint_in_the_official_format_that_serves(tmp_path) -> None:
    path = write_random_checkpoint(tmp_path / "m", TINY_V4, seed=2, shard_bytes=256 * 1024)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((path / f).exists() for f in files)
    stored: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as sf:
            stored |= {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118 - safe_open has no __iter__
    config = DeepseekV4Config.from_dict(TINY_V4)
    tiny = to_official_tensors(config, random_weights(config, 0))
    assert set(stored) == set(tiny) == set(index["weight_map"])
    assert {k: (v.dtype, tuple(v.shape)) for k, v in stored.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in tiny.items()
    }
    expert = next(k for k in stored if ".experts.0.w1.weight" in k)
    w = dequantize_mxfp4(stored[expert], stored[expert.removesuffix("weight") + "scale"])
    rms = w.pow(2).mean(-1).sqrt().mean().item() * w.shape[1] ** 0.5  # rows of about unit norm
    assert 0.5 < rms < 2.0
    llm = LLM(model=str(path), dtype="float32", num_pages=32, page_size=16)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4
