"""Single-pass (lagged) mHC of DeepSeek-V4.1 (docs/deepseek_v41.md ("Single-pass (lagged) mHC")) over the ops interface.

The per-sublayer coefficient math is V4's (``ops.hc_mixes``: projection before the RMS factor, sigmoid pre/post,
Sinkhorn comb; the RMS statistic uses ``rms_norm_eps`` = 1e-20 in V4.1), collapse and expand are V4's
``ops.hc_collapse`` / ``ops.hc_expand``. What changes is the hand-off: a sublayer's input is the collapse of the
streams with the *previous* sublayer's ``pre`` (one-hot on stream 0 before layer 0), while its own ``pre`` is
passed on to the next sublayer; after the last layer the streams collapse with the last FFN ``pre`` (no
``hc_head``). Both coefficient sets of a sublayer are computed from the same (post-Engram) streams, so one pass
over the streams per sublayer suffices.

Rounding note: NeMo and the released kernel fuse the affine ``base + scale · mix`` (``addcmul``); ``hc_mixes``
multiplies then adds. The two differ by at most an ulp of the logits (fp32 parity ≤ 1e-6 in the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.ops import Ops


class Mix(NamedTuple):
    """fp32 coefficients of one sublayer: ``pre [T, N]``, ``post [T, N]``, ``comb [T, N_in, N_out]``."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


class HyperConnection(nn.Module):
    """Coefficient predictor of one sublayer (released ``layers.{i}.hc_attn_*`` / ``hc_ffn_*``; NeMo
    ``attn_hc`` / ``ffn_hc``): ``fn [N(N+2), N·D]``, ``base [N(N+2)]``, ``scale [3]``, all fp32."""

    def __init__(self, config: DeepseekV41TextConfig) -> None:
        super().__init__()
        n, dim = config.hc_mult, config.hidden_size
        self.iters, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n * (n + 2), n * dim), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(n * (n + 2)), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, h: torch.Tensor, ops: Ops) -> Mix:
        """Coefficients of streams ``h [T, N, D]``."""
        return Mix(*ops.hc_mixes(h, self.fn, self.scale, self.base, self.iters, self.eps, self.norm_eps))


def initial_pre(num_tokens: int, streams: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``pre`` that layer 0's attention collapses with: one-hot on stream 0, ``[T, N]`` fp32."""
    pre = torch.zeros(num_tokens, streams, dtype=torch.float32, device=device)
    pre[:, 0] = 1
    return pre


def embed_streams(x: torch.Tensor, streams: int) -> torch.Tensor:
    """Token embeddings ``[T, D]`` repeated into ``streams`` residual streams ``[T, N, D]``."""
    return x.unsqueeze(1).expand(-1, streams, -1).contiguous()


def lagged_sublayer(
    h: torch.Tensor,
    pre: torch.Tensor,
    hc: HyperConnection,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One mHC-wrapped sublayer: ``sublayer(collapse(h, pre))`` expanded with ``hc(h)``'s post/comb.

    ``h [T, N, D]`` are the streams, ``pre [T, N]`` the previous sublayer's pre (``initial_pre`` for the first);
    ``sublayer`` maps ``[T, D]`` → ``[T, D]`` (norm included). Returns the new streams and this sublayer's
    ``pre``, which the next sublayer (or ``final_collapse``) consumes."""
    mix = hc(h, ops)
    y = sublayer(ops.hc_collapse(h, pre))
    return ops.hc_expand(y, h, mix.post, mix.comb), mix.pre


def final_collapse(h: torch.Tensor, pre: torch.Tensor, ops: Ops) -> torch.Tensor:
    """The trunk output ``[T, D]`` (before the final norm): the streams collapsed with the last FFN ``pre``."""
    return ops.hc_collapse(h, pre)
