"""MXFP4 routed-expert MoE (deepinfer.kernels.moe_mxfp4) against ``ReferenceOps.moe`` and ``moe_triton`` run on the
decoded experts.

Without a GPU the kernels run in Triton's interpreter (fp32 activations, tiny shapes); on a CUDA machine with
``TRITON_INTERPRET`` unset the same tests compile and run for real, plus bf16 checks at V4-Flash's expert shapes (the
split-K kernels of ``kernels.moe_mxfp4_split`` too), a bit-identical eager vs CUDA-graph replay, no host syncs, and
``quantize_experts`` on a full-size CUDA tensor.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels.moe import MoEConfig, moe_triton  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import (  # noqa: E402
    MX_DECODE,
    MX_MID,
    MX_PREFILL,
    moe_mxfp4,
    pick_config_mxfp4,
    splits_mxfp4,
)
from deepinfer.kernels.moe_mxfp4_split import pick_split, scale_align, split_steps  # noqa: E402
from deepinfer.quant.formats import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from deepinfer.quant.native import dequantize_experts, quantize_experts  # noqa: E402
from deepinfer.quant.nibble_order import plain, shift_order_fits, to_order, to_shift_order  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def _packed(e, n, k, g, exp_lo=120, exp_hi=124):
    """Random MXFP4 experts: every byte (so every pair of e2m1 codes, ±0 too) and exponents in [exp_lo, exp_hi]."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=DEVICE, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(exp_lo, exp_hi + 1, (e, n, k // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return w, s


def _problem(t, e, i, d, k, seed, dtype=torch.float32, hashed=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, d, generator=g, device=DEVICE).to(dtype)
    (w1, s1), (w3, s3) = _packed(e, i, d, g, 122, 126), _packed(e, i, d, g, 122, 126)
    w2, s2 = _packed(e, d, i, g, 118, 122)
    pool = min(e, k + 1) if hashed else e  # hashed: few experts, heavily shared (a hash table's repeats)
    idx = torch.rand(t, pool, generator=g, device=DEVICE).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device=DEVICE) * 1.5
    return x, idx, w, (w1, s1, w2, s2, w3, s3)


def _decoded(mx, dtype):
    w1, s1, w2, s2, w3, s3 = mx
    return dequantize_experts(w1, s1, dtype), dequantize_experts(w2, s2, dtype), dequantize_experts(w3, s3, dtype)


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(("t", "i", "hashed"), [(1, 64, False), (7, 96, False), (40, 64, True)])
def test_matches_reference_fp32(t, i, hashed):
    x, idx, w, mx = _problem(t, 8, i, 64, 3, seed=t, hashed=hashed)
    w1, w2, w3 = _decoded(mx, torch.float32)
    out = moe_mxfp4(x, idx, w, *mx, 0.7)  # a tight limit: the clamps bite
    ref = ReferenceOps("cpu").moe(x, idx, w, w1, w2, w3, 0.7)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert _rel(out, ref) < 1e-5
    assert _rel(out, moe_triton(x, idx, w, w1, w2, w3, 0.7)) < 1e-5


@pytest.mark.parametrize(("t", "split"), [(5, None), (30, 2)])
def test_act_quant_rounds_the_input_and_hidden_rows(t, split, monkeypatch):
    """``act_quant``: the official FP8 activations, the input and each slot's hidden row rounded as
    ``act_quant_sim(·, 128)`` before their GEMMs, as ``ReferenceOps.moe_mxfp4(act_quant=True)`` does on the decoded
    experts (unsplit and split-K); both roundings matter; a hidden width that is not whole 128-column blocks is left
    unrounded, as the reference leaves it."""
    monkeypatch.setattr(mod, "SPLIT_K", split)
    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, 256, generator=g, device=DEVICE) * torch.rand(1, 256, generator=g, device=DEVICE) * 4
    _, idx, w, mx = _problem(t, 6, 128, 256, 2, seed=t)
    ref_ops = ReferenceOps("cpu")
    ref = ref_ops.moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True)
    out = moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True)
    assert _rel(out, ref) < 1e-5
    for order in ("shift", "rotate"):
        assert torch.equal(moe_mxfp4(x, idx, w, *_shifted(mx, order), 10.0, order=order, act_quant=True), out)
    w1, w2, w3 = _decoded(mx, torch.float32)
    xq = ref_ops.act_quant_sim(x, 128)
    assert _rel(out, ref_ops.moe(x, idx, w, w1, w2, w3, 10.0)) > 1e-3  # unrounded
    assert _rel(out, ref_ops.moe(xq, idx, w, w1, w2, w3, 10.0)) > 1e-3  # the input alone rounded
    x2, idx2, w2_, mx2 = _problem(t, 6, 96, 256, 2, seed=t)  # I = 96: the hidden rows stay as they are
    xq2 = ref_ops.act_quant_sim(x2, 128)
    ref2 = ref_ops.moe(xq2, idx2, w2_, *_decoded(mx2, torch.float32), 10.0)
    assert _rel(moe_mxfp4(x2, idx2, w2_, *mx2, 10.0, act_quant=True), ref2) < 1e-5
    assert _rel(ref_ops.moe_mxfp4(x2, idx2, w2_, *mx2, 10.0, act_quant=True), ref2) < 1e-6


