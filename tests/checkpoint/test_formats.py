"""The official weight formats (docs/deepseek_v4.md, "Checkpoint format"): FP8 e4m3 with UE8M0 block scales,
MXFP4 routed experts.

Every decode is checked against a reference written here from the spec, not from the library:
``W = w8 · 2^(s − 127)`` per block for FP8, ``W = LUT[nibble] · 2^(e − 127)`` per 32 for MXFP4.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.quant.formats import (
    FP4_VALUES,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    fp4_codes,
    fp4_round,
    quantize_fp8_blocks,
    quantize_mxfp4,
)

# e8m0 byte -> 2^(byte-127), exact in float64 (255 is NaN)
_E8M0 = torch.tensor([math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan], dtype=torch.float64)
# the OCP e2m1 table, written out from the spec (bit 3 = sign)
_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    assert scale.dtype == torch.float8_e8m0fnu
    return _E8M0[scale.view(torch.uint8).long()]


def ref_fp8(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    rows = torch.arange(w8.shape[0]) // block[0]
    cols = torch.arange(w8.shape[1]) // block[1]
    s = e8m0_values(scale)[rows][:, cols]
    return (w8.float().double() * s).float()


def ref_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.long)
    codes[:, 0::2] = b & 0xF
    codes[:, 1::2] = b >> 4
    vals = torch.tensor(_LUT, dtype=torch.float64)[codes]
    s = e8m0_values(scale)[:, torch.arange(codes.shape[1]) // 32]
    return (vals * s).float()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def random_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Gaussian with a different magnitude per row and per column, so blocks get different scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w *= torch.exp2(torch.randint(-6, 7, (shape[0], 1), generator=g).float())
    w *= torch.exp2(torch.randint(-3, 4, (1, shape[1]), generator=g).float())
    # and a pattern that changes every 64 rows / columns, so that neighbouring 128-blocks differ
    w *= torch.exp2(3.0 * (torch.arange(shape[0]) // 64 % 3)).unsqueeze(1)
    w *= torch.exp2(-2.0 * (torch.arange(shape[1]) // 64 % 4))
    return w


# ---------------------------------------------------------------------------------------------------------------
# FP8 e4m3 + UE8M0 block scales
# ---------------------------------------------------------------------------------------------------------------

FP8_SHAPES = [(200, 300), (128, 128), (256, 384), (1, 1), (129, 127), (64, 640), (300, 17)]


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_scale_dtype_shape_and_power_of_two(shape):
    w = random_weight(shape, seed=sum(shape))
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    sv = e8m0_values(s)
    assert torch.isfinite(sv).all()
    assert torch.equal(torch.exp2(torch.log2(sv).round()), sv)  # powers of two
    # the smallest power of two that brings the block's amax within ±448
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max().double()
            assert amax / sv[i, j] <= 448
            assert amax / (sv[i, j] / 2) > 448


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_decode_matches_reference(shape):
    w = random_weight(shape, seed=7 + shape[0])
    q, s = quantize_fp8_blocks(w)
    ref = ref_fp8(q, s)
    # the block size is inferred from the shapes (also for sizes that are not multiples of 128) ...
    assert torch.equal(dequantize_fp8_blocks(q, s), ref)
    # ... or given explicitly
    assert torch.equal(dequantize_fp8_blocks(q, s, block=(128, 128)), ref)
    assert dequantize_fp8_blocks(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(dequantize_fp8_blocks(q, s, torch.bfloat16).float(), ref)  # e4m3 · 2^k is exact in bf16
    # quantisation error: at most half an e4m3 step (2^-4 relative for normals, 2^-10 · s for subnormals)
    sv = e8m0_values(s)[torch.arange(shape[0]) // 128][:, torch.arange(shape[1]) // 128].float()
    assert ((ref - w).abs() <= w.abs() * 2.0**-4 + sv * 2.0**-10).all()


def test_fp8_non_multiple_shape_blocks_are_128_wide():
    """200×300 has 2×3 blocks of 128 (the last ones partial), not 2×3 blocks of 100."""
    q = torch.full((200, 300), 1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 128, 129], [130, 131, 132]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = dequantize_fp8_blocks(q, s)
    assert d[127, 127] == 1.0 and d[128, 127] == 8.0
    assert d[0, 127] == 1.0 and d[0, 128] == 2.0 and d[0, 255] == 2.0 and d[0, 256] == 4.0
    assert d[199, 299] == 32.0
    assert torch.equal(d, ref_fp8(q, s))


@pytest.mark.parametrize("shape", [(200, 300), (64, 96), (33, 65)])
def test_fp8_v41_32x32_blocks(shape):
    w = random_weight(shape, seed=3)
    q, s = quantize_fp8_blocks(w, (32, 32))
    assert tuple(s.shape) == (math.ceil(shape[0] / 32), math.ceil(shape[1] / 32))
    ref = ref_fp8(q, s, (32, 32))
    assert torch.equal(dequantize_fp8_blocks(q, s, block=(32, 32)), ref)
    assert torch.equal(dequantize_fp8_blocks(q, s), ref)


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_round_trip_is_exact_after_one_pass(shape):
    w = random_weight(shape, seed=11 * shape[1])
    q1, s1 = quantize_fp8_blocks(w)
    d1 = dequantize_fp8_blocks(q1, s1)
    q2, s2 = quantize_fp8_blocks(d1)
    d2 = dequantize_fp8_blocks(q2, s2)
    assert torch.equal(d2, d1)  # decoded values are representable: a second pass changes nothing
    q3, s3 = quantize_fp8_blocks(d2)
    assert_same_bits(q3, q2)
    assert_same_bits(s3, s2)


def canonical_fp8(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random stored FP8 weight in the converter's canonical form: every block holds a code of magnitude
    > 224 (else the smallest scale would be half as large) and no NaN codes."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # 0x7F / 0xFF are NaN
    nb0, nb1 = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
    for i in range(nb0):
        for j in range(nb1):
            # 0x77..0x7E are 240..448 (> 224); put one at a random spot of the block
            r = i * 128 + int(torch.randint(0, min(128, shape[0] - i * 128), (1,), generator=g))
            c = j * 128 + int(torch.randint(0, min(128, shape[1] - j * 128), (1,), generator=g))
            sign = 0x80 * int(torch.randint(0, 2, (1,), generator=g))
            b[r, c] = int(torch.randint(0x77, 0x7F, (1,), generator=g)) | sign
    w8 = b.to(torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(100, 140, (nb0, nb1), generator=g, dtype=torch.int32).to(torch.uint8)
    return w8, s.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (5, 7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_requantising_a_decoded_tensor_is_bit_identical(shape, seed):
    w8, s = canonical_fp8(shape, seed)
    d = dequantize_fp8_blocks(w8, s)
    assert torch.equal(d, ref_fp8(w8, s))
    q, s2 = quantize_fp8_blocks(d)
    assert_same_bits(q, w8)
    assert_same_bits(s2, s)


def test_fp8_non_canonical_encoding_requantises_to_the_same_values():
    """A block whose largest magnitude is ≤ 224·s re-encodes with scale s/2: different bits, same values."""
    w8 = torch.tensor([[224.0, -1.5], [0.25, 3.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = dequantize_fp8_blocks(w8, s)
    q, s2 = quantize_fp8_blocks(d)
    assert bits(s2).item() == 126
    assert torch.equal(q.float(), 2 * w8.float())
    assert torch.equal(dequantize_fp8_blocks(q, s2), d)


def test_fp8_zero_block_decodes_to_zero():
    w = torch.zeros(130, 260)
    w[:128, :128] = 1.0
    q, s = quantize_fp8_blocks(w)
    assert torch.equal(dequantize_fp8_blocks(q, s), w)
    assert torch.equal(ref_fp8(q, s), w)


@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(1, 300),
    inp=st.integers(1, 300),
    exp=st.integers(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_fp8_property_decode_and_round_trip(out, inp, exp, seed):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 2.0**exp
    q, s = quantize_fp8_blocks(w)
    assert tuple(s.shape) == (-(-out // 128), -(-inp // 128))
    d = dequantize_fp8_blocks(q, s)
    assert torch.equal(d, ref_fp8(q, s))
    assert torch.equal(dequantize_fp8_blocks(*quantize_fp8_blocks(d)), d)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4)])
def test_fp8_quantise_needs_2d(shape):
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(torch.randn(shape))


def test_fp8_scale_shape_mismatch_raises():
    q, s = quantize_fp8_blocks(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_blocks(q, s[:1], block=(128, 128))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_blocks(q, s, block=(32, 32))
    # 3 row blocks cannot be 128- (or any power-of-two-) sized blocks over 256 rows
    bad = torch.full((3, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_blocks(q, bad)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 (e2m1, two per byte, UE8M0 scale per 32)
# ---------------------------------------------------------------------------------------------------------------


def e8m0(*exps: int) -> torch.Tensor:
    return torch.tensor(exps, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_mxfp4_nibble_order_hand_packed():
    """Byte k holds element 2k in the low nibble and 2k+1 in the high nibble."""
    row = [0] * 16
    row[0] = 0x71  # low 1 = 0.5, high 7 = 6.0
    row[1] = 0x9A  # low A = -1.0, high 9 = -0.5
    row[15] = 0x2C  # low C = -2.0, high 2 = 1.0
    packed = torch.tensor([row, row], dtype=torch.uint8).view(torch.int8)
    scale = e8m0(127, 129).view(2, 1)  # 1 and 4
    d = dequantize_mxfp4(packed, scale)
    expected = torch.zeros(2, 32)
    expected[0, [0, 1, 2, 3, 30, 31]] = torch.tensor([0.5, 6.0, -1.0, -0.5, -2.0, 1.0])
    expected[1] = 4 * expected[0]
    assert torch.equal(d, expected)
    assert torch.equal(ref_mxfp4(packed, scale), expected)


def test_mxfp4_lut_values_and_signs():
    codes = torch.arange(16)
    packed = (codes | (codes << 4)).to(torch.uint8).view(1, 16).view(torch.int8)  # 32 elements: each code twice
    d = dequantize_mxfp4(packed, e8m0(127).view(1, 1))
    expected = torch.tensor(_LUT).repeat_interleave(2)
    assert torch.equal(d[0], expected)
    assert torch.equal(torch.signbit(d[0]), torch.signbit(expected))  # code 8 is -0.0
    assert FP4_VALUES.tolist() == _LUT
    assert torch.equal(torch.signbit(FP4_VALUES), torch.tensor([False] * 8 + [True] * 8))


def test_mxfp4_scale_per_32_elements():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (3, 64), generator=g, dtype=torch.int8)  # 128 elements: 4 scales a row
    scale = torch.randint(110, 145, (3, 4), generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    d = dequantize_mxfp4(packed, scale)
    assert torch.equal(d, ref_mxfp4(packed, scale))
    unit = dequantize_mxfp4(packed, torch.full((3, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    for k in range(4):
        blk = slice(32 * k, 32 * (k + 1))
        assert torch.equal(d[:, blk], unit[:, blk] * e8m0_values(scale)[:, k : k + 1].float())


def test_mxfp4_quantise_hand_built_row():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([0.5, 6.0, -1.0, -0.5])
    w[0, 30:] = torch.tensor([-2.0, 1.0])
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (1, 1)
    assert bits(scale).item() == 127
    b = bits(packed)[0].tolist()
    assert b[0] == 0x71 and b[1] == 0x9A and b[15] == 0x2C and b[2:15] == [0] * 13
    # the same row at another scale only changes the scale byte
    packed2, scale2 = quantize_mxfp4(w * 2.0**-5)
    assert torch.equal(packed2, packed) and bits(scale2).item() == 122


@pytest.mark.parametrize(
    "value,expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_mxfp4_ties_round_to_even(value, expected):
    v = torch.tensor([value, -value])
    r = fp4_round(v)
    assert r.tolist() == [expected, -expected]
    assert torch.signbit(r[1])  # -0.25 -> -0.0
    # and through the quantiser: a 6.0 in the block pins the scale to 1
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, value, -value
    d = dequantize_mxfp4(*quantize_mxfp4(w))
    assert d[0, :3].tolist() == [6.0, expected, -expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp4_rounds_to_nearest_one_ulp_beside_every_tie(dtype):
    """One ulp below a midpoint rounds down, one ulp above rounds up, whichever way the tie itself goes."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:])], dtype=dtype)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 10.0))
    assert fp4_round(below).tolist() == grid[:-1] and fp4_round(above).tolist() == grid[1:]
    assert fp4_round(-above).tolist() == [-g for g in grid[1:]]


