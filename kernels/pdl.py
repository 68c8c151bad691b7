"""Programmatic dependent launch (PDL) for every Triton kernel of the NVIDIA backend.

A decode step is a chain of a few hundred short kernels in one CUDA graph; a short kernel costs about 1.3 µs there
beyond its work (``bench/kernels/pdl_chain.py``). On Hopper and later a kernel launched with PDL may start
while the kernel before it drains. Each kernel here takes ``PDL: tl.constexpr`` and begins with ``pdl_wait(PDL)``:

* ``gdc_launch_dependents``: the next kernel may launch once every program of this one has started;
* ``gdc_wait``: nothing of this kernel reads or writes memory before the kernels it depends on have finished and
  their writes are visible. Since every kernel waits before its first access, the stream's order holds as before:
  only launch latency overlaps, never memory work.

``launch()`` gives the launch arguments: ``PDL=True`` with ``launch_pdl=True`` when every visible GPU has compute
capability 9.0 or more, unless ``ENABLED`` is off (``DEEPINFER_PDL=0``: the nvidia op sets hand the setting over with
``configure``, the kernels read no settings); nothing in Triton's interpreter or before Hopper (the kernels then
compile without the two instructions). Measured on an H200
(``bench/results/engine/2026-11-30-pdl-moe-tiles.md``): 1.32
→ 0.98 µs a kernel in a chain of short kernels, 1-2% of a graphed V4 decode step (the step's other launches are
cuBLAS's and torch's, and the eager head).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict[str, bool] = {}
_choice: list[dict[str, bool]] = []
ENABLED = True  # DEEPINFER_PDL (its default), as the nvidia op sets hand it over (``configure``)


def supported() -> bool:
    """Whether the kernels launch with PDL: ``ENABLED``, Triton has grid dependency control, the kernels are not
    interpreted and every visible CUDA device has compute capability 9.0 or more."""
    if not ENABLED:
        return False
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return all(torch.cuda.get_device_capability(i)[0] >= 9 for i in range(torch.cuda.device_count()))


def launch() -> dict[str, bool]:
    """The launch arguments of every kernel of this package: ``{"PDL": True, "launch_pdl": True}`` or ``{}``
    (``supported``, decided once per process; ``reset`` forgets it)."""
    if not _choice:
        _choice.append(_ON if supported() else _OFF)
    return _choice[0]


def reset() -> None:
    """Forget the decision (tests that change ``ENABLED`` or ``TRITON_INTERPRET``)."""
    _choice.clear()


def configure(enabled: bool) -> None:
    """``ENABLED = enabled`` (``DEEPINFER_PDL``: the nvidia op sets call this when they are made), the decision
    forgotten where that changes it."""
    global ENABLED
    if bool(enabled) != ENABLED:
        ENABLED = bool(enabled)
        reset()


@triton.jit
def pdl_wait(PDL: tl.constexpr) -> None:
    """First statement of every kernel: release the next kernel's launch, then wait for the ones before."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


__all__ = ["ENABLED", "configure", "launch", "pdl_wait", "reset", "supported"]
