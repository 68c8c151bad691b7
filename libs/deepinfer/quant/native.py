"""Weights kept on the device in the checkpoint's own formats, for backends with kernels for them
(docs/deepseek_v4.md, "Checkpoint format").

The official checkpoints store the dense linears as FP8 e4m3 with UE8M0 block scales (128×128 in V4, 32×32 in
V4.1) and the routed experts as MXFP4 (packed e2m1 + one UE8M0 scale per 32 inputs). The reference backend
dequantises them once, at load time, to the model dtype. A backend with FP8 / MXFP4 kernels (``NvidiaOps``) keeps
them as stored instead, so a decode step reads 1 byte (FP8) or 0.53 byte (MXFP4) per weight instead of 2:

* a dense ``Linear`` whose weight goes through its ``forward`` (``Linear.keeps_fp8``) holds an e4m3 ``weight`` and a
  float32 ``scale`` buffer ``[ceil(N/B0), ceil(K/B1)]`` and calls ``ops.fp8_linear``;
* a routed-expert module holds int8 ``w1/w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` and uint8 ``w1_scale/w3_scale
  [E, I, D/32]``, ``w2_scale [E, D, I/32]`` (the e8m0 exponent bits) and calls ``ops.moe_mxfp4``; an op set may
  rearrange the codes of each word for its kernels once they are loaded (``order_experts``: the module's
  ``mx_order`` says which order they are in).

Both decode exactly to the values the reference dequantises to (UE8M0 scales are powers of two), so the kernels are
the reference's products in another summation order. ``prepare_native(model, block)`` switches a model built with
float weights to this layout: ``quantize=True`` encodes its current weights (random benchmark models),
``quantize=False`` only allocates the storage for the loader to fill from a checkpoint. ``ops.native_weights``
says whether an op set wants it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from deepinfer.quant.formats import MXFP4_BLOCK, dequantize_mxfp4, quantize_fp8_blocks, quantize_mxfp4
from deepinfer.quant.nibble_order import check_order, plain, shift_order_fits, to_order

FP8 = torch.float8_e4m3fn
EXPERT_WEIGHTS = ("w1", "w2", "w3")
ORDER_ATTR = "mx_order"  # set on a routed-expert module by order_experts
W4A8_ATTR = "mx_w4a8"  # on a routed-expert module: FP8 activations (quant.w4a8.set_w4a8)
REFS_ATTR = "mx_refs"  # on a routed-expert module: its W4A8 row references (quant.w4a8.prepare_w4a8)


def is_fp8(w: torch.Tensor) -> bool:
    return w.dtype == FP8


def is_mxfp4(w: torch.Tensor) -> bool:
    return w.dtype in (torch.int8, torch.uint8)


def logical_shape(w: torch.Tensor) -> tuple[int, ...]:
    """The shape of the decoded weight (packed MXFP4 holds two values per byte along the last dim)."""
    return (*w.shape[:-1], w.shape[-1] * 2) if is_mxfp4(w) else tuple(w.shape)


def fp8_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The linears whose weight may stay FP8: stored FP8 in the checkpoint and consumed only by their ``forward``."""
    for name, m in model.named_modules():
        if getattr(m, "fp8", False) and getattr(m, "keeps_fp8", False):
            yield name, m


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules holding stacked routed experts (``w1``, ``w2``, ``w3`` parameters ``[E, ·, ·]``)."""
    for name, m in model.named_modules():
        ws = [getattr(m, w, None) for w in EXPERT_WEIGHTS]
        if all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in ws):
            yield name, m


def _experts_per_chunk(e: int, n: int, k: int, budget: int) -> int:
    return max(1, min(e, budget // max(1, n * k)))


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float → packed MXFP4 int8 ``[E, N, K/2]`` and uint8 e8m0 exponent bits ``[E, N, K/32]``
    (``quant.formats.quantize_mxfp4`` on every expert), on ``w``'s device, a few experts at a time (V4-Flash: 256 ×
    2048 × 4096 per layer)."""
    e, n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"quantize_experts: K must be a multiple of {MXFP4_BLOCK}, got {k}")
    packed = torch.empty((e, n, k // 2), dtype=torch.int8, device=w.device)
    scales = torch.empty((e, n, k // MXFP4_BLOCK), dtype=torch.uint8, device=w.device)
    step = _experts_per_chunk(e, n, k, 1 << 23)
    for a in range(0, e, step):
        b = min(e, a + step)
        q, sc = quantize_mxfp4(w[a:b].reshape((b - a) * n, k))
        packed[a:b] = q.view(b - a, n, k // 2)
        scales[a:b] = sc.view(torch.uint8).view(b - a, n, -1)
    return packed, scales


def dequantize_experts(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_experts`` (``s`` as uint8 exponent bits or ``float8_e8m0fnu``) → ``[E, N, K]`` in
    ``dtype``, a few experts at a time."""
    e, n, kh = w.shape
    if tuple(s.shape) != (e, n, 2 * kh // MXFP4_BLOCK) or (2 * kh) % MXFP4_BLOCK:
        raise ValueError(f"dequantize_experts: scales {tuple(s.shape)} do not match packed {tuple(w.shape)}")
    s = s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s
    out = torch.empty((e, n, 2 * kh), dtype=dtype, device=w.device)
    step = _experts_per_chunk(e, n, 2 * kh, 1 << 25)
    for a in range(0, e, step):
        b = min(e, a + step)
        deq = dequantize_mxfp4(w[a:b].reshape((b - a) * n, kh), s[a:b].reshape((b - a) * n, -1), dtype)
        out[a:b] = deq.view(b - a, n, 2 * kh)
    return out


def prepare_native(model: nn.Module, block: tuple[int, int], quantize: bool) -> None:
    """Switch ``model``'s FP8 linears and routed experts to the stored formats (module docstring)."""
    with torch.no_grad():
        for _, m in fp8_linears(model):
            w = m.weight
            if is_fp8(w):
                continue
            n, k = w.shape
            if quantize:
                q, s = quantize_fp8_blocks(w.data, block)
            else:
                q = torch.empty(n, k, dtype=FP8, device=w.device)
                s = torch.empty(-(-n // block[0]), -(-k // block[1]), device=w.device)
            m.weight = nn.Parameter(q, requires_grad=False)
            m.scale = s.float()
        for _, m in expert_modules(model):
            for name in EXPERT_WEIGHTS:
                w = getattr(m, name)
                if is_mxfp4(w):
                    continue
                e, n, k = w.shape
                if k % MXFP4_BLOCK:
                    raise ValueError(f"MXFP4 experts need in_features divisible by {MXFP4_BLOCK}, got {k}")
                if quantize:
                    q, s = quantize_experts(w.data)
                else:
                    q = torch.empty(e, n, k // 2, dtype=torch.int8, device=w.device)
                    s = torch.empty(e, n, k // MXFP4_BLOCK, dtype=torch.uint8, device=w.device)
                setattr(m, name, nn.Parameter(q, requires_grad=False))
                setattr(m, f"{name}_scale", s)


def unprepare(model: nn.Module, target: str) -> str:
    """Undo ``prepare_native`` for the weight ``target`` (its checkpoint tensor is not in the stored format: it is
    decoded to the model dtype instead): drops its scales and returns their name. The caller replaces the weight."""
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    key = "scale" if leaf == "weight" else f"{leaf}_scale"
    module._buffers[key] = None
    return f"{owner}.{key}" if owner else key


def expert_order(m: nn.Module) -> str:
    """The order of a routed-expert module's MXFP4 codes (``quant.nibble_order``): ``plain`` as stored, or the one
    ``order_experts`` rearranged them into."""
    return getattr(m, ORDER_ATTR, "plain")


def order_experts(model: nn.Module, order: str = "rotate") -> int:
    """Rearrange the MXFP4 codes of every routed-expert module still in the plain order whose three weights fit the
    shift / rotate decodes (their scales in ``nibble_order.SCALE_RANGE``) into ``order``, in place, and mark the
    module; returns how many were rearranged. Reads each module's scale range (one device sync per weight): call it
    once, after loading."""
    check_order(order)
    done = 0
    with torch.no_grad():
        for _, m in expert_modules(model):
            if order == "plain" or expert_order(m) != "plain" or not is_mxfp4(m.w1):
                continue
            if getattr(m, REFS_ATTR, None) is not None:  # quant.w4a8: its W4A8 decode reads the codes as stored
                continue
            pairs = [(getattr(m, w), getattr(m, f"{w}_scale")) for w in EXPERT_WEIGHTS]
            if not all(is_mxfp4(w) and shift_order_fits(w, s) for w, s in pairs):
                continue
            for w, _ in pairs:
                to_order(w.data, order)
            setattr(m, ORDER_ATTR, order)
            done += 1
    return done


def stored_experts(model: nn.Module) -> int:
    """Undo what an op set's ``prepare_weights`` derived for the routed-expert modules of ``model`` (a MoE layer, or
    a whole model): codes back in the stored order (``order_experts``), W4A8 row references dropped
    (``quant.w4a8.prepare_w4a8``). Each expert row is then what the checkpoint stored, so rows can move between
    modules (EPLB: ``parallel.rebalancer.apply``) and ``prepare_weights`` arrange them again. Returns how many
    modules changed."""
    done = 0
    with torch.no_grad():
        for _, m in expert_modules(model):
            order, changed = expert_order(m), getattr(m, REFS_ATTR, None) is not None
            if order != "plain":
                for w in EXPERT_WEIGHTS:
                    p = getattr(m, w)
                    p.data.copy_(plain(p.data, order))
                setattr(m, ORDER_ATTR, "plain")
                changed = True
            setattr(m, REFS_ATTR, None)
            done += changed
    return done


def routed_experts(
    m: nn.Module,
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    ops: object,
    act_quant: bool = False,
) -> torch.Tensor:
    """``ops.moe`` or ``ops.moe_mxfp4`` over ``m``'s experts, whichever format they are stored in → ``[T, D]`` fp32.
    ``act_quant``: the official FP8 activations (``Ops.moe``); also where the module has them (``quant.w4a8``), with
    its row references for the W4A8 kernels where it has those."""
    act_quant = act_quant or getattr(m, W4A8_ATTR, False)
    if is_mxfp4(m.w1):
        refs = getattr(m, REFS_ATTR, None)
        extra = {"refs": refs} if refs is not None and act_quant else {}
        return ops.moe_mxfp4(
            x, idx, weights, m.w1, m.w1_scale, m.w2, m.w2_scale, m.w3, m.w3_scale, limit, order=expert_order(m),
            act_quant=act_quant, **extra,
        )  # fmt: skip
    return ops.moe(x, idx, weights, m.w1, m.w2, m.w3, limit, act_quant=act_quant)
