"""Small building blocks: linear, RMSNorm and the interleaved rotary tables (docs/deepseek_v4.md
("Rotary embeddings (RoPE)")).

Several projections of one input can be read by one GEMM (what vLLM and SGLang do for MLA's ``q_a`` / ``kv_a``):
``join_rows`` makes their weights consecutive rows of one tensor (a backend's ``prepare_weights``), ``rows_forward``
and ``rows_fp32`` run one GEMM on such weights and split its columns, or one GEMM a weight otherwise. Each output
column is its own dot product either way; only a kernel's split of K, chosen from the shapes, may order its fp32
sums differently.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.models.deepseek_v4.config import YarnParams
from deepinfer.ops import Ops
from deepinfer.runtime.platform import platform_of


def embedding(num: int, dim: int) -> nn.Embedding:
    """A frozen ``nn.Embedding`` whose weight is allocated, not initialised, as :class:`Linear`'s: the checkpoint
    fills it (a random ``normal_`` on the meta device, where models are built, goes through torch's reference ops
    and imports TorchDynamo: 1.7 s of every worker's start)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim), _freeze=True)


class Linear(nn.Module):
    """Bias-free linear. ``fp8`` marks weights the official checkpoint stores in FP8/FP4: with the
    quantisation simulation on, or ``w8a8`` (``DEEPINFER_W8A8``), their input is FP8-rounded per 1×128 block first
    (docs/deepseek_v4.md ("Official quantization points"); ``act_fp8``), which a backend with FP8 tensor cores runs
    as a W8A8 GEMM.

    ``keeps_fp8`` (default: ``fp8``): the weight is only consumed by ``forward``, so a backend with FP8 kernels may
    keep it as stored, e4m3 plus a float32 block ``scale`` (``quant.native``); such a weight runs through
    ``ops.fp8_linear``; a grouped projection (``wo_a``) runs through ``grouped`` (``ops.fp8_grouped_linear``). A
    weight that other code reads directly passes ``keeps_fp8=False``."""

    def __init__(self, in_features: int, out_features: int, fp8: bool = False, keeps_fp8: bool | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.register_buffer("scale", None)
        self.fp8 = fp8
        self.keeps_fp8 = fp8 if keeps_fp8 is None else keeps_fp8
        self.quant_sim = False
        self.w8a8 = False

    @property
    def act_fp8(self) -> bool:
        """Whether the input is rounded to the official FP8 activations (1×128 blocks) before the product."""
        return self.fp8 and (self.quant_sim or self.w8a8)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return _linear(x, self.weight, self.scale, self.act_fp8, ops)

    def grouped(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Per-group products ``x [T, G, K]`` × the weight viewed ``[G, R, K]`` → ``[T, G, R]`` (no activation
        rounding: the official grouped ``wo_a`` is a bf16 einsum)."""
        if self.weight.dtype == torch.float8_e4m3fn:
            return ops.fp8_grouped_linear(x, self.weight, self.scale)
        return ops.grouped_linear(x, self.weight.view(x.shape[1], -1, x.shape[-1]))


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, quant: bool, ops: Ops) -> torch.Tensor:
    act_quant = quant and x.shape[-1] % 128 == 0
    if weight.dtype == torch.float8_e4m3fn:
        return ops.fp8_linear(x, weight, scale, act_quant)
    if act_quant:
        x = ops.act_quant_sim(x, 128)
    return ops.linear(x, weight)


def set_w8a8(net: nn.Module, enabled: bool) -> None:
    """Give every FP8 linear of ``net`` FP8 activations (``DEEPINFER_W8A8``), or take them away (then only the
    quantisation simulation rounds their inputs)."""
    for m in net.modules():
        if isinstance(m, Linear):
            m.w8a8 = enabled


def uses_w8a8(net: nn.Module) -> bool:
    return any(isinstance(m, Linear) and m.w8a8 and m.fp8 for m in net.modules())


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def join_rows(linears: Sequence[Linear]) -> bool:
    """Make the weights of ``linears`` (and their FP8 block scales) consecutive rows of one new tensor, each weight
    (scale) a view of its rows, so that ``rows_forward`` / ``rows_fp32`` read them with one GEMM. Only for weights of
    one dtype, device and input width with the same activation rounding and, in FP8, the same scale blocks, every
    weight but the last filling whole row blocks; returns whether it joined them (else nothing changed). Call it before
    any graph is captured: a captured graph keeps reading the weights' old storage."""
    ws = [lin.weight for lin in linears]
    if len(ws) < 2:
        return False
    w0 = ws[0]
    if any(w.dim() != 2 or (w.dtype, w.device, w.shape[1]) != (w0.dtype, w0.device, w0.shape[1])
                          for w in ws):  # fmt: skip
        return False
    if len({lin.act_fp8 for lin in linears}) > 1:
        return False
    scales = None
    if w0.dtype == torch.float8_e4m3fn:
        scales = [lin.scale for lin in linears]
        if any(s is None or s.dim() != 2 or (s.dtype, s.shape[1]) != (scales[0].dtype, scales[0].shape[1])
               for s in scales):  # fmt: skip
            return False
        blocks = {_pow2_at_least(-(-w.shape[0] // s.shape[0])) for w, s in zip(ws, scales)}
        if len(blocks) > 1 or any(w.shape[0] != s.shape[0] * next(iter(blocks)) for w, s in zip(ws[:-1], scales)):
            return False
    with torch.no_grad():
        joined = torch.cat([w.data for w in ws])
        joined_s = torch.cat([s.data for s in scales]) if scales is not None else None
        lo = slo = 0
        for i, lin in enumerate(linears):
            n = ws[i].shape[0]
            lin.weight.data = joined[lo : lo + n]
            lo += n
            if scales is not None:
                ns = scales[i].shape[0]
                lin.scale = joined_s[slo : slo + ns]
                slo += ns
    return True


def _joined(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows are ``ts`` (2-D, contiguous, adjacent in one storage), else None."""
    t0 = ts[0]
    if t0 is None or len(ts) < 2:
        return None
    at = t0.data_ptr()
    for t in ts:
        if t is None or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != t0.shape[1] or t.dtype != t0.dtype:
            return None
        if t.data_ptr() != at or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
            return None
        at += t.numel() * t.element_size()
    return torch.as_strided(t0, (sum(t.shape[0] for t in ts), t0.shape[1]), (t0.shape[1], 1))


def rows_forward(x: torch.Tensor, linears: Sequence[Linear], ops: Ops) -> list[torch.Tensor]:
    """``[lin(x, ops) for lin in linears]``, with one GEMM where ``join_rows`` joined their weights (the outputs are
    then column slices of one tensor)."""
    w = _joined([lin.weight for lin in linears])
    fp8 = w is not None and w.dtype == torch.float8_e4m3fn
    s = _joined([lin.scale for lin in linears]) if fp8 else None
    quant = {lin.act_fp8 for lin in linears}
    if w is None or (fp8 and s is None) or len(quant) > 1:  # not joined, or their activation roundings now differ
        return [lin(x, ops) for lin in linears]
    y = _linear(x, w, s, quant.pop(), ops)
    return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))


def rows_fp32(x: torch.Tensor, linears: Sequence[Linear], ops: Ops) -> list[torch.Tensor]:
    """``[ops.linear_fp32(x, lin.weight) for lin in linears]``, with one GEMM where ``join_rows`` joined them."""
    w = _joined([lin.weight for lin in linears])
    if w is None:
        return [ops.linear_fp32(x, lin.weight) for lin in linears]
    return list(ops.linear_fp32(x, w).split([lin.weight.shape[0] for lin in linears], dim=-1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(dim: int, base: float, yarn: YarnParams | None) -> torch.Tensor:
    """Inverse frequencies of the official ``precompute_freqs_cis`` (YaRN without attention factor)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None or yarn.original_max_position_embeddings <= 0:
        return freqs
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


class RotaryTable:
    """cos/sin of ``position · θ_i`` for one rope flavour (main or compress).

    The last result is kept for its ``positions`` tensor (the object, through a weak reference, and its version
    counter: an in-place write makes it stale): every layer of a forward passes the same positions, so a step computes
    the tables once instead of once a layer (four kernels each; in a captured decode graph, once per replay). A result
    is never reused across the start or end of a CUDA-graph capture (a graph must compute its own tables), and a
    graphed step passes a new positions view in each run (``graphs.py``)."""

    def __init__(self, dim: int, base: float, yarn: YarnParams | None) -> None:
        with torch.device("cpu"):  # host values whatever the default device (a model built on "meta", say)
            self.inv_freq = rope_inv_freq(dim, base, yarn)
        self._on: dict[torch.device, torch.Tensor] = {}  # inv_freq per device: no host-to-device copy per call
        self._last: tuple | None = None  # (weakref to positions, its version, ops, capturing, (cos, sin))

    def __call__(self, positions: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        last, version, capturing = self._last, _version(positions), _capturing(positions)
        if (
            last is not None
            and version is not None
            and last[0]() is positions
            and last[1:4] == (version, ops, capturing)
        ):
            return last[4]
        freq = self._on.get(positions.device)
        if freq is None:
            freq = self._on[positions.device] = self.inv_freq.to(positions.device)
        f = positions.to(torch.float32).unsqueeze(-1) * freq
        out = ops.pointwise(torch.cos, f), ops.pointwise(torch.sin, f)
        self._last = (weakref.ref(positions), version, ops, capturing, out)
        return out


def _capturing(t: torch.Tensor) -> bool:
    return platform_of(t.device).capturing()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, None for a tensor that keeps none (made under ``torch.inference_mode``)."""
    try:
        return t._version
    except RuntimeError:
        return None
