"""The op interface the model calls, and backend selection.

The model never imports a kernel or a backend: it calls ``ops.<name>`` on an :class:`Ops` (``base``: the union of the
interface's layers, one module each: ``core`` (model-agnostic), ``hyper_connections``, ``hybrid_attention`` and
``decode_step`` (the DeepSeek-V4 family's)). Each backend owns its op set in its folder under ``deepinfer.backends``:
``reference`` (the ``cpu`` backend: plain torch, any device) defines the semantics; ``nvidia`` and ``ascend``
implement ops with kernels that are tested against it, and declare the ones they take from it as they are
(``FROM_REFERENCE``). :func:`get_ops` is the one place that maps an accelerator's name to its op set; it imports the
backend only when called, so importing the interface imports no backend (and no Triton).
"""

from __future__ import annotations

from deepinfer.ops.base import LAYERS, CoreOps, DecodeStepOps, HybridAttentionOps, HyperConnectionOps, Ops, op_names


def get_ops(accelerator: str = "cpu", batch_invariant: bool = False) -> Ops:
    """The op set for ``accelerator`` (nvidia | ascend | cpu); ``batch_invariant`` selects the ops whose
    results for a row never depend on the rest of the batch (``deepinfer.backends.reference.invariant``)."""
    if accelerator == "cpu":
        from deepinfer.backends.reference import BatchInvariantOps, ReferenceOps

        return BatchInvariantOps() if batch_invariant else ReferenceOps()
    if accelerator == "nvidia":  # refuses where no CUDA device is visible
        from deepinfer.backends.nvidia import nvidia_ops

        return nvidia_ops(batch_invariant)
    if accelerator == "ascend":  # refuses where torch_npu or an NPU is missing
        from deepinfer.backends.ascend import ascend_ops

        return ascend_ops(batch_invariant)
    raise ValueError(f"unknown accelerator {accelerator!r}; expected one of nvidia, ascend, cpu")


__all__ = [
    "LAYERS",
    "CoreOps",
    "DecodeStepOps",
    "HybridAttentionOps",
    "HyperConnectionOps",
    "Ops",
    "get_ops",
    "op_names",
]
