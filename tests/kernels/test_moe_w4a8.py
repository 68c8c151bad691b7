"""The MXFP4 experts on the FP8 tensor cores (``deepinfer.kernels.moe_w4a8``, ``moe_mxfp4(act_quant=True)``)
against ``ReferenceOps.moe_mxfp4(act_quant=True)``: the official FP8 activations (input and hidden rows rounded as
``act_quant_sim(·, 128)``) on the decoded experts.

Without a GPU the kernels run in Triton's interpreter (fp32, the weights decoded in plain Triton); on a CUDA machine
with ``TRITON_INTERPRET`` unset the same tests compile the PTX cast and the FP8 MMA, plus bf16 checks at V4-Flash's
expert shapes, a CUDA-graph replay and no host syncs.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.kernels.moe_mxfp4 as mxmod  # noqa: E402
import deepinfer.kernels.moe_w4a8 as mod  # noqa: E402
from deepinfer.kernels.fp8_quant import act_quant_fp8, nibble_positions  # noqa: E402
from deepinfer.kernels.moe import MoEConfig  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import moe_mxfp4  # noqa: E402
from deepinfer.kernels.moe_w4a8 import moe_w4a8  # noqa: E402
from deepinfer.ops.reference import ReferenceOps  # noqa: E402
from deepinfer.quant.nibble_order import SHIFT_ORDER, fp8_cast_fits, to_shift_order  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
# the interpreter's dots are fp32; the FP8 MMA sums each 128 columns in its own precision, and a hidden value near an
# e4m3 rounding boundary may then round one step the other way
TOL = 1e-2 if DEVICE == "cuda" else 1e-5


def _packed(e, n, k, g, lo, hi):
    """Random MXFP4 experts (every byte, so ±0 too) with exponents in [lo, hi] (within ``fp8_cast_fits`` when
    hi - lo <= 11)."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=DEVICE, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(lo, hi + 1, (e, n, k // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return w, s


def _shifted(mx):
    w1, s1, w2, s2, w3, s3 = mx
    out = []
    for w in (w1, w2, w3):
        w = w.clone()
        to_shift_order(w)
        out.append(w)
    return out[0], s1, out[1], s2, out[2], s3


def _problem(t, e, i, d, k, seed, spread=(115, 126), dtype=torch.float32):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (torch.randn(t, d, generator=g, device=DEVICE) * torch.rand(1, d, generator=g, device=DEVICE) * 4).to(dtype)
    (w1, s1), (w3, s3) = _packed(e, i, d, g, *spread), _packed(e, i, d, g, *spread)
    w2, s2 = _packed(e, d, i, g, spread[0] - 2, spread[1] - 2)
    idx = torch.rand(t, e, generator=g, device=DEVICE).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device=DEVICE) * 1.5
    return x, idx, w, (w1, s1, w2, s2, w3, s3)


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def test_matches_the_reference_fp32():
    """fp32 activations: the kernels' products are exact, so only the fp32 summation order differs from the
    reference (the official FP8 activations on the decoded experts); exponents spread over 11, the cast's limit."""
    x, idx, w, mx = _problem(21, 6, 128, 256, 3, seed=1)
    assert all(fp8_cast_fits(s) for s in mx[1::2])
    sx = _shifted(mx)
    ref = ReferenceOps("cpu").moe_mxfp4(x, idx, w, *mx, 0.7, act_quant=True)
    out = moe_w4a8(x, idx, w, *sx, 0.7)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert _rel(out, ref) < TOL
    plain_ref = ReferenceOps("cpu").moe_mxfp4(x, idx, w, *mx, 0.7)  # W4A16: the FP8 activations do matter
    assert _rel(out, plain_ref) > 1e-3
    assert _rel(moe_w4a8(x, idx, w, *mx, 0.7), ref) > 1e-2  # codes read in the wrong order: other weights


def test_the_cast_at_its_limits():
    """A 32-column block 11 below its 128-column maximum holding ±0.5 (the smallest normal e4m3 after the cast):
    still the reference's numbers. A block further below is refused at load, even one of zero codes."""
    x, idx, w, mx = _problem(9, 4, 128, 128, 2, seed=2, spread=(120, 120))
    w1, s1, w2, s2, w3, s3 = mx
    s1[:, :, 0], s1[:, :, 1] = 131, 120  # block 1 of each 128 columns 11 below block 0's
    w1[:, :, 16:32] = 0x91 - 256  # codes 1 (0.5) and 9 (-0.5)
    s3[:, :, 2] = 0  # zero codes under a tiny exponent
    w3[:, :, 32:48] = 0
    assert fp8_cast_fits(s1) and not fp8_cast_fits(s3)
    s3[:, :, 2] = 109  # 11 below 120
    assert fp8_cast_fits(s3)
    ref = ReferenceOps("cpu").moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True)
    assert _rel(moe_w4a8(x, idx, w, *_shifted(mx), 10.0), ref) < TOL


def test_fp8_cast_fits():
    s = torch.full((2, 3, 8), 120, dtype=torch.uint8)
    assert fp8_cast_fits(s) and fp8_cast_fits(s.view(torch.float8_e8m0fnu))
    s[1, 2, 5] = 131  # 11 above its three neighbours
    assert fp8_cast_fits(s)
    s[1, 2, 5] = 132  # 12
    assert not fp8_cast_fits(s)
    s[1, 2, 5] = 120
    s[0, 0, 4:] = 6  # a block whose maximum is below 7: its scale 2^(r - 133) would not be a normal fp32
    assert not fp8_cast_fits(s)
    assert not fp8_cast_fits(torch.full((2, 3, 6), 120, dtype=torch.uint8))  # K not a multiple of 128
    assert fp8_cast_fits(torch.zeros(0, 4, dtype=torch.uint8))


