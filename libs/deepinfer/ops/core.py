"""The model-agnostic core of the op interface (:class:`CoreOps`): what any transformer with (MoE) feed-forwards
needs from a backend — products (plain, fp32, grouped, the output head, FP8 weights kept as stored), RMSNorm,
rotary embedding, top-k, routing and the experts (bf16 and MXFP4, the shared expert's SwiGLU and the combine), the
quantisation round trips, weight preparation and running two pieces of work at once. DeepSeek-V4 and V4.1 call
them; nothing here is specific to them (``route``'s score function is V4's, a flag away from others), so a model of
another family types against this layer plus its own extension (``base.Ops`` is V4's union).

Shapes use ``n`` = new tokens of one sequence, ``T`` = tokens of the whole batch, ``H`` heads, ``d`` head dim.
Every op takes and returns torch tensors; none keeps state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CoreOps(Protocol):
    """The ops every model family needs (module docstring), with the op set's flags."""

    name: str
    batch_invariant: bool  # results of a row never depend on the other rows of the call (docs/determinism.md)
    # the invariance holds only for attention computed a sequence at a time (the reference's batch-invariant set); the
    # model then leaves its batched paths (pooled decode state, CUDA graphs). False where every batched kernel is
    # invariant per row (the nvidia set's batch-invariant mode) or the set is not batch-invariant
    invariant_by_sequence: bool
    invariance: str  # "default", or the batch-invariant set's name and the constants that fix its reduction orders
    native_weights: bool  # keep FP8 / MXFP4 weights as stored (quant.native) and run fp8_linear / moe_mxfp4

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` for an element-wise torch function (exp, sigmoid, silu, softplus, cos, sin, …).
        Batch-invariant backends make every element take the same code path (torch's CPU kernels
        compute the SIMD body and the tail of a tensor differently, so a value would otherwise depend
        on where its row sits in the batch)."""
        ...

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` (``F.linear`` without bias): ``x [..., K]``, ``w [N, K]`` → ``[..., N]`` in ``x.dtype``."""
        ...

    def linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x · wᵀ`` computed in fp32 whatever the dtypes (the official fp32 GEMMs of the compressors and the
        router): exact products of the values, fp32 sums → fp32."""
        ...

    def logits_linear(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The output head: ``y @ w.T`` computed and returned in fp32 (``y [T, K]`` and ``w [V, K]`` in any float
        dtype; bf16 operands are exact in fp32, so a bf16 GEMM with fp32 accumulation and output is the same sum)."""
        ...

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-group products ``x [n, g, K]``, ``w [g, R, K]`` → ``[n, g, R]``."""
        ...

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        """``linear`` with an FP8 weight kept as stored: ``w [N, K]`` e4m3, ``scale [ceil(N/B0), ceil(K/B1)]`` float32
        powers of two (``W = w · scale`` per block, exact in bf16). ``act_quant``: the input is first rounded as
        ``act_quant_sim(x, 128)`` (the official FP8 activation). → ``[..., N]`` in ``x.dtype``."""
        ...

    def fp8_grouped_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``grouped_linear`` with an FP8 weight kept as stored: ``x [T, G, K]``, ``w [G·R, K]`` e4m3 and its block
        ``scale`` (as ``fp8_linear``), the dequantised weight viewed ``[G, R, K]`` → ``[T, G, R]`` in ``x.dtype``."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``w · x / rms(x)`` over the last dim, computed in fp32, returned in ``x.dtype``."""
        ...

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, inplace: bool = False
    ) -> torch.Tensor:
        """Interleaved (GPT-J pair) rotation of the last ``2·cos.shape[-1]`` dims of ``x``. ``inplace``: the caller
        no longer needs ``x``, so the result may be written into it (a backend then moves only the rotated dims);
        the result is the returned tensor either way."""
        ...

    def topk_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Top-``k`` column indices per row; ties go to the lower index (documented tie rule)."""
        ...

    def route(
        self, logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's router after its fp32 GEMM: ``s = sqrt(softplus(logits))`` ``[T, E]``; the experts ``idx`` given (hash
        layers) or ``topk_indices(s + bias, k)``; weights ``s[idx] / Σ s[idx] · scaling`` → ``(idx [T, k] long,
        weights [T, k] fp32)``."""
        ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
        """``silu(min(gate, limit)) · clamp(up, ±limit)`` in fp32, rounded to ``dtype`` (the shared expert)."""
        ...

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
        """Routed SwiGLU experts (``w1/w3 [E, I, D]``, ``w2 [E, D, I]``): ``Σ_k weights[:, k] · expert(x)``.

        The routing weight multiplies the expert's hidden state before ``w2``; the sum is fp32. ``act_quant``: the
        official FP8 activations, ``x`` and each slot's hidden row (rounded to ``x.dtype``) rounded as
        ``act_quant_sim(·, 128)`` before their GEMMs, where the width is a multiple of 128."""
        ...

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
        """``moe`` with MXFP4 experts kept packed: ``w1/w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` int8 e2m1 pairs and
        uint8 e8m0 exponents ``s1/s3 [E, I, D/32]``, ``s2 [E, D, I/32]`` (``quant.native``); the semantics are
        ``moe`` on the weights decoded to ``x.dtype``. ``order``: the order of the codes, ``plain``, ``shift`` or
        ``rotate`` (``quant.nibble_order``). ``act_quant``: the official FP8 activations: ``x`` and each slot's
        hidden row (rounded to ``x.dtype``) rounded as ``act_quant_sim(·, 128)`` before their GEMMs, where the width
        is a multiple of 128. ``refs``: the weights' row references (``quant.w4a8.row_refs``) where a backend may run
        the products on FP8 tensor cores (W4A8, the same results up to the order and precision of the fp32 sums);
        ignored without ``act_quant`` and by backends without such kernels."""
        ...

    def moe_combine(self, y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The MoE's output: the routed experts' fp32 sum ``y`` plus the shared expert's ``shared.float()``, in
        ``dtype``."""
        ...

    def act_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """FP8 e4m3 round-trip with per-``block`` UE8M0 scales along the last dim."""
        ...

    def fp4_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """MXFP4 (e2m1) round-trip with per-``block`` UE8M0 scales along the last dim."""
        ...

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Rearrange the weights a model keeps in their stored formats for this op set's kernels, once, after they
        are loaded and placed (before any CUDA graph is captured). The reference op set leaves them as they are."""
        ...

    def parallel(
        self, first: Callable[[], object], second: Callable[[], object], device: torch.device
    ) -> tuple[object, object]:
        """``(first(), second())``, the two free to run at once on ``device`` (independent work: neither reads what
        the other writes); the results are those of running them one after the other."""
        ...
