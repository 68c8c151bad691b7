"""The all-to-all exchange behind expert parallelism's dispatch and combine.

``AllToAll`` is the seam: the expert-parallel MoE (``expert_parallel``) only asks it to swap row counts and to move
rows, so an implementation over RDMA / NVSHMEM (DeepEP's kind: fixed buffers, no host round trip for the counts)
can replace the one here. ``TorchAllToAll`` runs on a ``torch.distributed`` process group: NCCL on GPUs, gloo on
CPUs (its counts cross the host once per exchange, which a CUDA graph cannot capture).
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


__all__ = ["AllToAll", "TorchAllToAll"]
