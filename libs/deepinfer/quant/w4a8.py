"""FP8 activations for the routed MXFP4 experts (``DEEPINFER_W4A8``): which modules take them, and the row references
that cast their weights to e4m3 exactly for the FP8 tensor cores (``kernels.moe_w4a8_wgmma``).

The activations are the official ones (docs/deepseek_v4.md, "Official quantization points"): each expert input row and
each slot's hidden row rounded per 128 columns to e4m3 with a power-of-two scale (``moe_mxfp4(act_quant=True)``), on
every path and batch size, so a token's numerics do not depend on the kernel that ran it. On an sm_90 GPU the prefill
tiles then run W4A8: a weight row's codes become e4m3 against the row's reference exponent ``r`` (``row_refs``), the
code ``v`` of a block with exponent ``s`` the e4m3 ``v · 2^(6 + s - r)`` and the row's scale ``2^(r - 133)``: exact
while every non-zero block has ``s >= r - 11`` and ``r >= 7``. Rows that miss (outlier blocks more than 2^11 below their
row's largest; real checkpoints' block exponents spread far less) keep the module on the W4A16 kernels, with the same
activations.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.quant.native import EXPERT_WEIGHTS, REFS_ATTR, expert_modules, is_mxfp4
from deepinfer.quant.native import W4A8_ATTR as ATTR

MIN_SHIFT = -11  # the lowest s - r cast exactly (the code 0.5 times 2^(6 - 11): the smallest normal e4m3)
MIN_REF = 7  # the lowest reference whose scale 2^(r - 133) is a normal fp32
_CHUNK_BYTES = 1 << 26


def set_w4a8(net: nn.Module, enabled: bool) -> None:
    """Give every routed-expert module of ``net`` FP8 activations (``DEEPINFER_W4A8``), or take them away."""
    for _, m in expert_modules(net):
        setattr(m, ATTR, bool(enabled))


def uses_w4a8(net: nn.Module) -> bool:
    return any(getattr(m, ATTR, False) for _, m in expert_modules(net))


def row_refs(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """The reference exponents of the rows of MXFP4 experts ``w [E, N, K/2]`` (bytes, codes as stored) with exponents
    ``s [E, N, K/32]``: int32 ``[E, N]``, each row's largest exponent among its non-zero blocks (127 for a row of
    zeros); None when some non-zero block lies below ``r + MIN_SHIFT`` or some reference below ``MIN_REF`` (the cast
    would round). Reads the whole tensor once (chunks of experts); one device sync."""
    e, n, kh = w.shape
    nb = s.shape[-1]
    if kh != 16 * nb:
        raise ValueError(f"row_refs: {kh} bytes a row do not make {nb} blocks of 32 codes")
    sb = s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s
    step = max(1, _CHUNK_BYTES // max(1, n * kh))
    refs, ok = [], torch.ones((), dtype=torch.bool, device=w.device)
    for lo in range(0, e, step):
        wc = w[lo : lo + step].view(torch.uint8).reshape(-1, n, nb, 16)
        # a byte of codes 0 and -0 (0x00, 0x08, 0x80, 0x88) is zero: only the magnitudes count
        nz = ((wc & 0x77) != 0).any(-1)
        sc = sb[lo : lo + step].to(torch.int32)
        r = torch.where(nz, sc, -1).amax(-1)
        low = torch.where(nz, sc, 255).amin(-1)
        r = torch.where(r < 0, 127, r)
        ok &= ((low >= r + MIN_SHIFT) & (r >= MIN_REF)).all()
        refs.append(r)
    if not bool(ok):
        return None
    return torch.cat(refs).contiguous()


def prepare_w4a8(model: nn.Module) -> int:
    """For every routed-expert module with FP8 activations (``set_w4a8``) whose MXFP4 weights all cast exactly: its
    row references (``REFS_ATTR``); the module's codes stay as stored (the W4A8 decode reads them so). Returns how
    many modules got them."""
    done = 0
    with torch.no_grad():
        for _, m in expert_modules(model):
            if not getattr(m, ATTR, False) or not is_mxfp4(m.w1) or getattr(m, REFS_ATTR, None) is not None:
                continue
            refs = [row_refs(getattr(m, w), getattr(m, f"{w}_scale")) for w in EXPERT_WEIGHTS]
            if all(r is not None for r in refs):
                setattr(m, REFS_ATTR, tuple(refs))
                done += 1
    return done


def refs_of(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(r1, r2, r3)`` where ``prepare_w4a8`` gave ``m`` its row references, else None."""
    return getattr(m, REFS_ATTR, None)


__all__ = ["ATTR", "MIN_SHIFT", "prepare_w4a8", "refs_of", "row_refs", "set_w4a8", "uses_w4a8"]
