"""``NvidiaOps``, the nvidia backend's default op set: the reference semantics with the MoE as sorted slots + grouped
GEMMs (``deepinfer.kernels.moe``: no host sync, no per-expert Python loop) and, with ``fused`` (the default), mHC,
RMSNorm and RoPE as one Triton launch each (``deepinfer.kernels.hc``, ``deepinfer.kernels.norm``). Its ``cuda_graphs``
flag (``DEEPINFER_CUDA_GRAPHS``) lets the runtime (``deepinfer.runtime.step_graphs``) replay decode steps from CUDA
graphs (``deepinfer.models.deepseek_v4.graphs``) and, with ``prefill_graphs`` (``DEEPINFER_PREFILL_GRAPHS``), other
steps from piecewise ones (``deepinfer.models.deepseek_v4.prefill_graphs``). Its ``native_weights`` flag
(``DEEPINFER_NATIVE_WEIGHTS``) keeps the checkpoint's FP8 linears and MXFP4 experts as stored
(``deepinfer.quant.native``) and runs them through ``deepinfer.kernels.fp8_gemm`` and ``deepinfer.kernels.moe_mxfp4``.
``select_rows`` (the indexer's top-k) is one Triton program a row on CUDA (``deepinfer.kernels.topk``),
``topk_indices`` over wide rows one ``torch.topk`` of packed unique keys (``topk.packed_keys``), instead of full
stable sorts.

Its mixins: ``StreamOps`` (``streams``: ``parallel`` on a side stream), ``StepGlueOps`` (``step_glue``: the decode
step's glue), ``NvidiaMoEOps`` (``moe``: the experts and the stored FP8 / MXFP4 weights); the ops it runs as the
reference does, it takes from ``ReferenceOps`` (``deepinfer.backends.reference``) and lists in ``FROM_REFERENCE``
(``tests/backends/test_fallbacks.py``: every op of ``deepinfer.ops.Ops`` is either its own or listed there).
``invariant=True`` (``DEEPINFER_BATCH_INVARIANT=1``): the batch-invariant mode (``invariant``, ``fixed``).
"""

from __future__ import annotations

import torch

from deepinfer.backends.nvidia.bf16_parts import linear_by_parts
from deepinfer.backends.nvidia.fixed import fixed_logits, fixed_mm
from deepinfer.backends.nvidia.invariant import InvariantOps, invariance_name, pin
from deepinfer.backends.nvidia.moe import MOE_BACKENDS, NvidiaMoEOps
from deepinfer.backends.nvidia.step_glue import StepGlueOps
from deepinfer.backends.nvidia.streams import StreamOps
from deepinfer.backends.nvidia.topk import packed_select_rows, packed_topk_indices
from deepinfer.backends.reference.ops import ReferenceOps

