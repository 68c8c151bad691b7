"""The platform object: what the runtime needs of a device besides its ops — the torch device, host copies, streams,
events, graphs — so that nothing outside a backend's folder names a vendor's device API.

:class:`Platform` is the host's (``cpu``): no streams, events or graphs, copies that are plain ``.to``. Each
accelerator's backend subclasses it (``deepinfer.backends.nvidia.platform``, ``deepinfer.backends.ascend.platform``);
:func:`platform_for` (by accelerator name) and :func:`platform_of` (by a tensor's device) find them, importing a
backend's platform module (torch only: no kernels, no vendor library) only when asked for it.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Protocol

import torch


class Event(Protocol):
    """A point in a stream's work: ``record`` it, ask whether it has passed (``query``), or wait for it."""

    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Platform:
    """An accelerator as the runtime sees it. This base class is the host (``cpu``); a backend overrides what its
    device has (streams, events, graphs, pinned-memory copies)."""

    name = "cpu"  # the accelerator's name: nvidia | ascend | cpu
    device_type = "cpu"  # the torch device type its tensors live on
    graphs = False  # whether a step can be captured once and replayed (decode / piecewise graphs)
    pinned_copies = False  # whether host tensors bound for the device go through pinned memory, asynchronously
    triton = False  # whether the Triton kernels (``deepinfer.kernels``) run on the device
    queues_steps = False  # whether a step's launch queues its work on the device and returns (the host runs it)
    collectives = "gloo"  # the torch.distributed backend of a rank group on this platform (``parallel.launch``)

    def use_device(self, rank: int) -> None:
        """Make the device of rank ``rank`` of a group on one host the current one (nothing on the host)."""

    def pin_in_place(self, t: torch.Tensor) -> None:
        """Page-lock host tensor ``t``'s memory where it is (memory other processes map too), for copies to the
        device that do not stage through a pinned buffer; nothing on a platform without pinned copies."""

    def device_count(self) -> int:
        """The devices this process sees (the host: one)."""
        return 1

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)

    def indexed(self, device: torch.device) -> torch.device:
        """``device`` with its index, as a tensor made there reports it (an accelerator's default device: the
        current one)."""
        return device

    def available(self) -> bool:
        """Whether a device of this platform is visible."""
        return True

    def device_name(self) -> str:
        """The device's model name (in run manifests); the host's processor here."""
        import platform

        return platform.processor() or platform.machine()

    # -- streams and events ---------------------------------------------------------------------------------------
    def capturing(self) -> bool:
        """Whether the current stream is capturing a graph (work queued now is recorded, not run)."""
        return False

    def current_stream(self, device: torch.device) -> Any:
        raise NotImplementedError(f"the {self.name} platform has no streams")

    def new_stream(self, device: torch.device) -> Any:
        raise NotImplementedError(f"the {self.name} platform has no streams")

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context in which work is queued on ``stream``."""
        raise NotImplementedError(f"the {self.name} platform has no streams")

    def event(self) -> Event:
        raise NotImplementedError(f"the {self.name} platform has no events")

    def synchronize(self, device: torch.device) -> None:
        """Wait until the device has run everything queued on it (the host: nothing is queued)."""

    def profiler_activities(self) -> list[Any]:
        """What ``torch.profiler`` records of a step here: the host's operators, and the device's kernels where
        the profiler sees them."""
        return [torch.profiler.ProfilerActivity.CPU]

    # -- graphs ---------------------------------------------------------------------------------------------------
    def graph(self) -> Any:
        """A graph to capture work into (``capture_begin(pool=, capture_error_mode=)``, ``capture_end``,
        ``replay``)."""
        raise NotImplementedError(f"the {self.name} platform has no graphs")

    def graph_pool(self) -> Any:
        """A memory pool several graphs can share."""
        raise NotImplementedError(f"the {self.name} platform has no graphs")

    def rng_snapshot(self, device: torch.device) -> Any:
        """What :meth:`rng_restore` needs to undo a failed capture's mark on the device's default random generator
        (the host's: nothing)."""
        return None

    def rng_restore(self, snapshot: Any) -> None:
        """Put back the default random generator taken by :meth:`rng_snapshot` before a capture that failed."""


HOST = Platform()
ACCELERATORS = ("nvidia", "ascend", "cpu")
_MODULES = {"nvidia": "deepinfer.backends.nvidia.platform", "ascend": "deepinfer.backends.ascend.platform"}
_BY_DEVICE: dict[str, Platform] = {HOST.device_type: HOST}


def platform_for(accelerator: str) -> Platform:
    """The platform of ``accelerator`` (nvidia | ascend | cpu)."""
    if accelerator == HOST.name:
        return HOST
    if accelerator not in _MODULES:
        raise ValueError(f"unknown accelerator {accelerator!r}; expected one of {', '.join(ACCELERATORS)}")
    platform = importlib.import_module(_MODULES[accelerator]).PLATFORM
    _BY_DEVICE.setdefault(platform.device_type, platform)
    return platform


def platform_of(device: torch.device | str) -> Platform:
    """The platform a tensor on ``device`` lives on (a device type no backend owns: the host's plain paths)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    platform = _BY_DEVICE.get(kind)
    if platform is None:
        owners = [p for p in map(platform_for, _MODULES) if p.device_type == kind]
        platform = _BY_DEVICE[kind] = owners[0] if owners else HOST
    return platform


__all__ = ["ACCELERATORS", "HOST", "Event", "Platform", "platform_for", "platform_of"]
