"""How a worker's ranks are laid out: expert parallel (``ep``), attention data parallel (``dp_attention``), tensor
parallel (``tp``), and which layouts are built (docs/parallelism.md). No torch here: ``deepinfer up`` checks a
layout before it starts anything."""

from __future__ import annotations


def ranks_of(ep: int, dp_attention: int | None = None, tp: int = 1) -> int:
    """The ranks of a worker laid out as asked (``ep`` expert-parallel ranks, ``dp_attention`` attention
    data-parallel ranks, ``tp`` tensor-parallel ones); ValueError for a layout that is not built."""
    if tp != 1:
        raise ValueError(f"tp={tp}: tensor parallelism is not built yet; use ep (expert parallel) ranks")
    if ep < 1:
        raise ValueError(f"ep={ep}: a worker has at least one rank")
    if dp_attention is not None and dp_attention != ep:
        raise ValueError(f"dp_attention={dp_attention} with ep={ep}: each rank attends over its own sequences and "
                         "holds its share of the experts, so both are the number of ranks")  # fmt: skip
    return ep


__all__ = ["ranks_of"]