def _shifted(mx, order="shift"):
    """The same experts with every weight's codes in ``order`` (copies)."""
    w1, s1, w2, s2, w3, s3 = mx
    out = []
    for w in (w1, w2, w3):
        w = w.clone()
        to_order(w, order)
        out.append(w)
    return out[0], s1, out[1], s2, out[2], s3


def test_shift_order_decodes_to_the_same_weights():
    """The decode the PTX does on a shift-ordered word, in torch: ``(q << 4b) & 0x80008000`` (signs) or
    ``(q >> (6 - 4b)) & 0x01C001C0`` (exponent, mantissa) read as two bf16, times the bf16 ``2^(s - 1)``, give codes
    ``2b`` and ``2b + 1`` of the word exactly as ``quant.formats`` decodes them; ``plain`` undoes the order."""
    g = torch.Generator().manual_seed(9)
    w = torch.randint(0, 256, (6, 64), generator=g, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(0, 129, (6, 4), generator=g, dtype=torch.uint8)
    s[0, 0], s[0, 1] = 0, 128  # the ends of the range
    ref = dequantize_mxfp4(w, s.view(torch.float8_e8m0fnu), torch.float32)
    sw = w.clone()
    to_shift_order(sw)
    assert not torch.equal(sw, w) and torch.equal(plain(sw), w)
    q = sw.view(torch.int32).long() & 0xFFFFFFFF  # [6, 16] words
    pairs = []
    for b in range(4):
        mag = (q >> (6 - 4 * b)) if b < 2 else (q << (4 * b - 6))
        bits = (mag & 0x01C001C0) | ((q << (4 * b)) & 0x80008000)
        pairs.append(torch.stack([bits & 0xFFFF, bits >> 16], -1))  # codes 2b (low half), 2b + 1
    raw = torch.stack(pairs, -2).reshape(6, 128).to(torch.int16).view(torch.bfloat16)  # value · 2^-126
    scale = ((s.long() + 126) << 7).to(torch.int16).view(torch.bfloat16).repeat_interleave(32, dim=1)  # 2^(s - 1)
    assert torch.equal((raw * scale).float(), ref)


def test_rotate_order_decodes_to_the_same_weights():
    """The decode the PTX does on a rotate-ordered word, in torch: the word rotated left by 0, 4 and 10 bits and
    masked with ``0x81C081C0`` (registers 0-2), its mantissas rotated by 6 or-ed with the rest rotated by 14
    (register 3), read as two bf16, times the bf16 ``2^(s - 1)``, give codes ``2b`` and ``2b + 1`` of the word exactly
    as ``quant.formats`` decodes them; ``plain`` undoes the order."""
    g = torch.Generator().manual_seed(10)
    w = torch.randint(0, 256, (6, 64), generator=g, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(0, 129, (6, 4), generator=g, dtype=torch.uint8)
    s[0, 0], s[0, 1] = 0, 128  # the ends of the range
    ref = dequantize_mxfp4(w, s.view(torch.float8_e8m0fnu), torch.float32)
    rw = w.clone()
    to_order(rw, "rotate")
    assert not torch.equal(rw, w) and torch.equal(plain(rw, "rotate"), w)
    q = rw.view(torch.int32).long() & 0xFFFFFFFF  # [6, 16] words

    def rot(n):
        return ((q << n) | (q >> (32 - n))) & 0xFFFFFFFF

    regs = [q & 0x81C081C0, rot(4) & 0x81C081C0, rot(10) & 0x81C081C0, (rot(6) & 0x00400040) | (rot(14) & 0x81808180)]
    pairs = [torch.stack([bits & 0xFFFF, bits >> 16], -1) for bits in regs]  # codes 2b (low half), 2b + 1
    raw = torch.stack(pairs, -2).reshape(6, 128).to(torch.int16).view(torch.bfloat16)  # value · 2^-126
    scale = ((s.long() + 126) << 7).to(torch.int16).view(torch.bfloat16).repeat_interleave(32, dim=1)  # 2^(s - 1)
    assert torch.equal((raw * scale).float(), ref)


@pytest.mark.parametrize("order", ["shift", "rotate"])
def test_orders_in_the_kernels_and_the_reference(order):
    """The kernels read shift- or rotate-ordered codes to the same results, bit for bit (the same decoded tiles); so
    does ``ReferenceOps.moe_mxfp4``. An unknown order is refused."""
    x, idx, w, mx = _problem(9, 8, 64, 64, 3, seed=4)
    sx = _shifted(mx, order)
    out = moe_mxfp4(x, idx, w, *mx, 0.7)
    assert torch.equal(moe_mxfp4(x, idx, w, *sx, 0.7, order=order), out)
    assert not torch.equal(moe_mxfp4(x, idx, w, *sx, 0.7), out)  # read as plain: other weights
    ref = ReferenceOps("cpu")
    assert torch.equal(ref.moe_mxfp4(x, idx, w, *sx, 0.7, order=order), ref.moe_mxfp4(x, idx, w, *mx, 0.7))
    for fn in (moe_mxfp4, ref.moe_mxfp4):
        with pytest.raises(ValueError, match="order"):
            fn(x, idx, w, *mx, 0.7, order="shuffled")


def test_shift_order_fits_only_exact_scales_and_whole_words():
    w = torch.zeros(2, 4, 16, dtype=torch.int8, device=DEVICE)
    s = torch.full((2, 4, 1), 128, dtype=torch.uint8, device=DEVICE)
    assert shift_order_fits(w, s) and shift_order_fits(w, s.view(torch.float8_e8m0fnu))
    assert not shift_order_fits(w, s + 1)  # 2^128: no bf16 scale 2^(s - 1)
    assert shift_order_fits(w, s * 0)  # 2^-127: the scale 2^-1
    assert not shift_order_fits(w[..., :6], s)  # rows not whole words
    with pytest.raises(ValueError, match="whole words"):
        to_shift_order(w[..., :6])


def test_config_bounds():
    """Every table config is a tl.dot tile; a CUDA-core tile (fewer than 16 rows) is refused, not run."""
    x, idx, w, mx = _problem(5, 4, 64, 64, 2, seed=11, hashed=True)
    with pytest.raises(ValueError, match="block_m"):
        moe_mxfp4(x, idx, w, *mx, 0.7, config=MoEConfig(8, 16, 64, 4, 1))


def test_quantized_weights_and_dtypes_of_the_inputs():
    """Experts from ``quantize_experts``; uint8 bytes and float8_e8m0fnu scales read the same as int8 and uint8."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    e, i, d, t, k = 4, 64, 64, 5, 2
    ws = [torch.randn(e, *shape, generator=g, device=DEVICE) * 0.05 for shape in ((i, d), (d, i), (i, d))]
    (w1, s1), (w2, s2), (w3, s3) = (quantize_experts(w) for w in ws)
    x = torch.randn(t, d, generator=g, device=DEVICE)
    idx = torch.rand(t, e, generator=g, device=DEVICE).argsort(dim=1)[:, :k]
    rw = torch.rand(t, k, generator=g, device=DEVICE)
    out = moe_mxfp4(x, idx, rw, w1, s1, w2, s2, w3, s3, 5.0)
    ref = ReferenceOps("cpu").moe(x, idx, rw, *_decoded((w1, s1, w2, s2, w3, s3), torch.float32), 5.0)
    assert _rel(out, ref) < 1e-5
    e8 = torch.float8_e8m0fnu
    alt = moe_mxfp4(x, idx, rw, w1.view(torch.uint8), s1.view(e8), w2.view(torch.uint8), s2, w3, s3.view(e8), 5.0)
    assert torch.equal(alt, out)


def test_split_k_matches_unsplit_and_reference_fp32(monkeypatch):
    """Forced split-K (``SPLIT_K``) against the unsplit kernels and the reference. ``block_k = 64``, split 2: K = D =
    160 is 3 steps (the last half a tile) cut into pieces of 2 and 1 steps, K = I = 96 two steps (the last half a tile)
    into 1 and 1; ``block_k = 32``, split 3: D is 5 steps, pieces of 2, 2 and 1, I 3 steps, 1 each. ``SPLIT_K = 1``
    runs the unsplit kernels alone (the split launchers are never called)."""
    x, idx, w, mx = _problem(2, 2, 96, 160, 2, seed=21)  # both experts in every token: k = 2 slots to sum
    ref = ReferenceOps("cpu").moe(x, idx, w, *_decoded(mx, torch.float32), 0.7)
    wide, narrow = MoEConfig(16, 64, 64, 4, 1), MoEConfig(16, 64, 32, 4, 1)  # 64-row tiles: fewer programs to interpret
    calls = []

    def spy(name):  # noqa: ANN001, ANN202
        real = getattr(mod, name)
        return lambda *a, **kw: (calls.append(name), real(*a, **kw))[1]

    monkeypatch.setattr(mod, "gate_up_split", spy("gate_up_split"))
    monkeypatch.setattr(mod, "down_split", spy("down_split"))
    with monkeypatch.context() as m:
        m.setattr(mod, "SPLIT_K", 1)
        base = moe_mxfp4(x, idx, w, *mx, 0.7, config=wide)
    assert calls == []  # SPLIT_K = 1: the unsplit kernels alone
    assert _rel(base, ref) < 1e-5
    for split, cfg, pieces in ((2, wide, ((2, 2), (2, 1))), (3, narrow, ((3, 2), (3, 1)))):
        monkeypatch.setattr(mod, "SPLIT_K", split)
        assert splits_mxfp4(4, 2, 96, 160, cfg) == pieces  # (pieces, steps a piece) of gate/up and of down
        out = moe_mxfp4(x, idx, w, *mx, 0.7, config=cfg)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert _rel(out, base) < 1e-6 and _rel(out, ref) < 1e-5  # only the fp32 summation order differs
    assert calls == ["gate_up_split", "down_split"] * 2


def test_scale_align_and_the_mid_tiles():
    """The power of two the scale row stride is passed divided by (16 at most), and the config by slots per
    expert: 16-row tiles up to 8, 32-row tiles up to 32, 64-row tiles up to 64, 128-row tiles above."""
    for k, want in ((4096, 16), (2304, 8), (2048, 16), (96, 1), (64, 2), (160 * 32, 16)):
        assert scale_align(torch.zeros(2, 3, k // 32, dtype=torch.uint8)) == want
    assert scale_align(torch.zeros(2, 3, 80, dtype=torch.uint8)[:, :, :72]) == 16  # the stride, not the width
    e = 256
    got = [pick_config_mxfp4(6 * t, e) for t in (341, 342, 1365, 1366, 2730, 2731)]
    assert got == [MX_DECODE, MX_MID, MX_MID, mod.MX_MID64, mod.MX_MID64, MX_PREFILL]


def test_split_k_picking_on_the_host(monkeypatch):
    """``pick_split`` (sizes only, no kernel): at V4-Flash's shapes one token (6 slot blocks × 32 gate/up tiles, × 64
    down tiles) splits gate/up in 4 and down in 2 (≈ 6 programs an SM of 132); 2 tokens split gate/up only; from 16
    tokens on the grid is large enough. A piece keeps ``MIN_STEPS`` steps of ``block_k``. ``SPLIT_K``: None takes the
    rule on a GPU (``auto``), 1 in the interpreter; n forces at most n pieces (no empty one)."""
    e, inter, hidden = 256, 2048, 4096
    assert pick_split(6, e, inter, hidden, MX_DECODE) == 4 and pick_split(6, e, hidden, inter, MX_DECODE) == 2
    assert pick_split(12, e, inter, hidden, MX_DECODE) == 2 and pick_split(12, e, hidden, inter, MX_DECODE) == 1
    for t in (16, 64, 256, 4096):
        cfg = pick_config_mxfp4(6 * t, e)
        assert pick_split(6 * t, e, inter, hidden, cfg) == 1 == pick_split(6 * t, e, hidden, inter, cfg)
    assert pick_split(6, e, inter, 7 * 128, MX_DECODE) == 1  # 7 steps: two pieces would keep fewer than 4 steps
    assert pick_split(6, e, inter, 8 * 128, MX_DECODE) == 2
    assert split_steps(4096, 128, 3) == (3, 11) and split_steps(2048, 128, 3) == (3, 6)  # 11, 11, 10 and 6, 6, 4
    assert split_steps(160, 32, 8) == (5, 1) and split_steps(160, 32, 1) == (1, 5)
    assert splits_mxfp4(6, e, inter, hidden, MX_DECODE) == ((4, 8), (2, 8))
    assert splits_mxfp4(6, e, inter, hidden, MX_DECODE, auto=False) == ((1, 32), (1, 16))
    monkeypatch.setattr(mod, "SPLIT_K", 1)
    assert splits_mxfp4(6, e, inter, hidden, MX_DECODE) == ((1, 32), (1, 16))
    monkeypatch.setattr(mod, "SPLIT_K", 3)
    assert splits_mxfp4(6000, e, inter, hidden, MX_PREFILL, auto=False) == ((3, 11), (3, 6))
    monkeypatch.setattr(mod, "SPLIT_K", 0)
    with pytest.raises(ValueError, match="SPLIT_K"):
        splits_mxfp4(6, e, inter, hidden, MX_DECODE)


def test_empty_batch():
    x, idx, w, mx = _problem(0, 4, 64, 64, 2, seed=0)
    assert moe_mxfp4(x, idx, w, *mx, 1.0).shape == (0, 64)


def test_bad_inputs_raise():
    x, idx, w, (w1, s1, w2, s2, w3, s3) = _problem(3, 4, 64, 64, 2, seed=1)
    bad = [
        (x.double(), idx, w, w1, s1, w2, s2, w3, s3),  # activation dtype
        (x, idx, w, w1, s1.float(), w2, s2, w3, s3),  # scale dtype
        (x, idx, w, w1, s1, w2.transpose(1, 2), s2, w3, s3),  # down weight not [E, D, I/2]
        (x, idx, w, w1.float(), s1, w2, s2, w3, s3),  # weights not bytes
        (x, idx, w, w1, s1, w2, s2[:, :, :1], w3, s3),  # down scales not [E, D, I/32]
        (x, idx[:, :1], w, w1, s1, w2, s2, w3, s3),  # idx / weights mismatch
        (x[:, :48], idx, w, w1, s1, w2, s2, w3, s3),  # D not 2 × w1's last dim
    ]
    for args in bad:
        with pytest.raises(ValueError):
            moe_mxfp4(*args, 1.0)
    with pytest.raises(ValueError):
        quantize_experts(torch.randn(2, 4, 48))
    with pytest.raises(ValueError):
        dequantize_experts(w1, s1[:, :, :1], torch.float32)


def test_quantize_dequantize_match_formats():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 96, generator=g) * torch.logspace(-3, 1, 8).view(1, 8, 1)
    q, s = quantize_experts(w)
    assert q.dtype == torch.int8 and q.shape == (3, 8, 48) and s.dtype == torch.uint8 and s.shape == (3, 8, 3)
    for e in range(3):
        q0, s0 = quantize_mxfp4(w[e])
        assert torch.equal(q[e], q0) and torch.equal(s[e], s0.view(torch.uint8))
    deq = dequantize_experts(q, s, torch.float32)
    for e in range(3):
        assert torch.equal(deq[e], dequantize_mxfp4(q[e], s[e].view(torch.float8_e8m0fnu)))
    assert torch.equal(dequantize_experts(q, s, torch.bfloat16), deq.bfloat16())  # exact in bf16
    assert _rel(deq, w) < 0.2  # e2m1 keeps ~2 significant bits: a coarse round trip
    # decoded values are on the grid: quantising them again keeps them (the codes may move to a smaller scale)
    assert torch.equal(dequantize_experts(*quantize_experts(deq), torch.float32), deq)


# ---- GPU: V4-Flash expert shapes (E=256, D=4096, I=2048, top-6), bf16 -------------------------------------------

V4 = dict(e=256, i=2048, d=4096, k=6)


@pytest.fixture(scope="module")
def v4_experts():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    (w1, s1), (w3, s3) = _packed(V4["e"], V4["i"], V4["d"], g, 118, 122), _packed(V4["e"], V4["i"], V4["d"], g)
    w2, s2 = _packed(V4["e"], V4["d"], V4["i"], g, 116, 120)
    mx = (w1, s1, w2, s2, w3, s3)
    return mx, _decoded(mx, torch.bfloat16)


def _routing(t, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, V4["d"], generator=g, device=DEVICE).bfloat16()
    idx = torch.rand(t, V4["e"], generator=g, device=DEVICE).argsort(dim=1)[:, : V4["k"]]
    return x, idx, torch.rand(t, V4["k"], generator=g, device=DEVICE) * 1.5


@gpu_only
@pytest.mark.parametrize("t", [1, 64, 700])
def test_gpu_bf16_real_shapes(v4_experts, t):
    mx, deq = v4_experts
    x, idx, w = _routing(t, t)
    ref = moe_triton(x, idx, w, *deq, 10.0)
    for cfg in (None, MX_DECODE, MX_MID, mod.MX_MID64, MX_PREFILL):
        out = moe_mxfp4(x, idx, w, *mx, 10.0, config=cfg)
        assert _rel(out, ref) < 5e-3  # only the fp32 accumulation order (and the bf16 roundings it moves) differ
        for order in ("shift", "rotate"):  # their decodes' tiles are the byte-lookup decode's, bit for bit
            assert torch.equal(moe_mxfp4(x, idx, w, *_shifted(mx, order), 10.0, config=cfg, order=order), out)
        mod.TMA_WEIGHTS = False  # the weight tiles through per-thread copies instead of the TMA unit: the same tiles
        try:
            assert torch.equal(moe_mxfp4(x, idx, w, *mx, 10.0, config=cfg), out)
        finally:
            mod.TMA_WEIGHTS = True
    big = ReferenceOps().moe(x[:8].float(), idx[:8], w[:8], *(m.float() for m in deq), 10.0)  # fp32 sanity
    assert _rel(moe_mxfp4(x[:8].float(), idx[:8], w[:8], *mx, 10.0), big) < 1e-5
    act = moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True)  # the official FP8 activations, bf16 kernels
    aref = ReferenceOps().moe_mxfp4(x[:8].float(), idx[:8], w[:8], *mx, 10.0, act_quant=True)
    assert _rel(act, out) > 1e-3 and _rel(act[:8], aref) < 2e-2  # a hidden value may round one e4m3 step apart


@gpu_only
@pytest.mark.parametrize("t", [1, 64, 300])
def test_gpu_v41_widths(t, monkeypatch):
    """V4.1-Flash's expert widths (D = 5120, I = 2304; 16 of its 384 experts): the down projection's scales have
    72-byte rows, which the kernels read through ``scale_align`` (8) in 32-bit loads; against ``moe_triton`` on the
    decoded experts, auto config and split, every order (bit for bit on the Triton tiles; the rotate order's prefill
    tiles in Gluon, which sum in another order, within the same tolerance)."""
    e, i, d, k = 16, 2304, 5120, 6
    g = torch.Generator(device=DEVICE).manual_seed(41)
    (w1, s1), (w3, s3) = _packed(e, i, d, g, 118, 122), _packed(e, i, d, g)
    w2, s2 = _packed(e, d, i, g, 116, 120)
    mx = (w1, s1, w2, s2, w3, s3)
    assert scale_align(s2) == 8 and scale_align(s1) == 16
    gx = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, d, generator=gx, device=DEVICE).bfloat16()
    idx = torch.rand(t, e, generator=gx, device=DEVICE).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=gx, device=DEVICE) * 1.5
    ref = moe_triton(x, idx, w, *_decoded(mx, torch.bfloat16), 10.0)
    assert _rel(moe_mxfp4(x, idx, w, *_shifted(mx, "rotate"), 10.0, order="rotate"), ref) < 5e-3  # Gluon where fit
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    out = moe_mxfp4(x, idx, w, *mx, 10.0)
    assert _rel(out, ref) < 5e-3
    for order in ("shift", "rotate"):
        assert torch.equal(moe_mxfp4(x, idx, w, *_shifted(mx, order), 10.0, order=order), out)


@gpu_only
@pytest.mark.parametrize("t", [1, 16, 64])
def test_gpu_split_k(v4_experts, t, monkeypatch):
    """Split-K at V4-Flash's shapes in bf16 (the PTX decode): the auto rule (T = 1: 4 and 2 pieces) and forced 2, 3
    (pieces of 11, 11, 10 and 6, 6, 4 steps) and 8, on the decode tiles and split 2 on the prefill tiles (weights on
    the MMA's M side), against the unsplit kernels and ``moe_triton`` on the decoded experts; within a split the rotate
    order and the pointer loads (TMA off) give the same results, bit for bit."""
    mx, deq = v4_experts
    sx = _shifted(mx, "rotate")
    x, idx, w = _routing(t, 300 + t)
    ref = moe_triton(x, idx, w, *deq, 10.0)
    monkeypatch.setattr(mod, "SPLIT_K", 1)
    base = moe_mxfp4(x, idx, w, *mx, 10.0)
    for split, cfg in ((None, None), (2, None), (3, None), (8, None), (2, MX_PREFILL)):
        monkeypatch.setattr(mod, "SPLIT_K", split)
        out = moe_mxfp4(x, idx, w, *mx, 10.0, config=cfg)
        assert _rel(out, ref) < 5e-3 and _rel(out, base) < 5e-3  # the fp32 order (and the bf16 roundings it moves)
        assert torch.equal(moe_mxfp4(x, idx, w, *sx, 10.0, config=cfg, order="rotate"), out)
        monkeypatch.setattr(mod, "TMA_WEIGHTS", False)
        assert torch.equal(moe_mxfp4(x, idx, w, *mx, 10.0, config=cfg), out)
        assert torch.equal(moe_mxfp4(x, idx, w, *sx, 10.0, config=cfg, order="rotate"), out)
        monkeypatch.setattr(mod, "TMA_WEIGHTS", True)
    monkeypatch.setattr(mod, "SPLIT_K", 3)
    big = ReferenceOps().moe(x[:8].float(), idx[:8], w[:8], *(m.float() for m in deq), 10.0)  # fp32, split too
    assert _rel(moe_mxfp4(x[:8].float(), idx[:8], w[:8], *mx, 10.0), big) < 1e-5


@gpu_only
@pytest.mark.parametrize(("t", "split"), [(1, None), (37, None), (37, 3)])
def test_gpu_graph_replay_bit_identical(v4_experts, t, split, monkeypatch):
    """Eager vs a replayed CUDA graph, bit for bit, unsplit and split (T = 1: the auto split)."""
    mx, _ = v4_experts
    monkeypatch.setattr(mod, "SPLIT_K", split)
    x, idx, w = _routing(t, 100 + t)
    eager = moe_mxfp4(x, idx, w, *mx, 10.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_mxfp4(x, idx, w, *mx, 10.0)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_mxfp4(x, idx, w, *mx, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x2, idx2, w2 = _routing(t, 200 + t)  # new inputs in the captured buffers: the replay follows them
    x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_mxfp4(x2, idx2, w2, *mx, 10.0))


@gpu_only
@pytest.mark.parametrize(("t", "split"), [(33, None), (1, None), (33, 2)])
def test_gpu_no_host_sync(v4_experts, t, split, monkeypatch):
    mx, _ = v4_experts
    monkeypatch.setattr(mod, "SPLIT_K", split)
    x, idx, w = _routing(t, 3)
    moe_mxfp4(x, idx, w, *mx, 10.0)  # compile / load first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_mxfp4(x, idx, w, *mx, 10.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu_only
def test_gpu_quantize_experts_full_size():
    g = torch.Generator(device=DEVICE).manual_seed(4)
    w = (torch.randn(V4["e"], V4["i"], V4["d"], generator=g, device=DEVICE) * 0.02).bfloat16()
    q, s = quantize_experts(w)
    for e in (0, 255):
        q0, s0 = quantize_mxfp4(w[e].cpu())
        assert torch.equal(q[e].cpu(), q0) and torch.equal(s[e].cpu(), s0.view(torch.uint8))
    deq = dequantize_experts(q, s, torch.bfloat16)
    assert deq.shape == w.shape and _rel(deq[::17], w[::17]) < 0.2
