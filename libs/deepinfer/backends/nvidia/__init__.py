"""The nvidia backend (``DEEPINFER_ACCELERATOR=nvidia``): the model on CUDA, with the Triton kernels of
``deepinfer.kernels`` and CUDA graphs.

* :class:`NvidiaOps` (``ops``, the default): the reference op set (it subclasses
  :class:`deepinfer.backends.reference.ReferenceOps`) with kernels for the ops they replace, and its mixins: the MoE
  and the stored FP8 / MXFP4 weights (``moe``), the decode step's glue (``step_glue``), ``parallel`` on a side stream
  (``streams``); top-k by packed keys (``topk``) and the fp32 × bf16 head by exact bf16 parts (``bf16_parts``);
* :class:`NvidiaInvariantOps` (``invariant``, ``DEEPINFER_BATCH_INVARIANT=1``): the reference's batch-invariant set on
  Triton primitives;
* ``settings.hand_over``: the settings the kernels follow, handed over once the op set is made (:func:`nvidia_ops`).

Importing this package imports no Triton: the op sets import their kernels when made or called.
"""

from __future__ import annotations

from deepinfer.backends.nvidia.invariant import NvidiaInvariantOps
from deepinfer.backends.nvidia.ops import NvidiaOps
from deepinfer.backends.nvidia.settings import hand_over


def nvidia_ops(batch_invariant: bool = False) -> NvidiaOps | NvidiaInvariantOps:
    """The nvidia op set (``batch_invariant``: :class:`NvidiaInvariantOps`), with the kernels' settings handed over;
    RuntimeError where no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "DEEPINFER_ACCELERATOR=nvidia but no CUDA device is visible; set DEEPINFER_ACCELERATOR=cpu "
            "to run the reference backend"
        )
    ops = NvidiaInvariantOps() if batch_invariant else NvidiaOps()
    hand_over()  # the kernels read no settings: the backend hands them over (DEEPINFER_PDL, the prefill kernels)
    return ops


__all__ = ["NvidiaInvariantOps", "NvidiaOps", "hand_over", "nvidia_ops"]
