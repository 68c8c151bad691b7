"""Orders of MXFP4 expert weights: the e2m1 codes of each 32-bit word rearranged for a cheaper decode.

``quant.formats`` packs code ``2j`` of a row in the low nibble of byte ``j`` and ``2j+1`` in the high nibble, so a
32-bit word (bytes ``4w .. 4w+3``, little-endian) holds codes ``8w + i`` in nibble ``i`` (bit 0 the mantissa, bits
1-2 the exponent, bit 3 the sign). Every order keeps each word in place and moves bits within it. A decode makes of a
word four registers of two bfloat16 (codes ``2b``, ``2b+1`` in register ``b``) with the code's sign on bit 15 (31),
its exponent on bits 8..7 (24..23) and its mantissa on bit 6 (22): the bfloat16 whose exponent field is the code's,
that is ``value · 2^-126`` (the subnormal ``2^-127`` for ±0.5); times the bfloat16 scale ``2^(s - 1)`` that is the
weight, exactly, for every UE8M0 exponent ``s <= 128`` (``kernels.moe_mxfp4_gemm``):

* ``shift``: nibble ``j`` holds code ``SHIFT_ORDER[j]``; register ``b`` is ``(word << 4b) & 0x80008000`` or-ed with
  ``(word >> (6 - 4b)) & 0x01C001C0``: about 19 integer and bf16 instructions for 8 weights, against 22 for the
  byte-lookup decode of the plain order and its table constants;
* ``rotate``: the bits placed so that registers 0, 1 and 2 are the word rotated left by 0, 4 and 10 bits and masked
  with ``0x81C081C0``, register 3 the two mantissas of the word rotated by 6 or-ed with the rest of the word rotated
  by 14 (``ROTATIONS``): 9 integer instructions and 4 bf16 multiplications for 8 weights (the gate/up kernel's K
  loop: 17% fewer instructions than the shift order, ``bench/kernels/moe_sass.py``).

The order is a property of the module holding the weights (``quant.native.expert_order``): ``to_order`` rearranges a
tensor in place and ``plain`` gives a plain-order copy for readers that decode with ``quant.formats``.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.formats import ORDERS, check_order  # the orders' names: the kernels' decodes take them

SHIFT_ORDER = (6, 4, 2, 0, 7, 5, 3, 1)  # nibble j of a word holds the word's code SHIFT_ORDER[j]
# rotate: register b's left rotation (register 3: its mantissa bits', then its other bits')
ROTATIONS = (0, 4, 10, (6, 14))
SCALE_RANGE = (0, 128)  # UE8M0 exponents the shift / rotate decodes take exactly (2^(s-1) is a normal bfloat16)
_CHUNK_WORDS = 1 << 24  # words rearranged per step (64 MiB of int32 temporaries)
_TARGET = (6, 7, 8, 15)  # the bit of a bfloat16 that holds code bit 0 (mantissa), 1, 2 (exponent), 3 (sign)


def _rotate_sources() -> tuple[int, ...]:
    """``src[p]``: the plain-order bit that bit ``p`` of a rotate-order word holds."""
    src = [-1] * 32
    for code in range(8):
        reg, half = divmod(code, 2)
        for bit in range(4):
            rot = ROTATIONS[reg]
            if isinstance(rot, tuple):
                rot = rot[0] if bit == 0 else rot[1]
            src[(16 * half + _TARGET[bit] - rot) % 32] = 4 * code + bit
    assert sorted(src) == list(range(32))
    return tuple(src)


ROTATE_SOURCES = _rotate_sources()
_SHIFT_SOURCES = tuple(4 * SHIFT_ORDER[p // 4] + p % 4 for p in range(32))
_SOURCES = {"shift": _SHIFT_SOURCES, "rotate": ROTATE_SOURCES}


def _words(w: torch.Tensor) -> torch.Tensor | None:
    if not w.is_contiguous() or w.shape[-1] % 4 or w.storage_offset() % 4 or w.element_size() != 1:
        return None
    return w.view(torch.int32)


def _permute(words: torch.Tensor, src: tuple[int, ...]) -> torch.Tensor:
    """Each word with bit ``p`` taken from bit ``src[p]``: one masked shift per distance a bit moves."""
    moves: dict[int, int] = {}
    for p, q in enumerate(src):
        moves[p - q] = moves.get(p - q, 0) | (1 << q)
    out = torch.zeros_like(words)
    for d, mask in moves.items():
        m = torch.tensor(mask - (1 << 32) if mask >= 1 << 31 else mask, dtype=torch.int32)  # the int32 bit pattern
        part = words & m
        if d > 0:
            part = part << d
        elif d < 0:  # an arithmetic shift: the copies of a sign bit land above the moved bits, masked off
            part = (part >> -d) & ((1 << (32 + d)) - 1)
        out |= part
    return out


def _inverse(src: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * 32
    for p, q in enumerate(src):
        inv[q] = p
    return tuple(inv)


def _rearrange(w: torch.Tensor, src: tuple[int, ...]) -> None:
    flat = w.view(torch.int32).view(-1)
    for a in range(0, flat.numel(), _CHUNK_WORDS):
        part = flat[a : a + _CHUNK_WORDS]
        part.copy_(_permute(part, src))


def shift_order_fits(w: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``w`` (packed codes, int8 or uint8, contiguous, a whole number of words per row) with its UE8M0
    exponents ``scales`` can be decoded exactly in the shift or the rotate order. Reads the scales' range (a device
    sync)."""
    if _words(w) is None:
        return False
    if scales.numel() == 0:
        return True
    bits = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    lo, hi = int(bits.min()), int(bits.max())
    return SCALE_RANGE[0] <= lo and hi <= SCALE_RANGE[1]


def to_order(w: torch.Tensor, order: str) -> None:
    """Rearrange ``w``'s codes (plain order) in place into ``order``."""
    check_order(order)
    if _words(w) is None:
        raise ValueError(f"to_order: needs contiguous packed codes with rows of whole words, got {tuple(w.shape)}")
    if order != "plain":
        with torch.no_grad():
            _rearrange(w, _SOURCES[order])


def to_shift_order(w: torch.Tensor) -> None:
    """Rearrange ``w``'s codes (plain order) in place into the shift order."""
    to_order(w, "shift")


def plain(w: torch.Tensor, order: str = "shift") -> torch.Tensor:
    """A plain-order copy of ``w``'s codes (in ``order``)."""
    check_order(order)
    out = w.detach().clone()
    if order != "plain":
        _rearrange(out, _inverse(_SOURCES[order]))
    return out


__all__ = [
    "ORDERS",
    "ROTATE_SOURCES",
    "ROTATIONS",
    "SCALE_RANGE",
    "SHIFT_ORDER",
    "check_order",
    "plain",
    "shift_order_fits",
    "to_order",
    "to_shift_order",
]
