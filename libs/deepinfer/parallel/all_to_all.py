"""The all-to-all exchange behind expert parallelism's dispatch and combine.

``AllToAll`` is the seam: the expert-parallel MoE (``expert_parallel``) only asks it to swap row counts and to move
rows, so an implementation over RDMA / NVSHMEM (DeepEP's kind: fixed buffers, no host round trip for the counts)
can replace the one here. ``TorchAllToAll`` runs on a ``torch.distributed`` process group: NCCL on GPUs, gloo on
CPUs. ``exchange`` needs the row counts on the host (``counts`` first: a round trip a CUDA graph cannot capture);
``exchange_fixed`` moves blocks of one size, known before the step, and needs none.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class AllToAll(Protocol):
    """A group of ``size`` ranks swapping rows; every rank calls each method in the same order."""

    rank: int
    size: int

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        """``send [size]``: rows this rank sends to each rank; returns the rows it receives from each (int64)."""
        ...

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``rows`` (``send[r]`` of them to rank ``r``, in rank order); returns the rows received (``recv[r]``
        from rank ``r``, in rank order)."""
        ...

    def exchange_fixed(self, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks [size, n, ...]``: block ``r`` goes to rank ``r``; returns ``[size, n, ...]``, block ``r`` from
        rank ``r``. Every rank gives the same ``n`` and trailing shape; nothing is read on the host."""
        ...


class TorchAllToAll:
    """``AllToAll`` over a ``torch.distributed`` group (``dist.all_to_all_single``)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        send = send.to(torch.long).contiguous()
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send, group=self.group)
        return out

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)
        return out

    def exchange_fixed(self, blocks: torch.Tensor) -> torch.Tensor:
        if blocks.shape[0] != self.size:
            raise ValueError(f"{blocks.shape[0]} blocks for a group of {self.size}")
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks.contiguous(), group=self.group)
        return out


__all__ = ["AllToAll", "TorchAllToAll"]
