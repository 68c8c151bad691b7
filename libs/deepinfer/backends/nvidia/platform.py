"""The nvidia platform: CUDA devices, streams, events and graphs for the runtime (:mod:`deepinfer.runtime.platform`).
Imports torch only (no Triton): the host-copy and graph code asks for it on every step."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from deepinfer.runtime.platform import Event, Platform


class CudaPlatform(Platform):
    name = "nvidia"
    device_type = "cuda"
    graphs = True
    pinned_copies = True
    triton = True
    queues_steps = True
    collectives = "nccl"

    def use_device(self, rank: int) -> None:
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def pin_in_place(self, t: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))

    def indexed(self, device: torch.device) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device

    def available(self) -> bool:
        return torch.cuda.is_available()

    def profiler_activities(self) -> list[Any]:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else super().device_name()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Event:
        return torch.cuda.Event()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def rng_snapshot(self, device: torch.device) -> list[tuple[torch.Generator, torch.Generator]]:
        """Clones of the default generators a capture registers (the current device's and ``device``'s). A capture
        whose ``capture_end`` raises never runs the generators' epilogue: they stay marked as capturing, and every
        later random op on the device (sampling of unseeded requests) fails with "Offset increment outside graph
        capture encountered unexpectedly"."""
        indices = {torch.cuda.current_device(), self.indexed(device).index}
        return [(g, g.clone_state()) for g in (torch.cuda.default_generators[i] for i in sorted(indices))]

    def rng_restore(self, snapshot: list[tuple[torch.Generator, torch.Generator]]) -> None:
        for generator, saved in snapshot:
            generator.graphsafe_set_state(saved)


PLATFORM = CudaPlatform()

__all__ = ["PLATFORM", "CudaPlatform"]
