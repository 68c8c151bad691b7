"""Manifold-constrained hyper-connections (mHC), the residual streams of the DeepSeek-V4 family
(:class:`HyperConnectionOps`): the mixing weights of ``N`` streams (with their Sinkhorn-normalised combination), the
collapse of the streams into one layer input and the expansion of a layer output back into the streams. Used by
DeepSeek-V4 (``models/deepseek_v4/model.py``) and V4.1 (``models/deepseek_v41/mhc.py``, ``block.py``); not part of
the model-agnostic core (``core``).

Shapes: ``T`` tokens, ``N`` streams, ``D`` hidden size.
"""

from __future__ import annotations

from typing import Protocol

import torch


class HyperConnectionOps(Protocol):
    """mHC over ``N`` residual streams (module docstring): DeepSeek-V4 and V4.1."""

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
        """mHC weights of streams ``h [T, N, D]``: ``pre [T, N]``, ``post [T, N]``, Sinkhorn ``comb [T, N, N]``."""
        ...

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
        """``hc_mixes`` then ``hc_collapse`` with its ``pre``: ``(x [T, D], post [T, N], comb [T, N, N])``."""
        ...

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``Σ_j pre[:, j] · h[:, j]``: streams ``h [T, N, D]`` → ``[T, D]`` (fp32 sum, ``h.dtype`` out)."""
        ...

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``post[:, k] · y + Σ_j comb[:, j, k] · res[:, j]`` → streams ``[T, N, D]`` in ``y.dtype``."""
        ...
