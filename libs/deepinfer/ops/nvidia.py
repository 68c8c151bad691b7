"""The op sets of the nvidia backend.

* ``NvidiaOps`` (the default): the reference semantics with the MoE as sorted slots + grouped GEMMs
  (``deepinfer.kernels.moe``: no host sync, no per-expert Python loop) and, with ``fused`` (the default), mHC,
  RMSNorm and RoPE as one Triton launch each (``deepinfer.kernels.hc``, ``deepinfer.kernels.norm``). Its
  ``cuda_graphs`` flag (``DEEPINFER_CUDA_GRAPHS``) lets the model replay decode steps from CUDA graphs
  (``deepinfer.models.deepseek_v4.graphs``). Its ``native_weights`` flag (``DEEPINFER_NATIVE_WEIGHTS``) keeps the
  checkpoint's FP8 linears and MXFP4 experts as stored (``deepinfer.quant.native``) and runs them through
  ``deepinfer.kernels.fp8_gemm`` and ``deepinfer.kernels.moe_mxfp4``.
* ``NvidiaInvariantOps`` (``DEEPINFER_BATCH_INVARIANT=1``): ``ops.invariant`` with Triton kernels. Sparse attention
  runs over each query's visible keys gathered into a canonical order (window rows by position, then compressed
  rows by index) and the lightning indexer over fixed key tiles; both kernels are batch-invariant by construction.
"""

from __future__ import annotations

import torch

from deepinfer.ops.invariant import BatchInvariantOps
from deepinfer.ops.reference import ReferenceOps

MOE_BACKENDS = ("auto", "grouped_mm", "triton")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _kernels() -> tuple:
    try:
        from deepinfer.kernels.attention import indexer_scores_fixed, sparse_attention_gather
    except ImportError as e:  # pragma: no cover - a CUDA host without triton
        raise RuntimeError(f"the nvidia backend needs Triton (pip install 'deepinfer[nvidia]'): {e}") from e
    return sparse_attention_gather, indexer_scores_fixed


