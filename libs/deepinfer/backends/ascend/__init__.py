"""The Ascend backend: the model on one Huawei Ascend NPU through torch_npu.

``torch_npu`` registers the ``npu`` device with torch; it needs Huawei's CANN toolkit on the host (install it only
there, with ``pip install 'deepinfer[ascend]'``: without CANN, an installed torch_npu breaks ``import torch``).
Where torch_npu is absent or cannot find an NPU, :func:`load_torch_npu` refuses with a message that says so, and the
worker service (``python -m services.worker_ascend``) stops with it instead of a traceback.

:class:`AscendOps` is the reference op set (plain torch, which torch_npu runs on the NPU) with torch_npu's fused
kernels substituted where their semantics are the reference's: RMSNorm (``torch_npu.npu_rms_norm``). The others
(rotary embedding in V4's interleaved layout, the sqrt-softplus router, the clamped SwiGLU, the FP8 / MXFP4 weight
formats) differ from torch_npu's fused ops of the same name and stay on the reference path until each is checked
against the reference on hardware. Nothing of this backend has run on Ascend hardware yet (docs/architecture.md,
"Backends").
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deepinfer.backends.ascend.ops import AscendOps

EXTRA_HINT = "install torch_npu with CANN on an Ascend host (pip install 'deepinfer[ascend]')"


def load_torch_npu() -> ModuleType:
    """Import torch_npu (registering the ``npu`` device) and check that an NPU is visible; RuntimeError otherwise."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as e:
        raise RuntimeError(
            f"DEEPINFER_ACCELERATOR=ascend needs torch_npu, which is not installed ({e}): {EXTRA_HINT}; or set "
            "DEEPINFER_ACCELERATOR=cpu or nvidia"
        ) from None
    except Exception as e:  # torch_npu present but CANN missing or broken: its import fails in its own ways
        raise RuntimeError(
            f"DEEPINFER_ACCELERATOR=ascend: torch_npu failed to import ({type(e).__name__}: {e}); is CANN installed "
            "and its set_env.sh sourced?"
        ) from None
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise RuntimeError("DEEPINFER_ACCELERATOR=ascend but no NPU is visible (torch.npu.is_available() is False)")
    return torch_npu


def ascend_ops(batch_invariant: bool = False) -> AscendOps:
    """The Ascend op set; the batch-invariant set is refused (its reductions are not checked on the NPU yet)."""
    if batch_invariant:
        raise RuntimeError(
            "DEEPINFER_BATCH_INVARIANT is not available on the Ascend backend yet (its batch-invariant reductions "
            "have not been checked on an NPU); unset it, or use the nvidia or cpu backend"
        )
    return AscendOps(load_torch_npu())


__all__ = ["AscendOps", "ascend_ops", "load_torch_npu"]
