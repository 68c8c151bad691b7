"""Tensor parallelism of the attention projections: a group of ``tp`` ranks runs the same sequences, each rank the
attention of ``1/tp`` of the heads.

DeepSeek-V4's and V4.1's attention is MQA: one KV row per token shared by every head, so the KV state (window,
compressed rows, index keys) is not split; what is split is each layer's per-head weights, which dominate the dense
part of the larger models (docs/parallelism.md):

* ``wq_b`` by output rows (the rank's heads' queries), ``attn_sink`` by head;
* ``wo_a`` (the grouped output projection) by its groups: the heads of a group are consecutive, so a rank holding
  ``o_groups / tp`` groups holds exactly its heads' ``wo_a``;
* ``wo_b`` by input columns (the rank's groups' ranks of the low-rank output): each rank's product is a partial
  sum of the layer's output, and ``TensorParallel.reduce`` adds the partials.

``reduce`` gathers every rank's partial and adds them in rank order on each rank, in fp32, so every rank of the
group holds the same bits, and a row's result does not depend on the other rows of the step: with the
batch-invariant ops a tensor-parallel worker stays batch-invariant and repeatable. Its sums are not the order of one
GEMM over the whole width, so its output equals a single rank's within fp32 rounding, not bit for bit.

The routed experts stay expert-parallel over every rank of the worker: each rank of a tensor-parallel group sends
its share of the group's tokens (``rows``) to the experts and ``gather_rows`` puts the group's outputs back together,
so no token is computed twice.

The checkpoint loaders read a rank's slice only (``TensorShards``): a safetensors slice of each sharded tensor; an
FP8 weight by the whole scale blocks that cover the slice, cut after dequantisation (a weight kept in the stored
format must have its slice on block boundaries, as the released models' have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class TensorParallel:
    """One rank's view of its tensor-parallel group (``group``: a ``torch.distributed`` group of ``size`` ranks, this
    one ``rank`` in it)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of every rank's ``x`` (same shape on each), added in rank order in fp32, in
        ``x``'s dtype."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = parts[0].float()
        for p in parts[1:]:
            out = out + p.float()
        return out.to(x.dtype)

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's share ``[a, b)`` of ``n`` rows the whole group holds: consecutive, the first ranks one more."""
        base, extra = divmod(n, self.size)
        a = self.rank * base + min(self.rank, extra)
        return a, a + base + (1 if self.rank < extra else 0)

    def gather_rows(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's ``rows(n)`` share of a result (``y``: this rank's) put together: ``[n, ...]`` on every rank."""
        width = -(-n // self.size)
        pad = y.new_zeros((width, *y.shape[1:]))
        pad[: y.shape[0]] = y
        parts = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(parts, pad, group=self.group)
        base, extra = divmod(n, self.size)
        return torch.cat([p[: base + (1 if r < extra else 0)] for r, p in enumerate(parts)])


@dataclass(frozen=True)
class Shard:
    """A parameter holding ``[start, stop)`` of its checkpoint tensor along ``dim`` (``full``: that dimension's
    size in the checkpoint)."""

    dim: int
    start: int
    stop: int
    full: int

    def read(self, sl: Any, block: int | None) -> torch.Tensor:
        """This shard of a safetensors slice ``sl``: the exact rows / columns, or with ``block`` (an FP8 weight
        dequantised here) the whole blocks that cover them (``cut`` trims it after dequantisation)."""
        a, b = self.start, self.stop
        if block:
            a, b = a // block * block, min(-(-b // block) * block, self.full)
        return sl[a:b] if self.dim == 0 else sl[:, a:b]

    def read_scale(self, sl: Any, block: int) -> torch.Tensor:
        """The scale blocks of an FP8 weight that cover this shard."""
        a, b = self.start // block, -(-self.stop // block)
        return sl[a:b] if self.dim == 0 else sl[:, a:b]

    def cut(self, t: torch.Tensor, block: int) -> torch.Tensor:
        """This shard of ``t``: read exact (returned as it is) or by the whole ``block`` s that cover it."""
        n = self.stop - self.start
        return t if t.shape[self.dim] == n else t.narrow(self.dim, self.start % block, n)

    def aligned(self, block: int) -> bool:
        """Whether the shard starts and ends on ``block`` boundaries (the stored FP8 format can be kept)."""
        return self.start % block == 0 and (self.stop % block == 0 or self.stop == self.full)


def shard_attention(attn: nn.Module, tp: TensorParallel) -> None:
    """Keep this rank's heads of one attention module of DeepSeek-V4 or V4.1 (``wq_b``, ``attn_sink``, ``wo_a``,
    ``wo_b``: module docstring); its output is then ``tp.reduce``d. Before ``quant.native.prepare_native`` and
    before loading (a loaded module's values are cut too)."""
    h, g, d, ol, r, n = attn.n_heads, attn.o_groups, attn.head_dim, attn.o_lora_rank, tp.rank, tp.size
    if h % n or g % n:
        raise ValueError(f"tp={n}: the attention's {h} heads in {g} output groups cannot be split over {n} ranks "
                         "(tp must divide both)")  # fmt: skip
    hl, gl = h // n, g // n
    shards = {
        "wq_b.weight": Shard(0, r * hl * d, (r + 1) * hl * d, h * d),
        "attn_sink": Shard(0, r * hl, (r + 1) * hl, h),
        "wo_a.weight": Shard(0, r * gl * ol, (r + 1) * gl * ol, g * ol),
        "wo_b.weight": Shard(1, r * gl * ol, (r + 1) * gl * ol, g * ol),
    }
    for name, sh in shards.items():
        owner, _, leaf = name.rpartition(".")
        mod = attn.get_submodule(owner) if owner else attn
        p = getattr(mod, leaf)
        if p.shape[sh.dim] != sh.full:
            raise ValueError(f"{name}: {p.shape[sh.dim]} along dim {sh.dim}, expected {sh.full} (sharded twice?)")
        part = p.data.narrow(sh.dim, sh.start, sh.stop - sh.start).clone()
        setattr(mod, leaf, nn.Parameter(part, requires_grad=False))
    attn.n_heads, attn.o_groups = hl, gl
    attn.tp, attn.tp_shards = tp, shards


def shard_heads(model: nn.Module, tp: TensorParallel | None) -> None:
    """``shard_attention`` for every trunk layer of ``model`` (``model.layers[i].attn``; the drafters' blocks keep
    every head, as they keep every expert); nothing for no group or a group of one."""
    if tp is None or tp.size == 1:
        return
    for layer in model.layers:
        shard_attention(layer.attn, tp)


def reduce_output(attn: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """An attention module's ``wo_b`` output, summed over its tensor-parallel group where it has one."""
    tp = getattr(attn, "tp", None)
    return y if tp is None else tp.reduce(y)


class TensorShards:
    """Which targets of a model hold a shard of their checkpoint tensor (``shard_attention``), by target name: what
    a checkpoint loader reads of each (``Shard.read`` / ``read_scale``) and cuts (``Shard.cut``)."""

    def __init__(self, model: nn.Module) -> None:
        self.shards: dict[str, Shard] = {}
        for prefix, mod in model.named_modules():
            for leaf, sh in getattr(mod, "tp_shards", {}).items():
                self.shards[f"{prefix}.{leaf}" if prefix else leaf] = sh

    def get(self, target: str) -> Shard | None:
        return self.shards.get(target)

    def read(self, sl: Any, target: str, scale: bool, block: tuple[int, int]) -> torch.Tensor | None:
        """The part of a safetensors slice ``sl`` of ``target``'s tensor (``scale``: its FP8 block scales) this
        model holds; None: ``target`` is not sharded (read it whole)."""
        sh = self.shards.get(target)
        if sh is None:
            return None
        b = block[sh.dim]
        if scale:
            return sh.read_scale(sl, b)
        return sh.read(sl, b if sl.get_dtype().startswith("F8") else None)


__all__ = ["Shard", "TensorParallel", "TensorShards", "reduce_output", "shard_attention", "shard_heads"]