def visible_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the indices of its visible keys first, in list order (``[n, K]``), and their count."""
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    return order, mask.sum(1)


class _KernelAttention:
    def _load_kernels(self) -> None:
        self._attend, self._index = _kernels()

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        idx, count = visible_keys(mask)
        return self._attend(q, keys.to(q.dtype), idx, count, sink.float(), scale)

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._index(q, keys.to(q.dtype), weights.float())


class NvidiaInvariantOps(_KernelAttention, BatchInvariantOps):
    def __init__(self) -> None:
        BatchInvariantOps.__init__(self, "nvidia")
        self._load_kernels()


class NvidiaOps(ReferenceOps):
    """The default nvidia op set (module docstring). ``moe_backend``: ``grouped_mm`` (``torch._grouped_mm``, bf16 on
    CUDA; torch's fallback elsewhere), ``triton`` (``kernels.moe.moe_triton``) or ``auto`` (by measured speed: bf16 on
    CUDA takes grouped_mm for one token and for many slots per expert, triton otherwise). ``fused``: mHC, RMSNorm and
    RoPE as single Triton kernels (off: the reference's torch ops). ``cuda_graphs``: decode steps may replay CUDA
    graphs (read by the model; default ``DEEPINFER_CUDA_GRAPHS``). ``native_weights``: the engine keeps FP8 / MXFP4
    weights as stored and calls ``fp8_linear`` / ``moe_mxfp4`` (default ``DEEPINFER_NATIVE_WEIGHTS``)."""

    def __init__(
        self,
        moe_backend: str = "auto",
        fused: bool = True,
        cuda_graphs: bool | None = None,
        native_weights: bool | None = None,
    ) -> None:
        super().__init__("nvidia")
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {moe_backend!r}")
        try:
            from deepinfer.kernels import hc, moe, norm
        except ImportError as e:  # pragma: no cover - a CUDA host without triton
            raise RuntimeError(f"the nvidia backend needs Triton (pip install 'deepinfer[nvidia]'): {e}") from e
        self._moe, self.moe_backend = moe, moe_backend
        self._hc, self._norm, self.fused = hc, norm, fused
        if cuda_graphs is None:
            from deepinfer import envs

            cuda_graphs = bool(envs.get("DEEPINFER_CUDA_GRAPHS"))
        if native_weights is None:
            from deepinfer import envs

            native_weights = bool(envs.get("DEEPINFER_NATIVE_WEIGHTS"))
        self.cuda_graphs, self.native_weights = cuda_graphs, native_weights
        from deepinfer.kernels.attention import indexer_scores_ranges, sparse_attention_gather

        self._attend_lists, self._index_ranges = sparse_attention_gather, indexer_scores_ranges

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if not self.fused or x.dtype not in _FLOATS:
            return super().rms_norm(x, weight, eps)
        return self._norm.rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if not self.fused or not self._norm.rope_supported(x, cos, sin):
            return super().rope(x, cos, sin, inverse)
        return self._norm.rope(x, cos, sin, inverse)

    def hc_mixes(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused or h.dim() != 3 or h.dtype not in _FLOATS:
            return super().hc_mixes(h, fn, scale, base, iters, eps, norm_eps)
        return self._hc.hc_mixes(h, fn, scale, base, iters, eps, norm_eps)

    def hc_pre(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fused or h.dim() != 3 or h.dtype not in _FLOATS:
            return super().hc_pre(h, fn, scale, base, iters, eps, norm_eps)
        return self._hc.hc_pre(h, fn, scale, base, iters, eps, norm_eps)

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        if not self.fused or res.dim() != 3 or y.dtype not in _FLOATS:
            return super().hc_expand(y, res, post, comb)
        return self._hc.hc_expand(y, res, post, comb)

    def logits_linear(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """bf16 / fp16 on CUDA: one half-precision GEMM with fp32 accumulation and fp32 output (no fp32 copy of the
        ~1 GB head weight each step); the reference's cast-then-fp32-GEMM elsewhere."""
        if y.is_cuda and y.dtype == w.dtype and y.dtype in (torch.bfloat16, torch.float16):
            try:
                return torch.mm(y.reshape(-1, y.shape[-1]), w.t(), out_dtype=torch.float32).view(*y.shape[:-1], -1)
            except (TypeError, RuntimeError):  # a torch without out_dtype for mm
                pass
        return super().logits_linear(y, w)

    def sparse_attention_lists(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self._attend_lists(q, keys.to(q.dtype), idx, count, sink.float(), scale)

    def indexer_scores_ranges(
        self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, width: int
    ) -> torch.Tensor:
        return self._index_ranges(q, keys.to(q.dtype), weights.float(), start, width)

    def cache_round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """FP8 and MXFP4 on CUDA: one Triton kernel (``kernels.cache_round``, the torch round trips bit for bit on an
        H200); NVFP4 and elsewhere: the torch versions (the kernel's NVFP4 differs from them on the GPU, not yet
        understood)."""
        if x.is_cuda and x.dtype in _FLOATS and fmt in ("fp8", "mxfp4"):
            from deepinfer.kernels.cache_round import cache_round

            return cache_round(x, fmt)
        return super().cache_round(x, fmt)

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        from deepinfer.kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, w, scale, act_quant=act_quant)

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
    ) -> torch.Tensor:
        from deepinfer.kernels.moe_mxfp4 import moe_mxfp4

        return moe_mxfp4(x, idx, weights, w1, s1, w2, s2, w3, s3, limit, order=order)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """The MXFP4 experts on a GPU go into the shift order (``quant.nibble_order``: a cheaper decode in
        ``kernels.moe_mxfp4``)."""
        from deepinfer.quant.native import shift_experts

        if any(p.is_cuda for p in model.parameters()):
            shift_experts(model)

    def moe(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
    ) -> torch.Tensor:
        backend = self.moe_backend
        if backend == "auto":
            backend = "triton"
            if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
                slots, experts = idx.numel(), w1.shape[0]
                # H200, V4-Flash width (bench/results/2026-11-29-sweep-2.md): CUTLASS wins with one token (fewer
                # launches) and from ~24 slots per expert on; the Triton kernels in between
                if x.shape[0] <= 4 or slots > 24 * experts:
                    backend = "grouped_mm"
        fn = self._moe.moe_grouped_mm if backend == "grouped_mm" else self._moe.moe_triton
        return fn(x, idx, weights, w1, w2, w3, limit)
