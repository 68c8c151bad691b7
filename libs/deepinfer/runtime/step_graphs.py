"""Which graphs, if any, run a model's step: the runtime's choice, not the model's.

A model whose family can graph its steps holds a :class:`StepGraphs` (``model.step_graphs``, attached where the model
is built for serving: its family's ``build``, or ``family.step_graphs()`` by hand; None: every step eager), and its
``forward`` asks it first: :meth:`StepGraphs.run` replays the step from the model's decode graphs (a decode step of a
batch that fits a bucket), else from its piecewise prefill graphs, and returns the step's output, or None when the
step runs eagerly (the model then runs it itself).

The graphs are the model family's classes (e.g. ``deepseek_v4.graphs.DecodeGraphs`` over
``runtime.decode_graphs.SegmentGraphs``, ``deepseek_v4.prefill_graphs.PrefillGraphs`` over
``runtime.piecewise_graphs.PiecewiseGraphs``), made on the first step that may use them and kept on the model as
``model.decode_graphs`` / ``model.prefill_graphs`` (None until then; set them to use other ones: the tests and
benchmarks do). A family may also graph speculative decoding's steps, which its speculation code asks for itself
(``of``): verify steps run as decode sub-steps (``verify``: ``deepseek_v4.verify_graphs.VerifyGraphs``) and the
drafter's loop and observe pass (``draft`` and ``observe``: ``deepseek_v4.draft_graphs``). The op set decides
whether graphs may run at all: ``ops.cuda_graphs`` (``DEEPINFER_CUDA_GRAPHS``) and not ``ops.invariant_by_sequence`` for
any of them, ``ops.prefill_graphs`` (``DEEPINFER_PREFILL_GRAPHS``) for the piecewise ones, and the model's own
``piecewise_prefill`` (True where the model has no such flag). A step asked to ``capture`` (a speculative verify
step on the ragged path: its attention layers keep their compressor projections for the rollback) never replays
decode graphs, whose buffers the next replay overwrites; it may replay the piecewise ones, whose attention (where
the projections are kept) runs eagerly between pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn


class StepGraphSet(Protocol):
    """A model's graphs of one kind of step (``runtime.decode_graphs.SegmentGraphs`` and its subclasses)."""

    def run(self, batch: Any, cache: Any) -> torch.Tensor | None:
        """The step's output replayed from graphs, or None: not a step these graphs take (it runs eagerly)."""
        ...


GraphFactory = Callable[[nn.Module], StepGraphSet]


class StepGraphs:
    """The per-step choice of graphs for a model (module docstring). ``decode`` and ``prefill`` make the model's decode
    and piecewise prefill graphs from the model (its family's classes); ``prefill`` None: no piecewise graphs."""

    def __init__(
        self, decode: GraphFactory, prefill: GraphFactory | None = None, verify: GraphFactory | None = None,
        draft: GraphFactory | None = None, observe: GraphFactory | None = None,
    ) -> None:  # fmt: skip
        self.decode, self.prefill = decode, prefill
        self.verify, self.draft, self.observe = verify, draft, observe

    def of(self, model: nn.Module, kind: str) -> Any | None:
        """The model's graphs of speculative decoding's ``kind`` of step (``verify``: verify steps on the decode path;
        ``draft``: the drafter's loop; ``observe``: the drafter's pass over kept rows), kept as
        ``model.<kind>_graphs`` and made on first use, or None: none for this family, or graphs off (as for
        ``run``)."""
        factory, ops = getattr(self, kind), model.ops
        if factory is None or not getattr(ops, "cuda_graphs", False) or ops.invariant_by_sequence:
            return None
        if getattr(model, f"{kind}_graphs", None) is None:
            setattr(model, f"{kind}_graphs", factory(model))
        return getattr(model, f"{kind}_graphs")

    def run(self, model: nn.Module, batch: Any, cache: Any, capture: bool = False) -> torch.Tensor | None:
        """``model``'s step on ``batch`` replayed from its graphs, made on the first step that may use them; None: run
        it eagerly (graphs off, a batch-invariant op set, or no graph takes this step; ``capture``: piecewise only)."""
        ops = model.ops
        if not getattr(ops, "cuda_graphs", False) or ops.invariant_by_sequence:
            return None
        out = None
        if not capture:
            if model.decode_graphs is None:
                model.decode_graphs = self.decode(model)
            out = model.decode_graphs.run(batch, cache)  # None: not a graphed decode step
        if out is not None or self.prefill is None:
            return out
        if getattr(model, "piecewise_prefill", True) and getattr(ops, "prefill_graphs", False):
            if model.prefill_graphs is None:
                model.prefill_graphs = self.prefill(model)
            out = model.prefill_graphs.run(batch, cache)  # None: not a text step, too long, or a failed capture
        return out


__all__ = ["GraphFactory", "StepGraphSet", "StepGraphs"]
