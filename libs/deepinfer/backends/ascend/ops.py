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
    # the ops taken from ReferenceOps as they are: every op of deepinfer.ops.Ops but ``fused``
    FROM_REFERENCE = frozenset({
        "act_quant_sim", "fp4_quant_sim", "fp8_grouped_linear", "fp8_linear", "grouped_linear", "linear",
        "linear_fp32", "logits_linear", "moe", "moe_combine", "moe_mxfp4", "parallel", "pointwise", "prepare_weights",
        "rope", "route", "swiglu", "topk_indices",  # core
        "hc_collapse", "hc_expand", "hc_mixes", "hc_pre",  # mHC
        "cache_round", "compress_score", "group_pool", "indexer_scores", "indexer_scores_ranges", "select_rows",
        "softmax_pool", "sparse_attention", "sparse_attention_lists",  # hybrid attention
        "append_rows", "key_lists", "step_indices", "store_rows",  # decode step
    })  # fmt: skip

    def __init__(self, torch_npu: ModuleType) -> None:
        super().__init__("ascend")
        self.npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None:  # npu_rms_norm always scales by a gamma
            return super().rms_norm(x, weight, eps)
        return self.npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
