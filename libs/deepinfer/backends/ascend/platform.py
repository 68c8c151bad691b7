"""The ascend platform: NPU devices through torch_npu (which registers ``torch.npu``) for the runtime
(:mod:`deepinfer.runtime.platform`). No graphs and no pinned-memory copies yet: neither has run on Ascend hardware,
so the runtime keeps the host platform's plain paths there (eager steps, ``.to`` copies)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from deepinfer.runtime.platform import Event, Platform


def _npu() -> Any:
    npu = getattr(torch, "npu", None)  # registered by torch_npu (deepinfer.backends.ascend.load_torch_npu)
    if npu is None:
        raise RuntimeError("the ascend platform needs torch_npu imported (deepinfer.backends.ascend.load_torch_npu)")
    return npu


class NpuPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    collectives = "hccl"
    queues_steps = True

    def use_device(self, rank: int) -> None:
        _npu().set_device(rank % _npu().device_count())

    def device_count(self) -> int:
        return _npu().device_count()

    def indexed(self, device: torch.device) -> torch.device:
        return torch.device("npu", _npu().current_device()) if device.index is None else device

    def available(self) -> bool:
        npu = getattr(torch, "npu", None)
        return npu is not None and npu.is_available()

    def device_name(self) -> str:
        return _npu().get_device_name() if self.available() else super().device_name()

    def current_stream(self, device: torch.device) -> Any:
        return _npu().current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return _npu().Stream(device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return _npu().stream(stream)

    def event(self) -> Event:
        return _npu().Event()

    def synchronize(self, device: torch.device) -> None:
        _npu().synchronize(device)


PLATFORM = NpuPlatform()

__all__ = ["PLATFORM", "NpuPlatform"]
