"""``kernels.moe_w4a8``: the MXFP4 gate/up GEMM on FP8 tensor cores for FP8-rounded activations, against the W4A16
kernels and the reference on the decoded experts (Triton's interpreter on CPU; bf16 at V4-Flash's shapes on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.kernels.moe import MoEConfig  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import moe_mxfp4  # noqa: E402
from deepinfer.kernels.moe_w4a8 import w4a8_ready  # noqa: E402
from deepinfer.ops.reference import ReferenceOps  # noqa: E402
from deepinfer.quant.native import dequantize_experts  # noqa: E402
from deepinfer.quant.nibble_order import to_shift_order  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
REF = ReferenceOps("cpu")


def _packed(e, n, k, g, lo, hi):
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=DEVICE, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(lo, hi + 1, (e, n, k // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return w, s


def _problem(t, e, i, d, k, seed, lo, hi, dtype=torch.float32):
    """FP8-rounded activations (``act_quant_sim(·, 128)``, as ``quant_sim`` hands them to the experts) and experts
    whose exponents lie in [lo, hi]."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = REF.act_quant_sim((torch.randn(t, d, generator=g, device=DEVICE) * 3).to(dtype), 128)
    (w1, s1), (w3, s3) = _packed(e, i, d, g, lo, hi), _packed(e, i, d, g, lo, hi)
    w2, s2 = _packed(e, d, i, g, 118, 122)
    idx = torch.rand(t, e, generator=g, device=DEVICE).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device=DEVICE) * 1.5
    return x, idx, w, (w1, s1, w2, s2, w3, s3)


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _shifted(mx):
    w1, s1, w2, s2, w3, s3 = (t.clone() for t in mx)
    for w in (w1, w2, w3):
        to_shift_order(w)
    return w1, s1, w2, s2, w3, s3


@pytest.fixture
def w4a8(monkeypatch):
    monkeypatch.setattr(mod, "W4A8", True)


def test_ready_checks_the_exponents():
    """Exact casts need every exponent ≥ 7 and at most 11 between a row's 4 exponents of 128 columns."""
    s = torch.full((2, 3, 8), 120, dtype=torch.uint8)
    assert w4a8_ready(s)
    s[1, 2, 4] = 109  # 11 below the others of its group: still exact
    assert w4a8_ready(s)
    s[1, 2, 5] = 121  # 12 apart
    assert not w4a8_ready(s)
    s[1, 2, 5] = 120
    assert w4a8_ready(s)  # re-read: the tensor's version moved
    s[0, 0, 0] = 6  # the block scale 2^(smax - 133) would leave the normal fp32 range
    assert not w4a8_ready(s)
    assert not w4a8_ready(torch.full((2, 3, 6), 120, dtype=torch.uint8))  # K not a multiple of 128


@pytest.mark.parametrize(("order", "cfg"), [("plain", None), ("shift", None), ("plain", MoEConfig(64, 32, 128, 4, 1))])
def test_matches_the_w4a16_kernels_fp32(w4a8, order, cfg, monkeypatch):
    """fp32, exponents spread by up to 11 within a row's 128 columns: the FP8 path gives the W4A16 kernels' results
    up to the fp32 summation order (every product is exact on both), weights on either side of the MMA."""
    if DEVICE == "cuda":
        pytest.skip("fp32 activations: the interpreter's exact FP8 products (the GPU test is bf16)")
    x, idx, w, mx = _problem(24, 8, 64, 256, 3, seed=5, lo=110, hi=121)
    assert w4a8_ready(mx[1]) and w4a8_ready(mx[5])
    ws = _shifted(mx) if order == "shift" else mx
    ref = moe_mxfp4(x, idx, w, *ws, 0.9, config=cfg, order=order)
    calls = []
    monkeypatch.setattr(mod, "gate_up_w4a8", lambda *a, f=mod.gate_up_w4a8: calls.append(1) or f(*a))
    out = moe_mxfp4(x, idx, w, *ws, 0.9, config=cfg, order=order, act_fp8=True)
    assert calls == [1]  # the FP8 path ran
    assert _rel(out, ref) < 1e-6
    deq = [dequantize_experts(mx[j], mx[j + 1], torch.float32) for j in (0, 2, 4)]
    assert _rel(out, REF.moe(x, idx, w, *deq, 0.9)) < 1e-5


def test_falls_back_when_the_cast_is_not_exact(w4a8, monkeypatch):
    """A 12-step spread: ``act_fp8`` calls take the W4A16 kernels (bit for bit the same as without the flag)."""
    x, idx, w, mx = _problem(8, 4, 64, 128, 2, seed=6, lo=109, hi=121)
    s1 = mx[1].clone()
    s1[0, 0, :4] = torch.tensor([109, 121, 121, 121], dtype=torch.uint8)
    mx = (mx[0], s1, *mx[2:])
    assert not w4a8_ready(s1)
    calls = []
    monkeypatch.setattr(mod, "gate_up_w4a8", lambda *a, **k: calls.append(1))
    assert torch.equal(moe_mxfp4(x, idx, w, *mx, 0.9, act_fp8=True), moe_mxfp4(x, idx, w, *mx, 0.9))
    assert not calls


@gpu_only
@pytest.mark.parametrize("t", [64, 700, 3000])
def test_gpu_bf16_v4_shapes(w4a8, t):
    """bf16 at V4-Flash's widths (32 experts): against the W4A16 kernels within the FP8 MMA's accumulation (each
    128-column partial promoted to fp32), both nibble orders and both casts (PTX and plain Triton, bit for bit), the
    tiles of every size class; a CUDA graph replay equals the eager call."""
    x, idx, w, mx = _problem(t, 32, 2048, 4096, 6, seed=t, lo=116, hi=124, dtype=torch.bfloat16)
    ref = moe_mxfp4(x, idx, w, *mx, 10.0)
    out = moe_mxfp4(x, idx, w, *mx, 10.0, act_fp8=True)
    assert _rel(out, ref) < 5e-3
    sx = _shifted(mx)
    assert torch.equal(moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_fp8=True), out)
    import deepinfer.kernels.moe_w4a8 as w4

    w4.CAST_PTX = False  # the plain Triton cast gives the PTX cast's bytes: the same results, bit for bit
    try:
        assert torch.equal(moe_mxfp4(x, idx, w, *mx, 10.0, act_fp8=True), out)
        assert torch.equal(moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_fp8=True), out)
    finally:
        w4.CAST_PTX = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_mxfp4(x, idx, w, *sx, 10.0, order="shift", act_fp8=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
