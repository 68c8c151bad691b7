"""The nvidia backend (``DEEPINFER_ACCELERATOR=nvidia``): the model on CUDA, with the Triton kernels of
``deepinfer.kernels`` and CUDA graphs.

* :class:`NvidiaOps` (``ops``, the default): the reference op set (it subclasses
  :class:`deepinfer.backends.reference.ReferenceOps`) with kernels for the ops they replace, and its mixins: the MoE
  and the stored FP8 / MXFP4 weights (``moe``), the decode step's glue (``step_glue``), ``parallel`` on a side stream
  (``streams``); top-k by packed keys (``topk``) and the fp32 × bf16 head by exact bf16 parts (``bf16_parts``);
* ``NvidiaOps(invariant=True)`` (``DEEPINFER_BATCH_INVARIANT=1``): the same kernels, CUDA graphs and pooled state,
  batch-invariant (``invariant``: every kernel's plan pinned, the library GEMMs on fixed-plan kernels, ``fixed``);
* ``settings.hand_over``: the settings the kernels follow, handed over once the op set is made (:func:`nvidia_ops`).

Importing this package imports no Triton: the op sets import their kernels when made or called.
"""

from __future__ import annotations

from deepinfer.backends.nvidia.ops import NvidiaOps
from deepinfer.backends.nvidia.settings import hand_over


def nvidia_ops(batch_invariant: bool = False) -> NvidiaOps:
    """The nvidia op set (``batch_invariant``: its batch-invariant mode), with the kernels' settings handed over;
    RuntimeError where no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "DEEPINFER_ACCELERATOR=nvidia but no CUDA device is visible; set DEEPINFER_ACCELERATOR=cpu "
            "to run the reference backend"
        )
    ops = NvidiaOps(invariant=batch_invariant)
    hand_over()  # the kernels read no settings: the backend hands them over (DEEPINFER_PDL, the prefill kernels)
    return ops


__all__ = ["NvidiaOps", "hand_over", "nvidia_ops"]
