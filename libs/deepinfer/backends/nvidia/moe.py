"""``NvidiaOps``' experts and quantised weights: the MoE as sorted slots + grouped GEMMs (``deepinfer.kernels.moe``: no
host sync, no per-expert Python loop), the checkpoint's FP8 linears and MXFP4 experts as stored
(``deepinfer.kernels.fp8_gemm``, ``deepinfer.kernels.moe_mxfp4``) and the weights' preparation for them at load. A
mixin, kept apart from ``ops.py``; importing it imports no Triton."""

from __future__ import annotations

import torch

from deepinfer.backends.nvidia.bf16_parts import narrow_lossless

MOE_BACKENDS = ("auto", "grouped_mm", "triton")


class NvidiaMoEOps:
    """``moe``, ``moe_mxfp4``, ``fp8_linear``, ``fp8_grouped_linear`` and ``prepare_weights`` of :class:`NvidiaOps
    <deepinfer.backends.nvidia.ops.NvidiaOps>` (a mixin: it reads the op set's ``moe_backend`` and ``_moe``, and falls
    back to the reference, the next class in the op set's MRO). Batch-invariant (``batch_invariant``): the Triton
    MoE at every size."""

    def moe(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
        act_quant: bool = False,
    ) -> torch.Tensor:
        hidden = None
        if act_quant:  # the official FP8 activations (not a fast path: bf16 experts are a comparison mode)
            x = self.act_quant_sim(x, 128) if x.shape[-1] % 128 == 0 else x
            hidden = (lambda h: self.act_quant_sim(h, 128)) if w2.shape[-1] % 128 == 0 else None
        backend = self.moe_backend
        if backend == "auto":
            backend = "triton"
            if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and not self.batch_invariant:
                slots, experts = idx.numel(), w1.shape[0]
                # H200, V4-Flash width (bench/results/engine/2026-11-29-sweep-2.md): CUTLASS wins with one token (fewer
                # launches) and from ~24 slots per expert on; the Triton kernels in between
                if x.shape[0] <= 4 or slots > 24 * experts:
                    backend = "grouped_mm"
        fn = self._moe.moe_grouped_mm if backend == "grouped_mm" else self._moe.moe_triton
        return fn(x, idx, weights, w1, w2, w3, limit, hidden=hidden)

    def moe_mxfp4(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        s1: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        w3: torch.Tensor,
        s3: torch.Tensor,
        limit: float,
        order: str = "plain",
        act_quant: bool = False,
        refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from deepinfer.kernels.moe_mxfp4 import moe_mxfp4

        return moe_mxfp4(x, idx, weights, w1, s1, w2, s2, w3, s3, limit, order=order, act_quant=act_quant, refs=refs)

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        from deepinfer.kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, w, scale, act_quant=act_quant)

    def fp8_grouped_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return super().fp8_grouped_linear(x, w, scale)
        from deepinfer.kernels.fp8_gemm import fp8_grouped_linear

        return fp8_grouped_linear(x, w, scale)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """On a GPU: the MXFP4 experts with FP8 activations (``quant.w4a8``) get their row references where the W4A8
        kernels run (sm_90 with Gluon, ``DEEPINFER_MOE_PREFILL`` not ``triton``), the other MXFP4 experts go into the
        rotate order (``quant.nibble_order``: a cheaper decode in
        ``kernels.moe_mxfp4``), the projections of one input become one GEMM where the model joins them (a module's
        ``join_projections``: ``layers.join_rows``), and an output head widened to fp32 from bf16 (V4.1's loader) is
        kept in bf16 when that is lossless (``bf16_parts``: ``logits_linear`` reads half the bytes, on tensor
        cores)."""
        from deepinfer import envs
        from deepinfer.kernels.moe_w4a8_wgmma import runs_on
        from deepinfer.quant.native import order_experts
        from deepinfer.quant.w4a8 import prepare_w4a8

        devices = {p.device for p in model.parameters() if p.is_cuda}
        if devices:
            if all(runs_on(d) for d in devices) and envs.get("DEEPINFER_MOE_PREFILL") != "triton":
                prepare_w4a8(model)  # FP8-activation experts whose weights cast exactly keep their codes as stored
            order_experts(model, "rotate")
            for module in model.modules():
                join = getattr(module, "join_projections", None)
                if callable(join) and all(p.is_cuda for p in module.parameters()):
                    join()
            head = getattr(model, "head", None)
            if isinstance(getattr(head, "weight", None), torch.nn.Parameter) and head.weight.is_cuda:
                narrow_lossless(head.weight)
