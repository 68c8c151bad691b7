"""The shift order of MXFP4 expert weights: the e2m1 codes of each 32-bit word rearranged for a cheaper decode.

``quant.formats`` packs code ``2j`` of a row in the low nibble of byte ``j`` and ``2j+1`` in the high nibble, so a
32-bit word (bytes ``4w .. 4w+3``, little-endian) holds codes ``8w + i`` in nibble ``i``. The shift order keeps
every word in place and permutes its nibbles: nibble ``j`` holds code ``SHIFT_ORDER[j]`` of the word. Then
``(word << 4b) & 0x80008000`` puts the signs of codes ``2b`` and ``2b+1`` on bits 15 and 31 and
``(word >> (6 - 4b)) & 0x01C001C0`` their exponent and mantissa bits on bits 8..6 and 24..22: two bfloat16 whose
exponent field is the code's, that is ``value · 2^-126`` (the subnormal ``2^-127`` for ±0.5). Times the bfloat16
scale ``2^(s - 1)`` that is the weight, exactly, for every UE8M0 exponent ``s <= 128``: about 19 integer and
bf16 instructions for 8 weights, against 22 for the byte-lookup decode of the plain order and its table constants
(``kernels.moe_mxfp4``).

The order is a property of the module holding the weights (``quant.native.expert_order``): ``to_shift_order``
rearranges a tensor in place and ``plain`` gives a plain-order copy for readers that decode with ``quant.formats``.
"""

from __future__ import annotations

import torch

SHIFT_ORDER = (6, 4, 2, 0, 7, 5, 3, 1)  # nibble j of a word holds the word's code SHIFT_ORDER[j]
ORDERS = ("plain", "shift")
SCALE_RANGE = (0, 128)  # UE8M0 exponents the shift decode takes exactly (2^(s-1) is a normal bfloat16)
_CHUNK_WORDS = 1 << 24  # words rearranged per step (64 MiB of int32 temporaries)


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"MXFP4 nibble order must be one of {ORDERS}, got {order!r}")


def _words(w: torch.Tensor) -> torch.Tensor | None:
    if not w.is_contiguous() or w.shape[-1] % 4 or w.storage_offset() % 4 or w.element_size() != 1:
        return None
    return w.view(torch.int32)


def _permute(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Each word with nibble ``j`` taken from nibble ``order[j]``."""
    out = torch.zeros_like(words)
    for j, src in enumerate(order):
        out |= ((words >> (4 * src)) & 0xF) << (4 * j)
    return out


def _rearrange(w: torch.Tensor, order: tuple[int, ...]) -> None:
    flat = w.view(torch.int32).view(-1)
    for a in range(0, flat.numel(), _CHUNK_WORDS):
        part = flat[a : a + _CHUNK_WORDS]
        part.copy_(_permute(part, order))


def shift_order_fits(w: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``w`` (packed codes, int8 or uint8, contiguous, a whole number of words per row) with its UE8M0
    exponents ``scales`` can be decoded exactly in the shift order. Reads the scales' range (a device sync)."""
    if _words(w) is None:
        return False
    if scales.numel() == 0:
        return True
    bits = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    lo, hi = int(bits.min()), int(bits.max())
    return SCALE_RANGE[0] <= lo and hi <= SCALE_RANGE[1]


def to_shift_order(w: torch.Tensor) -> None:
    """Rearrange ``w``'s codes (plain order) in place into the shift order."""
    if _words(w) is None:
        raise ValueError(f"to_shift_order: needs contiguous packed codes with rows of whole words, got {w.shape}")
    with torch.no_grad():
        _rearrange(w, SHIFT_ORDER)


def plain(w: torch.Tensor) -> torch.Tensor:
    """A plain-order copy of ``w``'s codes (shift order)."""
    out = w.detach().clone()
    _rearrange(out, tuple(SHIFT_ORDER.index(i) for i in range(8)))
    return out


__all__ = ["ORDERS", "SCALE_RANGE", "SHIFT_ORDER", "check_order", "plain", "shift_order_fits", "to_shift_order"]
