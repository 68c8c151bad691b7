"""The Ascend op set: the reference ops, with torch_npu's fused kernels where their semantics are the reference's."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backends.reference.ops import ReferenceOps


class AscendOps(ReferenceOps):
    """:class:`ReferenceOps` on the NPU; ``rms_norm`` through ``torch_npu.npu_rms_norm`` (one fused kernel instead
    of five elementwise ones and a reduction). ``torch_npu`` is the imported module (the tests pass a stand-in that
    implements its documented semantics on the CPU)."""

    fused = ("rms_norm",)  # the ops that run a torch_npu kernel; every other op is the reference's

    def __init__(self, torch_npu: ModuleType) -> None:
        super().__init__("ascend")
        self.npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None:  # npu_rms_norm always scales by a gamma
            return super().rms_norm(x, weight, eps)
        return self.npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
