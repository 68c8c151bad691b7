"""Two weight sets of one benchmark model, swapped in place: ``bf16`` (every weight dequantised, as the reference
backend loads a checkpoint) and ``native`` (FP8 linears and MXFP4 experts as stored, ``deepinfer.quant.native``).

The model's random weights are first encoded in the stored formats; the ``bf16`` set holds exactly the values they
decode to, so the two sets compute the same function and differ only in what a step reads and in summation order.
Each set keeps its own decode and prefill graphs (a CUDA graph holds the addresses of the weights it was captured
with).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.quant.formats import dequantize_fp8_blocks
from deepinfer.quant.native import (
    EXPERT_WEIGHTS,
    ORDER_ATTR,
    dequantize_experts,
    expert_modules,
    expert_order,
    fp8_linears,
    is_mxfp4,
    prepare_native,
)
from deepinfer.quant.nibble_order import shift_order_fits, to_order


class WeightSets:
    def __init__(self, model: nn.Module, block: tuple[int, int]) -> None:
        self.model = model
        prepare_native(model, block, quantize=True)
        self.linears = [m for _, m in fp8_linears(model)]
        self.experts = [m for _, m in expert_modules(model)]
        self.sets: dict[str, dict[str, Any]] = {"native": self._snapshot()}
        self.current = "native"
        try:
            self._build_bf16(model.embed.weight.dtype)
        except torch.OutOfMemoryError:  # both sets do not fit: leave the model on the stored formats
            self._apply(self.sets["native"])
            raise
        self.sets["bf16"] = self._snapshot()
        self.current = "bf16"
        self.use("native")

    def _build_bf16(self, dt: torch.dtype) -> None:
        with torch.no_grad():
            for m in self.linears:
                m.weight = nn.Parameter(dequantize_fp8_blocks(m.weight, m.scale, dtype=dt), requires_grad=False)
                m.scale = None
            for m in self.experts:
                for w in EXPERT_WEIGHTS:
                    value = dequantize_experts(getattr(m, w), getattr(m, f"{w}_scale"), dt)  # a few experts at a time
                    setattr(m, w, nn.Parameter(value, requires_grad=False))
                    setattr(m, f"{w}_scale", None)

    def _snapshot(self) -> dict[str, Any]:
        return {
            "linears": [(m.weight, m.scale) for m in self.linears],
            "experts": [{w: (getattr(m, w), getattr(m, f"{w}_scale")) for w in EXPERT_WEIGHTS} for m in self.experts],
            "graphs": _graphs(self.model),
        }

    def use(self, name: str) -> None:
        """Make ``name`` the model's weights (and decode graphs)."""
        if name == self.current:
            return
        self.sets[self.current]["graphs"] = _graphs(self.model)
        self._apply(self.sets[name])
        self.current = name

    def _apply(self, s: dict[str, Any]) -> None:
        for m, (w, scale) in zip(self.linears, s["linears"]):
            m.weight, m.scale = w, scale
        for m, ws in zip(self.experts, s["experts"]):
            for w, (value, scale) in ws.items():
                setattr(m, w, value)
                setattr(m, f"{w}_scale", scale)
        _set_graphs(self.model, s["graphs"])

    def bytes(self, name: str) -> int:
        """Bytes of the swapped weights in set ``name``."""
        s = self.sets[name]
        ts = [t for pair in s["linears"] for t in pair] + [t for d in s["experts"] for p in d.values() for t in p]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _graphs(model: nn.Module) -> tuple[Any, Any] | None:
    """The model's decode and piecewise prefill graphs (a graph holds the weights' addresses and the kernels it was
    captured with), or None before either was made."""
    pair = getattr(model, "decode_graphs", None), getattr(model, "prefill_graphs", None)
    return None if pair == (None, None) else pair


def _set_graphs(model: nn.Module, graphs: tuple[Any, Any] | None) -> None:
    model.decode_graphs, model.prefill_graphs = graphs or (None, None)


class OrderSets:
    """The MXFP4 experts of a model in every order of their codes, swapped in place (``--ab-order``): ``plain`` (as
    stored), ``shift`` and ``rotate`` (``quant.nibble_order``; the latter what ``NvidiaOps.prepare_weights`` makes on a
    GPU: copies here). Each order keeps its own decode and prefill graphs (a graph holds the kernels it was captured
    with)."""

    ORDERS = ("plain", "shift", "rotate")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.experts = [m for _, m in expert_modules(model) if is_mxfp4(m.w1)]
        if any(expert_order(m) != "plain" for m in self.experts):
            raise ValueError("OrderSets: the experts must be in the plain order (before prepare_weights)")
        pairs = [(getattr(m, w), getattr(m, f"{w}_scale")) for m in self.experts for w in EXPERT_WEIGHTS]
        if not all(shift_order_fits(w, s) for w, s in pairs):
            raise ValueError("OrderSets: some experts' scales do not fit the shift order (nibble_order.SCALE_RANGE)")
        plain = [{w: getattr(m, w) for w in EXPERT_WEIGHTS} for m in self.experts]
        self.sets: dict[str, dict[str, Any]] = {"plain": {"experts": plain, "graphs": None}}
        for order in self.ORDERS[1:]:
            ordered = []
            for ws in plain:
                copies = {w: nn.Parameter(t.detach().clone(), requires_grad=False) for w, t in ws.items()}
                for t in copies.values():
                    to_order(t.data, order)
                ordered.append(copies)
            self.sets[order] = {"experts": ordered, "graphs": None}
        self.current = "plain"
        self.sets["plain"]["graphs"] = _graphs(model)

    def use(self, name: str) -> None:
        """Make the experts (and decode graphs) of order ``name`` the model's."""
        if name == self.current:
            return
        self.sets[self.current]["graphs"] = _graphs(self.model)
        for m, ws in zip(self.experts, self.sets[name]["experts"], strict=True):
            for w, t in ws.items():
                setattr(m, w, t)
            setattr(m, ORDER_ATTR, name)
        _set_graphs(self.model, self.sets[name]["graphs"])
        self.current = name


__all__ = ["OrderSets", "WeightSets"]
