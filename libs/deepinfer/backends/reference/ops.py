"""Reference ops in plain torch: the semantics every accelerator kernel is tested against.

Numerics follow the official DeepSeek-V4 inference code (docs/deepseek_v4.md, "Numerics"): fp32 for norms, RoPE,
mHC, attention scores/softmax, routing and MoE accumulation; results cast back to the input dtype. The ops are grouped
in mixins, one module each (``norms``, ``attention``, ``moe``, ``quant``, ``step_glue``); :class:`ReferenceOps` composes
them with the products every group builds on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.backends.reference.attention import ReferenceAttentionOps
from deepinfer.backends.reference.moe import ReferenceMoEOps
from deepinfer.backends.reference.norms import ReferenceNormOps
from deepinfer.backends.reference.quant import ReferenceQuantOps
from deepinfer.backends.reference.step_glue import ReferenceStepGlueOps


class ReferenceOps(ReferenceNormOps, ReferenceAttentionOps, ReferenceMoEOps, ReferenceQuantOps, ReferenceStepGlueOps):
    """The reference op set (module docstring): the products and ``parallel`` here, the other ops from the mixins."""

    batch_invariant = False
    invariant_by_sequence = False
    invariance = "default"
    native_weights = False  # weights are dequantised at load time; fp8_linear / moe_mxfp4 decode per call

    def __init__(self, device_name: str = "cpu") -> None:
        self.name = device_name

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def parallel(
        self, first: Callable[[], object], second: Callable[[], object], device: torch.device
    ) -> tuple[object, object]:
        return first(), second()

    def logits_linear(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear(y.float(), w.float())

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ngk,grk->ngr", x, w)

    def linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float(), w.float())

    def prepare_weights(self, model: torch.nn.Module) -> None:
        return None
