"""Where the model runs: one platform per accelerator (its torch device type), and one folder per backend, each owning
its op set (an implementation of :class:`deepinfer.ops.Ops`).

The engine asks :func:`platform_for` for the device to place the model and its state on, and
:func:`deepinfer.ops.get_ops` (the interface's one dispatch, importing a backend's folder only when asked for it) for
the backend's ops; nothing else needs to know which accelerator it is. The model code never imports this package.

* ``cpu``: the reference op set (plain torch: the semantics every other backend is tested against) and its
  batch-invariant variant (:mod:`deepinfer.backends.reference`);
* ``nvidia``: ``torch.device("cuda")``, Triton kernels and CUDA graphs (:mod:`deepinfer.backends.nvidia`);
* ``ascend``: ``torch.device("npu")`` through torch_npu, the reference op set with torch_npu's fused ops where
  their semantics are the reference's (:mod:`deepinfer.backends.ascend`).

The backend folders do not import each other, except that ``nvidia`` and ``ascend`` build on the reference op set
(their op sets subclass ``ReferenceOps``; tests/foundation/test_boundaries.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACCELERATORS = ("nvidia", "ascend", "cpu")


@dataclass(frozen=True)
class Platform:
    """An accelerator as the engine sees it: its name and the torch device type its tensors live on."""

    name: str  # nvidia | ascend | cpu
    device_type: str  # cuda | npu | cpu

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)


_PLATFORMS = {"nvidia": Platform("nvidia", "cuda"), "ascend": Platform("ascend", "npu"), "cpu": Platform("cpu", "cpu")}


def platform_for(accelerator: str) -> Platform:
    """The platform of ``accelerator`` (nvidia | ascend | cpu)."""
    try:
        return _PLATFORMS[accelerator]
    except KeyError:
        raise ValueError(f"unknown accelerator {accelerator!r}; expected one of {', '.join(ACCELERATORS)}") from None


__all__ = ["ACCELERATORS", "Platform", "platform_for"]