SELECT_BACKENDS = ("auto", "kernel", "packed", "reference")  # NvidiaOps.select_backend
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class NvidiaOps(StreamOps, StepGlueOps, NvidiaMoEOps, InvariantOps, ReferenceOps):
    """The default nvidia op set (module docstring). ``moe_backend``: ``grouped_mm`` (``torch._grouped_mm``, bf16 on
    CUDA; torch's fallback elsewhere), ``triton`` (``kernels.moe.moe_triton``) or ``auto`` (by measured speed: bf16 on
    CUDA takes grouped_mm for one token and for many slots per expert, triton otherwise). ``fused``: mHC, RMSNorm and
    RoPE as single Triton kernels (off: the reference's torch ops). ``cuda_graphs``: decode steps may replay CUDA
    graphs (read by ``runtime.step_graphs``; default ``DEEPINFER_CUDA_GRAPHS``), and, with ``prefill_graphs`` (default
    ``DEEPINFER_PREFILL_GRAPHS``), other steps piecewise ones. ``native_weights``: the engine keeps FP8 / MXFP4
    weights as stored and calls ``fp8_linear`` / ``moe_mxfp4`` (default ``DEEPINFER_NATIVE_WEIGHTS``).
    ``packed_topk``: ``topk_indices`` / ``select_rows`` through ``packed_keys`` and one ``torch.topk`` (same results
    as the reference's stable sorts): ``None`` (default) for float rows on CUDA wider than ``packed_above``, ``True``
    for float rows on any device (the tests), ``False`` never. ``invariant``: the batch-invariant mode
    (``DEEPINFER_BATCH_INVARIANT``; ``invariant``: every op run with the kernels' plans pinned)."""

    # the ops taken from ReferenceOps as they are (every other op of deepinfer.ops.Ops is overridden here or in a mixin,
    # many falling back to the reference for the inputs their kernels do not take)
    FROM_REFERENCE = frozenset({
        "act_quant_sim", "fp4_quant_sim",  # core
    })  # fmt: skip

    # rows up to this width keep the reference's sorts: torch.sort on CUDA sorts a row of at most 4096 in one kernel,
    # cheaper than packing + topk for short rows such as the MoE router's 256 experts. H200, k = 512, CUDA graphs:
    # packed 1.7x faster at 64 rows of 5120 and 32768, 1.8x at 256 of 32768; slower at 1280 and for one row
    packed_above: int = 4096
    packed_rows: int = 16  # and with at least this many rows (H200: a single row of 32768 is faster sorted)
    # select_rows' implementation (set on an instance to compare them): "auto" (the Triton kernel for float scores on
    # CUDA, otherwise as packed_topk decides), "kernel" (deepinfer.kernels.topk for float scores on any device: off
    # CUDA only in Triton's interpreter), "packed" (packed_select_rows for float scores) or "reference"
    select_backend: str = "auto"

    def __init__(
        self,
        moe_backend: str = "auto",
        fused: bool = True,
        cuda_graphs: bool | None = None,
        native_weights: bool | None = None,
        packed_topk: bool | None = None,
        invariant: bool = False,
    ) -> None:
        super().__init__("nvidia")
        self.packed_topk, self.batch_invariant = packed_topk, invariant
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {moe_backend!r}")
        try:
            from deepinfer.kernels import hc, moe, norm
        except ImportError as e:  # pragma: no cover - a CUDA host without triton
            raise RuntimeError(f"the nvidia backend needs Triton (pip install 'deepinfer[nvidia]'): {e}") from e
        self._moe, self.moe_backend = moe, moe_backend
        self._hc, self._norm, self.fused = hc, norm, fused
        from deepinfer import envs

        if cuda_graphs is None:
            cuda_graphs = bool(envs.get("DEEPINFER_CUDA_GRAPHS"))
        if native_weights is None:
            native_weights = bool(envs.get("DEEPINFER_NATIVE_WEIGHTS"))
        self.cuda_graphs, self.native_weights = cuda_graphs, native_weights
        self.prefill_graphs = cuda_graphs and bool(envs.get("DEEPINFER_PREFILL_GRAPHS"))
        from deepinfer.kernels.attention import sparse_attention_gather
        from deepinfer.kernels.indexer import indexer_scores_ranges

        self._attend_lists, self._index_ranges = sparse_attention_gather, indexer_scores_ranges
        if invariant:
            self.invariance = invariance_name()
            pin(self)  # every op's kernels planned as for kernels.pinning.PLAN_ROWS rows (backends.nvidia.invariant)

    def _packs(self, scores: torch.Tensor) -> bool:
        """Whether ``topk_indices`` / ``select_rows`` of ``scores`` take the packed-key path (``packed_topk``); decided
        from shapes, dtype and device only (no sync)."""
        if self.packed_topk is False or scores.dtype not in _FLOATS or scores.numel() == 0:
            return False
        if self.packed_topk:
            return True
        wide = scores.shape[-1] > self.packed_above and scores.numel() >= self.packed_rows * scores.shape[-1]
        return scores.is_cuda and wide

    def topk_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """The reference's stable-sort top-``k`` (ties to the lower index), bit-identical: ``kernels.topk.topk_rows``
        for small ``k`` of float rows up to 4096 wide on CUDA (the routers), ``packed_topk_indices`` for wide float
        rows on CUDA, the reference sort otherwise."""
        from deepinfer.kernels import topk

        small = scores.shape[-1] <= topk.SMALL_WIDTH and 0 < min(k, scores.shape[-1]) <= topk.SMALL_K
        if self.packed_topk is not True and scores.is_cuda and scores.dtype in _FLOATS and scores.numel() and small:
            return topk.topk_rows(scores, k)
        if self._packs(scores):
            return packed_topk_indices(scores, k)
        return super().topk_indices(scores, k)

    def route(
        self, logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA one kernel (``kernels.routing.route``: the same scores and experts, the weights' ``k``-term sum in
        pick order) for up to 4096 experts and ``k <= 32``; the reference's torch ops elsewhere."""
        from deepinfer.kernels import routing, topk

        fits = (
            logits.dim() == 2 and logits.shape[-1] <= topk.SMALL_WIDTH and 0 < k <= min(topk.SMALL_K, logits.shape[-1])
        )
        if self.fused and logits.is_cuda and fits:
            return routing.route(logits, bias, k, scaling, idx)
        return super().route(logits, bias, k, scaling, idx)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
        """On CUDA one kernel (``kernels.routing.swiglu``) in place of the casts, clamps, silu and product."""
        if self.fused and gate.is_cuda and gate.dtype in _FLOATS:
            from deepinfer.kernels.routing import swiglu

            return swiglu(gate, up, limit, dtype)
        return super().swiglu(gate, up, limit, dtype)

    def select_rows(self, scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows[..., :count]`` and ``count`` as the reference's, by ``select_backend``: ``auto`` takes
        ``kernels.topk.select_rows`` (one Triton launch; the entries past ``count`` are the chosen invisible rows,
        descending) for float scores on CUDA, and elsewhere ``packed_select_rows`` where ``_packs`` says so (the
        chosen invisible rows ascending past ``count``), else the reference. Entries past ``count`` are never read."""
        backend = self.select_backend
        if backend not in SELECT_BACKENDS:
            raise ValueError(f"select_backend must be one of {SELECT_BACKENDS}, got {backend!r}")
        floats = scores.dtype in _FLOATS and scores.numel() > 0
        if floats and (backend == "kernel" or (backend == "auto" and scores.is_cuda)):
            from deepinfer.kernels.topk import select_rows

            return select_rows(scores, visible, k)
        if (floats and backend == "packed") or (backend == "auto" and self._packs(scores)):
            return packed_select_rows(scores, visible, k)
        return super().select_rows(scores, visible, k)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if not self.fused or x.dtype not in _FLOATS:
            return super().rms_norm(x, weight, eps)
        return self._norm.rms_norm(x, weight, eps)

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, inplace: bool = False
    ) -> torch.Tensor:
        if not self.fused or not self._norm.rope_supported(x, cos, sin):
            return super().rope(x, cos, sin, inverse)
        return self._norm.rope(x, cos, sin, inverse, inplace=inplace)

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
        ~1 GB head weight each step); fp32 ``y`` with a bf16 head (V4.1, ``prepare_weights``): the same GEMM on
        ``y``'s three exact bf16 parts (``bf16_parts``); the reference's cast-then-fp32-GEMM elsewhere. Batch-invariant:
        the same products on the fixed-plan kernels (``fixed``)."""
        if self.batch_invariant:
            return fixed_logits(y, w)
        if y.is_cuda and w.dtype == torch.bfloat16 and y.dtype == torch.float32:
            try:
                return linear_by_parts(y, w)
            except (TypeError, RuntimeError):  # a torch without out_dtype for mm
                pass
        if y.is_cuda and y.dtype == w.dtype and y.dtype in (torch.bfloat16, torch.float16):
            try:
                return torch.mm(y.reshape(-1, y.shape[-1]), w.t(), out_dtype=torch.float32).view(*y.shape[:-1], -1)
            except (TypeError, RuntimeError):  # a torch without out_dtype for mm
                pass
        return super().logits_linear(y, w)

    def linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """bf16 / fp16 ``x`` and ``w`` on CUDA: one half-precision GEMM with fp32 accumulation and output (the
        products of half-precision values are exact in fp32: the reference's fp32 GEMM up to the order of the sums,
        on the tensor cores and without an fp32 copy of the weight); up to ``small_gemm.MAX_M`` rows (decode) one
        Triton launch with a deterministic in-kernel split-K (``kernels.small_gemm``) instead of cuBLAS's split-K GEMM
        and its reduction kernel; the reference elsewhere. Batch-invariant: the fixed-plan kernels (``fixed``)."""
        if self.batch_invariant:
            return fixed_mm(x, w, torch.float32)
        if x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16):
            from deepinfer.kernels import small_gemm

            if small_gemm.applies(x, w):
                return small_gemm.small_mm_fp32(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)
            try:
                return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
            except (TypeError, RuntimeError):  # a torch without out_dtype for mm
                pass
        return super().linear_fp32(x, w)

    def group_pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        cur: torch.Tensor,
        prev: torch.Tensor | None,
        has_prev: torch.Tensor,
        live: torch.Tensor,
        d: int,
    ) -> torch.Tensor:
        """One Triton kernel on CUDA (``kernels.group_pool``: the rows gathered by index, rows not ``live`` skipped),
        the reference elsewhere."""
        if kv.is_cuda and kv.dtype == torch.float32 and score.dtype == torch.float32:
            from deepinfer.kernels.group_pool import group_pool

            return group_pool(kv, score, cur, prev, has_prev.view(-1), live.view(-1), d)
        return super().group_pool(kv, score, cur, prev, has_prev, live, d)

    def sparse_attention_lists(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if paged is not None and (paged[0].dtype != q.dtype or keys.dtype != q.dtype or not paged[0].is_contiguous()):
            from deepinfer.kernels.paged_keys import gathered  # the kernels read one dtype, contiguous pages

            keys, paged = gathered(keys, paged), None
        return self._attend_lists(q, keys.to(q.dtype), idx, count, sink.float(), scale, paged=paged, out=out)

    def indexer_scores_ranges(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        start: torch.Tensor,
        width: int,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if paged is not None and (paged[0].dtype != q.dtype or not paged[0].is_contiguous()):
            from deepinfer.kernels.paged_keys import gathered  # the kernel reads one dtype, contiguous pages

            keys, paged = gathered(keys, paged), None
        return self._index_ranges(q, keys.to(q.dtype), weights.float(), start, width, paged=paged)

    def cache_round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """One Triton kernel on CUDA (``kernels.cache_round``: the torch round trips bit for bit), the torch versions
        elsewhere."""
        if x.is_cuda and x.dtype in _FLOATS:
            from deepinfer.kernels.cache_round import cache_round

            return cache_round(x, fmt)
        return super().cache_round(x, fmt)
