"""How a model fits on ``N`` GPUs of one worker: weights per rank, KV state per token and per sequence, the largest
batch × context, from the model's config alone (``deepinfer plan``).

The layout is the one ``parallel`` serves: the routed experts of the trunk sharded across the ``N`` ranks (expert
parallelism, ``ExpertPlacement.even``), everything else on every rank (attention data-parallel: each rank attends
over its own sequences), DeepSeek-V4.1's Engram tables in host memory or on the device
(``DEEPINFER_ENGRAM_TABLES``). The bytes are those of the model the worker builds: the model is constructed on the
``meta`` device (nothing allocated), switched to the checkpoint's stored formats as the NVIDIA worker keeps them
(FP8 linears and MXFP4 experts with their scales, ``quant.native``), and every other parameter counted in the dtype
the loader gives it (bf16, or fp32 where the checkpoint keeps fp32). The KV state is the paged cache's (the
compressed rows and index keys of every compressed layer, bf16) and the state pool's (each sequence's window rings
and compressor rings). ``reserve`` covers what the plan does not model: the CUDA context, activations, graphs.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.engine.models import family_of, parse_config
from deepinfer.parallel.placement import ExpertPlacement

GIB = 2**30
_STORED = (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int64, torch.int32)  # kept as they are
BATCHES = (1, 16, 64, 256)


class PlanError(ValueError):
    """The model does not fit the GPUs given."""


@dataclass
class MemoryPlan:
    model: str
    gpus: int
    gpu_bytes: int
    reserve: int
    engram: str  # where V4.1's Engram tables are: "host" or "device"
    weights: dict[str, int]  # the whole model's bytes by part
    experts_per_rank: int  # most routed experts of a trunk layer on one rank
    n_experts: int
    rank_gpu: dict[str, int]  # one rank's GPU bytes by part (the most loaded rank)
    rank_host: int  # the host bytes of one host's ranks (Engram tables placed there: shared by its ranks)
    kv_per_token: dict[str, int] = field(default_factory=dict)  # paged cache bytes per token, by layer kind
    per_sequence: int = 0  # window and compressor rings of one sequence
    max_position: int = 0
    tp: int = 1  # ranks of a tensor-parallel group (the trunk's attention heads split among them)

    @property
    def gpu_used(self) -> int:
        return sum(self.rank_gpu.values()) + self.reserve

    @property
    def free(self) -> int:
        return self.gpu_bytes - self.gpu_used

    @property
    def token_bytes(self) -> int:
        return sum(self.kv_per_token.values())

    def context(self, batch: int) -> int:
        """The longest context ``batch`` sequences of one rank can each hold (the model's limit at most)."""
        left = self.free - batch * self.per_sequence
        if left <= 0:
            return 0
        return min(self.max_position, left // (batch * max(self.token_bytes, 1)))


def plan(path: str | Path, gpus: int, gpu_bytes: int, reserve: int = 8 * GIB, engram: str = "host", tp: int = 1
         ) -> MemoryPlan:  # fmt: skip
    """The plan of the model whose config.json is in ``path`` on ``gpus`` GPUs of ``gpu_bytes`` each, the trunk's
    attention heads split over tensor-parallel groups of ``tp`` (PlanError: it does not fit)."""
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    if tp < 1 or gpus % tp:
        raise PlanError(f"--tp {tp} must divide --gpus {gpus}")
    if engram not in ("host", "device"):
        raise PlanError(f"Engram tables go to 'host' or 'device', not {engram!r}")
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    config = parse_config(raw)
    text = getattr(config, "text_config", config)
    net = _meta_model(config)
    weights, kinds = _weights(net, config)
    if text.n_routed_experts < gpus:
        raise PlanError(f"{text.n_routed_experts} routed experts cannot be spread over {gpus} GPUs")
    n = text.n_routed_experts  # with EPLB, its extra slots held from the start (``launch.expert_group``)
    eplb = envs.DEEPINFER_EPLB_EXTRA_SLOTS if envs.DEEPINFER_EPLB_INTERVAL_STEPS > 0 and gpus > 1 else 0
    placement = ExpertPlacement.even(n, gpus, -(-n // gpus) + eplb if eplb else 0)
    most = max(len(s) for s in placement.slots)
    rank_gpu = {k: v for k, v in weights.items() if k not in ("routed experts", "Engram tables")}
    rank_gpu["routed experts"] = weights.get("routed experts", 0) * most // text.n_routed_experts
    if HEADS in rank_gpu:  # (the shards of the released models' heads fall on whole FP8 blocks)
        heads, groups = text.num_attention_heads, text.o_groups
        if heads % tp or groups % tp:
            raise PlanError(f"--tp {tp}: {heads} heads in {groups} output groups cannot be split over {tp} ranks")
        rank_gpu[HEADS] = -(-rank_gpu[HEADS] // tp)
    host = 0
    if weights.get("Engram tables"):
        if engram == "host":
            host = weights["Engram tables"]
        else:
            rank_gpu["Engram tables"] = weights["Engram tables"]
    p = MemoryPlan(path.name, gpus, gpu_bytes, reserve, engram, weights, most, text.n_routed_experts, rank_gpu, host,
                   tp=tp)  # fmt: skip
    p.kv_per_token, p.per_sequence = _kv(net, config, kinds)
    p.max_position = text.max_position_embeddings
    if p.free <= 0:
        need = p.gpu_used / GIB
        hint = (
            " (DEEPINFER_ENGRAM_TABLES=host keeps the Engram tables in host memory)"
            if "Engram tables" in rank_gpu
            else ""
        )
        raise PlanError(
            f"{path.name} does not fit {gpus} GPU(s) of {gpu_bytes / GIB:.1f} GiB: one rank needs {need:.1f} GiB "
            f"(weights {sum(rank_gpu.values()) / GIB:.1f} + reserve {reserve / GIB:.1f}){hint}\n" + render(p)
        )
    return p


def _meta_model(config: object) -> torch.nn.Module:
    """The model of ``config`` on the meta device, in the stored formats the NVIDIA worker keeps."""
    from deepinfer.quant.native import prepare_native

    with torch.device("meta"):
        if getattr(config, "text_config", None) is not None:
            from deepinfer.models.deepseek_v41.model import DeepseekV41Model

            token_map = None
            if config.text_config.engram_layer_ids:  # (the hash tables' shape only: any map of the right size)
                n = config.text_config.engram_compressed_vocab_size
                token_map = [i % n for i in range(config.text_config.vocab_size)]
            net = DeepseekV41Model(config, None, token_map)
        else:
            from deepinfer.models.deepseek_v4.model import DeepseekV4Model

            net = DeepseekV4Model(config)
        prepare_native(net, tuple(config.weight_block_size), quantize=False)
    return net


def _weights(net: torch.nn.Module, config: object) -> tuple[dict[str, int], Counter]:
    """The model's bytes by part, and its attention layers' count by kind."""
    v41 = getattr(config, "text_config", None) is not None
    if v41:
        from deepinfer.checkpoint.names_v41 import keeps_fp32
    else:
        from deepinfer.checkpoint.loader import _FP32

        def keeps_fp32(name: str) -> bool:
            return bool(_FP32.search(name))

    out: Counter = Counter()
    for name, t in net.named_parameters():
        size = t.element_size() if t.dtype in _STORED else 4 if keeps_fp32(name) else 2
        out[_part(name)] += t.numel() * size
    for name, t in net.named_buffers():
        if t is not None:
            out[_part(name)] += t.numel() * t.element_size()
    kinds = Counter(_kind(layer.attn) for layer in net.layers)
    return dict(out), kinds


HEADS = "attention heads (wq_b, wo_a, wo_b, sinks)"
_HEADS = re.compile(r"^layers\.\d+\.attn\.(wq_b\.|wo_a\.|wo_b\.|attn_sink$)")


def _part(name: str) -> str:
    if ".engram.embed." in name:
        return "Engram tables"
    if name.startswith("mtp."):
        return "drafter (MTP / DSpark)"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision tower"
    if name.startswith(("embed.", "head.")):
        return "embeddings and head"
    if name.startswith("layers.") and ".ffn.w" in name and ".shared_" not in name:
        return "routed experts"
    if _HEADS.match(name):
        return HEADS
    return "attention, shared experts, routers, norms"


def _kind(attn: torch.nn.Module) -> str:
    m = getattr(attn, "ratio", None)
    if m is None:
        comp = getattr(attn, "compressor", None)
        m = comp.ratio if comp is not None else 0
    return "window only" if not m else f"compressed, ratio {m}"


def _kv(net: torch.nn.Module, config: object, kinds: Counter) -> tuple[dict[str, int], int]:
    """The paged cache's bytes per token by layer kind, and one sequence's window and compressor rings."""
    family = family_of(config)
    page = 256 * config.page_multiple if hasattr(config, "page_multiple") else 256
    cache = family.new_cache(config, 1, page, torch.bfloat16, "meta")
    per_token: Counter = Counter()
    for layer, m in cache.ratios.items():
        stores = [cache.rows[layer]] + ([cache.index_keys[layer]] if layer in cache.index_keys else [])
        per_token[f"compressed, ratio {m}"] += sum(x[0].numel() * x.element_size() for x in stores) / page
    rings = 0
    for mod in net.modules():
        if hasattr(mod, "pool_specs") and hasattr(mod, "layer_id"):
            windows, bufs = mod.pool_specs()
            rings += sum(rows * dim * 2 for rows, dim in windows.values())  # bf16 windows
            rings += sum(spec[0] * spec[1] * 4 * 2 for spec in bufs.values())  # fp32 kv and score rings
    return {k: math.ceil(v) for k, v in sorted(per_token.items())}, rings


def render(p: MemoryPlan) -> str:
    """The plan as text (``deepinfer plan``)."""
    g = GIB
    groups = p.gpus // p.tp
    dp = ("each rank its own sequences" if p.tp == 1 else
          f"{groups} group{'s' if groups > 1 else ''} of {p.tp} ranks, the heads split in each")  # fmt: skip
    lines = [f"{p.model} on {p.gpus} GPU(s) of {p.gpu_bytes / g:.1f} GiB (expert parallel over {p.gpus}, attention "
             f"data parallel: {dp})", "", "weights (whole model):"]  # fmt: skip
    lines += [f"  {k:<44} {v / g:9.2f} GiB" for k, v in sorted(p.weights.items())]
    heads = f", 1/{p.tp} of the attention heads" if p.tp > 1 else ""
    lines += ["", f"one rank (up to {p.experts_per_rank} of {p.n_experts} routed experts per trunk layer{heads}; the "
              "drafter whole on every rank, which drafts for its own sequences):"]  # fmt: skip
    lines += [f"  {k:<44} {v / g:9.2f} GiB" for k, v in sorted(p.rank_gpu.items())]
    lines += [f"  {'reserve (context, activations, graphs)':<44} {p.reserve / g:9.2f} GiB",
              f"  {'GPU total':<44} {p.gpu_used / g:9.2f} GiB of {p.gpu_bytes / g:.1f}"]  # fmt: skip
    if p.rank_host:
        lines.append(f"  {'host memory (Engram tables, once per host)':<44} {p.rank_host / g:9.2f} GiB")
    lines += ["", "KV state:"]
    lines += [f"  paged cache, {k:<31} {v:9d} B / token" for k, v in p.kv_per_token.items()]
    lines += [f"  {'paged cache, all layers':<44} {p.token_bytes:9d} B / token",
              f"  {'window and compressor rings':<44} {p.per_sequence / 2**20:9.2f} MiB / sequence"]  # fmt: skip
    free = max(p.free, 0)
    lines += ["", f"left for KV state per rank: {free / g:.2f} GiB = {free // max(p.token_bytes, 1):,} tokens"]
    lines.append(
        "largest context per sequence (per rank; the whole worker serves the batch times the "
        f"{'ranks' if p.tp == 1 else 'groups'}):"
    )
    lines += [f"  batch {b:>4}: {p.context(b):>9,} tokens" for b in BATCHES]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """``141GB``, ``141 GiB``, ``80G``, ``1.5TB`` or a plain number of bytes."""
    s = text.strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "TB": 10**12, "GB": 10**9, "MB": 10**6, "T": 10**12,
             "G": 10**9, "M": 10**6, "B": 1}  # fmt: skip
    for unit, scale in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise PlanError(f"cannot read a memory size from {text!r} (e.g. 141GB, 80GiB)") from None


__all__ = ["GIB", "HEADS", "MemoryPlan", "PlanError", "parse_bytes", "plan", "render"]