@pytest.mark.parametrize("value", [6.0, 6.5, 7.0, 100.0, float("inf")])
def test_fp4_saturates_at_6(value):
    assert fp4_round(torch.tensor([value, -value])).tolist() == [6.0, -6.0]
    assert fp4_codes(torch.tensor([value, -value])).tolist() == [7, 15]


def test_fp4_codes_of_grid_values():
    assert fp4_codes(torch.tensor(_LUT)).tolist() == list(range(16))


@settings(max_examples=60, deadline=None)
@given(st.floats(-8.0, 8.0, allow_nan=False, width=32))
def test_fp4_round_is_a_nearest_grid_point(v):
    r = fp4_round(torch.tensor([v]))[0].item()
    grid = [abs(x) for x in _LUT[:8]]
    target = min(abs(v), 6.0)
    assert abs(r) in grid and (r == 0 or (r < 0) == (v < 0))
    assert abs(abs(r) - target) <= min(abs(g - target) for g in grid)


@pytest.mark.parametrize("shape", [(4, 32), (16, 256), (1, 64)])
def test_mxfp4_round_trip_and_scales(shape):
    w = random_weight(shape, seed=shape[1])
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (shape[0], shape[1] // 2) and scale.shape == (shape[0], shape[1] // 32)
    d = dequantize_mxfp4(packed, scale)
    assert torch.equal(d, ref_mxfp4(packed, scale))
    assert dequantize_mxfp4(packed, scale, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), d)  # exact in bf16
    # the scale is the smallest power of two bringing each 32-block within ±6
    sv = e8m0_values(scale)
    amax = w.view(shape[0], -1, 32).abs().amax(-1).double()
    assert (amax / sv <= 6).all() and (amax / (sv / 2) > 6).all()
    # values are representable: a second pass decodes to the same tensor
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d)), d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp4_requantising_a_decoded_tensor_is_bit_identical(seed):
    """For canonical encodings (each 32-block holds a code of magnitude 4 or 6, else the smallest scale would
    be half as large) re-quantising the decoded weight reproduces the stored bytes exactly."""
    g = torch.Generator().manual_seed(seed)
    out, inp = 8, 128
    codes = torch.randint(0, 16, (out, inp), generator=g)
    big = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (out, inp // 32), generator=g)]
    pos = torch.randint(0, 32, (out, inp // 32), generator=g) + 32 * torch.arange(inp // 32)
    codes.scatter_(1, pos, big)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.randint(100, 150, (out, inp // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    d = dequantize_mxfp4(packed, scale)
    assert torch.equal(d, ref_mxfp4(packed, scale))
    p2, s2 = quantize_mxfp4(d)
    assert_same_bits(p2, packed)
    assert_same_bits(s2, scale)


def test_mxfp4_shape_errors():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.randn(4, 48))
    packed, scale = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp4(packed, scale[:, :1])
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp4(packed, scale[:3])
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.randn(64))
