"""Random DeepSeek-V4 checkpoints at any width, in the official format, written tensor by tensor.

The tiny checkpoints (``checkpoint.tiny``) build the whole model in host memory first; at V4-Flash's width that is
~100 GB for four layers, so benchmarks of the served model at the real width (the mesh against the in-process
engine, speculation) need this instead: the model is built on the ``meta`` device for its names and shapes only,
each tensor is drawn, encoded as the official checkpoint stores it (FP8 e4m3 linears with 128×128 UE8M0 block
scales, MXFP4 routed experts, bf16 / fp32 elsewhere) and written in shards of ``shard_bytes`` with a
``model.safetensors.index.json``. Routed experts are drawn directly as MXFP4 codes (uniform over the 16 e2m1 codes)
with one power-of-two scale giving rows of about unit norm, as quantising drawn values would cost minutes at this
width. Random weights: for speed and memory, not for meaningful output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.checkpoint.names import internal_to_official
from deepinfer.checkpoint.tiny import TINY_V4, official_tensors, random_tensor
from deepinfer.checkpoint.tiny_files import copy_tokenizer, write_configs
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.quant.formats import MXFP4_BLOCK

FP4_MEAN_SQUARE = (0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8  # of the 16 e2m1 codes drawn uniformly


def flash_ratios(n: int, hca: int = 128) -> list[int]:
    """V4-Flash's layer pattern: two sliding-window layers, then CSA (ratio 4) and HCA alternating."""
    return ([0, 0] + [4 if i % 2 == 0 else hca for i in range(max(n - 2, 0))])[:n]


def flash_config(layers: int, mtp: int = 0, hash_layers: int = 2) -> dict[str, Any]:
    """config.json of a V4-Flash-width model of ``layers`` layers (and ``mtp`` MTP blocks): the widths are
    ``DeepseekV4Config``'s defaults (V4-Flash's: hidden 4096, 64 heads of 512, 256 experts top-6 of width 2048)."""
    c = DeepseekV4Config(num_hidden_layers=layers, compress_ratios=tuple(flash_ratios(layers) + [0] * mtp))
    raw = {k: v for k, v in TINY_V4.items() if k not in ("rope_scaling", "quantization_config")}
    for key in TINY_V4:
        if hasattr(c, key) and key not in ("compress_ratios",):
            raw[key] = getattr(c, key)
    raw |= {"num_hidden_layers": layers, "num_nextn_predict_layers": mtp, "num_hash_layers": min(hash_layers, layers)}
    raw["compress_ratios"] = list(c.compress_ratios)
    if c.yarn is not None:
        y = c.yarn
        raw["rope_scaling"] = {"type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                               "original_max_position_embeddings": y.original_max_position_embeddings}  # fmt: skip
    raw["quantization_config"] = {**TINY_V4["quantization_config"], "weight_block_size": list(c.weight_block_size)}
    return raw


def random_mxfp4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 codes ``[rows, cols/2]`` (int8, uniform) and their UE8M0 scales ``[rows, cols/32]``: one power of
    two making the row's values of RMS about ``cols ** -0.5``."""
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    exponent = round(math.log2(1.0 / math.sqrt(cols * FP4_MEAN_SQUARE)))
    scale = torch.full((rows, cols // MXFP4_BLOCK), 127 + exponent, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


class _Shards:
    """Tensors gathered into safetensors shards of about ``limit`` bytes, and the index's weight map."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.count = 0, 0
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.pending[name] = t.contiguous()
            self.size += t.numel() * t.element_size()
            if self.size >= self.limit:
                self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.count += 1
        fname = f"model-{self.count:05d}.safetensors"
        save_file(self.pending, str(self.path / fname), metadata={"format": "pt", "generator": "deepinfer"})
        self.weight_map |= dict.fromkeys(self.pending, fname)
        self.total += self.size
        self.pending, self.size = {}, 0

    def write_index(self) -> None:
        self.flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def write_random_checkpoint(path: str | Path, raw: dict[str, Any], seed: int = 0, shard_bytes: int = 4 << 30) -> Path:
    """Write a random checkpoint of config ``raw`` (config.json's dict; e.g. :func:`flash_config`) to ``path``,
    tensor by tensor (module docstring); returns the path."""
    config = DeepseekV4Config.from_dict(raw)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = DeepseekV4Model(config)
    g = torch.Generator().manual_seed(seed)
    shards = _Shards(path, shard_bytes)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dim() == 3 and name.endswith((".w1", ".w2", ".w3")):  # routed experts: drawn as stored
            for e in range(p.shape[0]):
                off = internal_to_official(name, e)
                packed, scale = random_mxfp4(p.shape[1], p.shape[2], g)
                shards.add({off: packed, off[: -len("weight")] + "scale": scale})
            continue
        shards.add(official_tensors(config, name, random_tensor(config, name, p.shape, g)))
    shards.write_index()
    write_configs(path, raw)
    copy_tokenizer(path)
    return path


__all__ = ["flash_config", "flash_ratios", "random_mxfp4", "write_random_checkpoint"]
