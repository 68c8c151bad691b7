"""The op interface the model calls, and backend selection.

The model never imports a kernel: it calls ``ops.<name>``. The ``cpu`` backend (plain torch, any
device) defines the semantics; accelerator backends override single ops with kernels that are
tested against it.
"""

from __future__ import annotations

from deepinfer.ops.base import Ops
from deepinfer.ops.invariant import BatchInvariantOps
from deepinfer.ops.reference import ReferenceOps


def get_ops(accelerator: str = "cpu", batch_invariant: bool = False) -> Ops:
    """The op set for ``accelerator`` (nvidia | ascend | cpu); ``batch_invariant`` selects the ops whose
    results for a row never depend on the rest of the batch (``deepinfer.ops.invariant``)."""
    if accelerator == "cpu":
        return BatchInvariantOps() if batch_invariant else ReferenceOps()
    if accelerator == "nvidia":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "DEEPINFER_ACCELERATOR=nvidia but no CUDA device is visible; set DEEPINFER_ACCELERATOR=cpu "
                "to run the reference backend"
            )
        from deepinfer.ops.nvidia import NvidiaInvariantOps, NvidiaOps
        from deepinfer.ops.nvidia_settings import hand_over

        ops = NvidiaInvariantOps() if batch_invariant else NvidiaOps()
        hand_over()  # the kernels read no settings: the backend hands them over (DEEPINFER_PDL, the prefill kernels)
        return ops
    if accelerator == "ascend":  # refuses where torch_npu or an NPU is missing
        from deepinfer.backends.ascend import ascend_ops

        return ascend_ops(batch_invariant)
    raise ValueError(f"unknown accelerator {accelerator!r}; expected one of nvidia, ascend, cpu")


__all__ = ["BatchInvariantOps", "Ops", "ReferenceOps", "get_ops"]
