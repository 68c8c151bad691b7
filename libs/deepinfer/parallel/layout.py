"""How a worker's ranks are laid out (docs/parallelism.md), with no torch here: ``deepinfer up`` checks a layout
before it starts anything.

* ``ranks``: the worker's processes, one device each; the routed experts are sharded over all of them (expert
  parallel, ``ep``);
* ``tp``: ranks of a tensor-parallel group, which run the same sequences with the attention's heads split among them
  (``tensor_parallel``);
* ``cp``: ranks of a context-parallel group, which run the same sequences with each step's tokens split among them
  (``context_parallel``); a group is tensor-parallel or context-parallel, not both;
* ``dp``: ``ranks / (tp · cp)`` attention data-parallel groups, each attending over its own sequences with its own
  KV pages: the ranks the scheduler plans a step for (``WorkerInfo.world_size``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    ranks: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def group(self) -> int:
        """Ranks that run the same sequences (a tensor- or context-parallel group; 1: each rank its own)."""
        return self.tp * self.cp

    @property
    def dp(self) -> int:
        """Attention data-parallel groups (each its own sequences)."""
        return self.ranks // self.group

    def group_of(self, rank: int) -> int:
        """The data-parallel group of ``rank`` (its tensor- or context-parallel group's index)."""
        return rank // self.group


def layout_of(ep: int | None = None, dp_attention: int | None = None, tp: int = 1, cp: int = 1) -> Layout:
    """The layout asked for: ``ep`` expert-parallel ranks (None or 1 with ``tp`` or ``cp`` > 1: that many ranks),
    ``tp`` ranks per tensor-parallel group or ``cp`` per context-parallel one, ``dp_attention`` data-parallel groups
    (None: ``ep / (tp · cp)``; else it must be that); ValueError for a layout that cannot be built."""
    if tp < 1 or cp < 1:
        raise ValueError(f"tp={tp}, cp={cp}: a tensor- or context-parallel group has at least one rank")
    if tp > 1 and cp > 1:
        raise ValueError(f"tp={tp} with cp={cp}: a group splits either the heads or the tokens, not both")
    group = tp * cp
    ranks = group if ep in (None, 1) else ep
    if ranks < 1:
        raise ValueError(f"ep={ep}: a worker has at least one rank")
    name = "tp" if tp > 1 else "cp"
    if ranks % group:
        raise ValueError(f"ep={ep} with {name}={group}: the experts' ranks are the worker's, made of whole groups, so "
                         f"{name} must divide ep")  # fmt: skip
    out = Layout(ranks, tp, cp)
    if dp_attention is not None and dp_attention != out.dp:
        raise ValueError(f"dp_attention={dp_attention} with ep={ranks} and {name}={group}: the ranks attend in groups "
                         f"of {group}, {out.dp} groups each over its own sequences")  # fmt: skip
    return out


def add_arguments(p: argparse.ArgumentParser, ranks_help: str) -> None:
    """The layout's flags (``--ep``, ``--dp-attention``, ``--tp``, ``--cp``) of a command (``from_args`` reads them)."""
    p.add_argument("--ep", type=int, help=ranks_help)
    p.add_argument("--dp-attention", type=int, help="groups attending over their own sequences (--ep / --tp or --cp)")
    p.add_argument("--tp", type=int, help="ranks of each tensor-parallel group: the same sequences, the attention's "
                   "heads split among them; divides --ep (default: DEEPINFER_TP)")  # fmt: skip
    p.add_argument("--cp", type=int, help="ranks of each context-parallel group: the same sequences, each step's "
                   "tokens split among them; divides --ep (default: DEEPINFER_CP)")  # fmt: skip


def from_args(args: argparse.Namespace) -> Layout:
    """The layout of a command's flags (``add_arguments``), the settings (``DEEPINFER_EP``, ``_TP``, ``_CP``) where
    a flag is not given."""
    from deepinfer import envs

    ep, tp, cp = (getattr(envs, f"DEEPINFER_{k.upper()}") if getattr(args, k) is None else getattr(args, k)
                  for k in ("ep", "tp", "cp"))  # fmt: skip
    return layout_of(ep, args.dp_attention, tp, cp)


__all__ = ["Layout", "add_arguments", "from_args", "layout_of"]