def test_act_quant_perm_puts_the_columns_in_nibble_order():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g).to(DEVICE)
    q, s = act_quant_fp8(x)
    qp, sp = act_quant_fp8(x, perm=True)
    pos = nibble_positions(256)
    assert torch.equal(sp, s)
    assert torch.equal(qp.view(torch.uint8)[:, pos.to(DEVICE)], q.view(torch.uint8))
    assert [int(pos[c]) for c in SHIFT_ORDER] == list(range(8))  # position j holds column SHIFT_ORDER[j]
    with pytest.raises(ValueError, match="multiple of 8"):
        act_quant_fp8(x, 4, perm=True)


def test_moe_mxfp4_act_quant_picks_the_kernels(monkeypatch):
    """``moe_mxfp4(act_quant=True)``: the W4A8 kernels from ``W4A8_MIN_SLOTS`` slots an expert on for exact-cast
    shift-ordered experts, otherwise the W4A16 kernels on the rounded input and hidden rows; both the reference's."""
    x, idx, w, mx = _problem(12, 4, 128, 256, 2, seed=5)
    sx = _shifted(mx)
    ref = ReferenceOps("cpu").moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True)
    calls = []
    real = mxmod.moe_w4a8
    monkeypatch.setattr(mxmod, "moe_w4a8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(mxmod, "W4A8_MIN_SLOTS", 0)
    monkeypatch.setattr(mxmod, "W4A8", True)
    fast = moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_quant=True, fp8_exact=True)
    assert calls == [1] and _rel(fast, ref) < TOL
    w4a16 = moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_quant=True, fp8_exact=False)
    assert calls == [1] and _rel(w4a16, ref) < 1e-5
    assert _rel(moe_mxfp4(x, idx, w, *mx, 10.0, act_quant=True, fp8_exact=True), ref) < 1e-5  # plain order: W4A16
    monkeypatch.setattr(mxmod, "W4A8_MIN_SLOTS", 1000)
    assert _rel(moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_quant=True, fp8_exact=True), ref) < 1e-5
    assert calls == [1]
    assert _rel(w4a16, ReferenceOps("cpu").moe_mxfp4(x, idx, w, *mx, 10.0)) > 1e-3


def test_bad_shapes_and_tiles_raise():
    x, idx, w, mx = _problem(3, 2, 96, 128, 1, seed=6)  # I = 96: not whole 128-column blocks
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_w4a8(x, idx, w, *_shifted(mx), 10.0)
    x, idx, w, mx = _problem(3, 2, 128, 128, 1, seed=6)
    with pytest.raises(ValueError, match="block_k must be 128"):
        moe_w4a8(x, idx, w, *_shifted(mx), 10.0, config=MoEConfig(16, 64, 64, 4, 1))
    with pytest.raises(ValueError, match="block_n divide"):
        moe_w4a8(x, idx, w, *_shifted(mx), 10.0, config=MoEConfig(16, 96, 128, 4, 1))


V4 = dict(e=256, i=2048, d=4096, k=6)


@pytest.fixture(scope="module")
def v4_experts():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    mx = (*_packed(V4["e"], V4["i"], V4["d"], g, 116, 124), *_packed(V4["e"], V4["d"], V4["i"], g, 114, 122))
    mx = mx + _packed(V4["e"], V4["i"], V4["d"], g, 116, 124)
    return mx, _shifted(mx)


def _routing(t, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, V4["d"], generator=g, device=DEVICE).bfloat16()
    idx = torch.rand(t, V4["e"], generator=g, device=DEVICE).argsort(dim=1)[:, : V4["k"]]
    return x, idx, torch.rand(t, V4["k"], generator=g, device=DEVICE) * 1.5


@gpu_only
@pytest.mark.parametrize("t", [64, 1000, 4096])
def test_gpu_bf16_real_shapes(v4_experts, t):
    """bf16 at V4-Flash's widths, every tile config and both operand orders, against the reference (decoded experts
    in fp32 with the official FP8 activations) and the W4A16 kernels with ``act_quant``: the FP8 MMA sums 128
    columns in its own precision, and a hidden row's rounding to e4m3 may move by one step where the sums differ."""
    mx, sx = v4_experts
    x, idx, w = _routing(t, t)
    sub = slice(0, 16)
    ref = ReferenceOps().moe_mxfp4(x[sub].float(), idx[sub], w[sub], *mx, 10.0, act_quant=True)
    w4a16 = moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_quant=True)
    for cfg, dn in ((None, None), (mod.W8_MID, 64), (mod.W8_PREFILL, 128), (MoEConfig(32, 128, 128, 4, 3), 32)):
        for swap in (None, False, True):
            mod.SWAP_AB = swap
            try:
                out = moe_w4a8(x, idx, w, *sx, 10.0, config=cfg, down_block_n=dn)
            finally:
                mod.SWAP_AB = None
            assert _rel(out, w4a16) < 2e-2, (cfg, swap)
            assert _rel(out[sub], ref) < 2e-2, (cfg, swap)


@gpu_only
def test_gpu_graph_replay_and_no_host_sync(v4_experts):
    _, sx = v4_experts
    x, idx, w = _routing(512, 7)
    eager = moe_w4a8(x, idx, w, *sx, 10.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_w4a8(x, idx, w, *sx, 10.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_w4a8(x, idx, w, *sx, 10.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_w4a8(x, idx, w, *sx, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
