"""How a worker's ranks are laid out (docs/parallelism.md), with no torch here: ``deepinfer up`` checks a layout
before it starts anything.

* ``ranks``: the worker's processes, one device each; the routed experts are sharded over all of them (expert
  parallel, ``ep``);
* ``tp``: ranks of a tensor-parallel group, which run the same sequences with the attention's heads split among them
  (``tensor_parallel``);
* ``dp``: ``ranks / tp`` attention data-parallel groups, each attending over its own sequences with its own KV
  pages: the ranks the scheduler plans a step for (``WorkerInfo.world_size``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    ranks: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Attention data-parallel groups (each its own sequences)."""
        return self.ranks // self.tp

    def group_of(self, rank: int) -> int:
        """The data-parallel group of ``rank`` (its tensor-parallel group's index)."""
        return rank // self.tp


def layout_of(ep: int | None = None, dp_attention: int | None = None, tp: int = 1) -> Layout:
    """The layout asked for: ``ep`` expert-parallel ranks (None or 1 with ``tp`` > 1: ``tp`` ranks), ``tp`` ranks
    per tensor-parallel group, ``dp_attention`` data-parallel groups (None: ``ep / tp``; else it must be that);
    ValueError for a layout that cannot be built."""
    if tp < 1:
        raise ValueError(f"tp={tp}: a tensor-parallel group has at least one rank")
    ranks = tp if ep in (None, 1) else ep
    if ranks < 1:
        raise ValueError(f"ep={ep}: a worker has at least one rank")
    if ranks % tp:
        raise ValueError(f"ep={ep} with tp={tp}: the experts' ranks are the worker's, made of whole tensor-parallel "
                         "groups, so tp must divide ep")  # fmt: skip
    out = Layout(ranks, tp)
    if dp_attention is not None and dp_attention != out.dp:
        raise ValueError(f"dp_attention={dp_attention} with ep={ranks} and tp={tp}: the ranks attend in groups of tp, "
                         f"{out.dp} groups each over its own sequences")  # fmt: skip
    return out


__all__ = ["Layout", "layout_of"]
