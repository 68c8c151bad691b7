"""MXFP4 experts with FP8 activations (``DEEPINFER_W4A8``): the exact e4m3 cast of the weights (``quant.w4a8``), the
modules' switch and references, and the W4A8 Gluon prefill kernels (``kernels.moe_w4a8_wgmma``) against the W4A16
kernels on the same rounded activations.

The Gluon kernels do not run in Triton's interpreter: their tests need an sm_90 GPU (a CPU host skips them); the cast,
the references, the dispatch rule and the modules' plumbing are checked everywhere."""

import os

import pytest
import torch

pytest.importorskip("triton")

from test_moe_mxfp4 import _rel  # noqa: E402

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import moe_w4a8_wgmma as w4  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import MX_MID64, MX_PREFILL, moe_mxfp4  # noqa: E402
from deepinfer.quant import w4a8  # noqa: E402
from deepinfer.quant.native import dequantize_experts, order_experts, routed_experts  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = torch.cuda.is_available() and not INTERPRET and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not (HOPPER and w4.HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")


def _experts(e, n, k, g, lo, hi, device="cpu"):
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=device, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(lo, hi + 1, (e, n, k // 32), generator=g, device=device, dtype=torch.uint8)
    return w, s


def test_the_cast_is_exact_against_the_row_references():
    """Every weight divided by its row's scale ``2^(r - 133)`` is a normal (or zero) e4m3 value, ``v · 2^(6 + s - r)``
    with ``s - r`` in [-11, 0]: the premise of the kernels' byte tables."""
    g = torch.Generator().manual_seed(0)
    w, s = _experts(3, 16, 256, g, 110, 121)  # spreads up to 11
    r = w4a8.row_refs(w, s)
    assert r is not None and r.dtype == torch.int32 and r.shape == (3, 16)
    nz = (w.view(torch.uint8).view(3, 16, 8, 16) & 0x77).ne(0).any(-1)
    assert torch.equal(r, torch.where(nz, s.int(), -1).amax(-1))
    q = dequantize_experts(w, s, torch.float32) / torch.exp2(r.double() - 133).float()[:, :, None]
    e4 = q.to(torch.float8_e4m3fn).float()
    assert torch.equal(e4, q)
    nonzero = q[q != 0].abs()
    assert nonzero.min() >= 2.0**-6 and nonzero.max() <= 6 * 2.0**6


def test_references_in_chunks_of_experts(monkeypatch):
    """The references are read a few experts at a time: the same as in one piece, and a refusal in a later chunk
    still refuses."""
    g = torch.Generator().manual_seed(3)
    w, s = _experts(5, 8, 128, g, 116, 124)
    whole = w4a8.row_refs(w, s)
    monkeypatch.setattr(w4a8, "_CHUNK_BYTES", 8 * 64 * 2)  # two experts a chunk
    assert torch.equal(w4a8.row_refs(w, s), whole)
    w.view(torch.uint8)[4] |= 0x11
    s[4, 0, 0] = 100
    assert w4a8.row_refs(w, s) is None


def test_references_refuse_what_would_round():
    g = torch.Generator().manual_seed(1)
    w, s = _experts(2, 8, 128, g, 120, 120)
    w.view(torch.uint8)[:] |= 0x11  # every block non-zero
    assert w4a8.row_refs(w, s) is not None
    s[1, 3, 2] = 120 - 12  # a block 12 below its row's largest: 0.5 · 2^-6 would be an e4m3 subnormal
    assert w4a8.row_refs(w, s) is None
    w.view(torch.uint8)[1, 3, 32:48] &= 0x88  # ... unless all its codes are ±0
    assert w4a8.row_refs(w, s) is not None
    s[0] = 6  # a reference below 7: the row scale 2^(r - 133) would not be a normal fp32
    assert w4a8.row_refs(w, s) is None
    w.view(torch.uint8)[0] = 0x80  # rows of ±0 alone: reference 127, nothing to refuse
    r = w4a8.row_refs(w, s)
    assert r is not None and (r[0] == 127).all()
    with pytest.raises(ValueError, match="blocks"):
        w4a8.row_refs(w[..., :8], s)


class _Experts(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        for name, (n, k) in (("w1", (64, 128)), ("w2", (128, 64)), ("w3", (64, 128))):
            w, s = _experts(4, n, k, g, 119, 122)
            setattr(self, name, torch.nn.Parameter(w, requires_grad=False))
            self.register_buffer(f"{name}_scale", s)


def test_modules_get_references_and_keep_their_codes():
    """``set_w4a8`` marks the expert modules; ``prepare_w4a8`` gives the marked ones references, and the rotate order
    then leaves their codes as stored; ``routed_experts`` rounds their activations (the reference op set's
    ``act_quant``, the semantics every backend follows)."""
    g = torch.Generator().manual_seed(2)
    net = torch.nn.ModuleDict({"a": _Experts(g), "b": _Experts(g)})
    assert not w4a8.uses_w4a8(net)
    w4a8.set_w4a8(net["a"], True)
    assert w4a8.uses_w4a8(net) and w4a8.prepare_w4a8(net) == 1
    assert w4a8.prepare_w4a8(net) == 0  # already prepared, or unmarked
    assert w4a8.refs_of(net["a"]) is not None and w4a8.refs_of(net["b"]) is None
    before = net["a"].w1.detach().clone()
    assert order_experts(net, "rotate") == 1  # only b, which has no references
    assert torch.equal(net["a"].w1, before)
    ops = ReferenceOps("cpu")
    x = torch.randn(5, 128, generator=g)
    idx = torch.rand(5, 4, generator=g).argsort(dim=1)[:, :2]
    wt = torch.rand(5, 2, generator=g)
    m = net["a"]
    got = routed_experts(m, x, idx, wt, 10.0, ops)
    mx = (m.w1, m.w1_scale, m.w2, m.w2_scale, m.w3, m.w3_scale)
    assert torch.equal(got, ops.moe_mxfp4(x, idx, wt, *mx, 10.0, act_quant=True))
    assert not torch.equal(got, ops.moe_mxfp4(x, idx, wt, *mx, 10.0))


def test_dispatch_rule_on_the_host(monkeypatch):
    """Only the prefill tiles of plain-ordered bf16 experts on sm_90, in whole tiles, outside the interpreter."""
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not w4.usable(x, 2048, 4096) and not w4.runs_on(x.device)  # a CPU tensor
    assert w4.fits(2048, 4096, True) and w4.fits(4096, 2048, False) and w4.fits(64, 2304, True)
    assert not w4.fits(96, 4096, True) and not w4.fits(64, 4096, False) and not w4.fits(2048, 4160, True)
    assert not w4.fits(64, 128, True) and w4.fits(64, 256, True)
    monkeypatch.setattr(w4, "available", lambda x: True)
    monkeypatch.setattr(mod, "WGMMA_PREFILL", None)
    monkeypatch.setattr(mod.moe_mxfp4_wgmma, "PREFILL", "gluon")  # DEEPINFER_MOE_PREFILL's default
    assert mod._w4a8(MX_PREFILL, x, "plain", 2048, 4096, interpret=False)
    assert not mod._w4a8(MX_PREFILL, x, "rotate", 2048, 4096, interpret=False)
    assert not mod._w4a8(MX_MID64, x, "plain", 2048, 4096, interpret=False)
    assert not mod._w4a8(MX_PREFILL, x, "plain", 2048, 4096, interpret=True)
    s = torch.zeros(64, dtype=torch.uint8)
    assert mod._w4a8(MX_PREFILL, x, "plain", 2048, 4096, False, s[:32], s[4:36])
    assert not mod._w4a8(MX_PREFILL, x, "plain", 2048, 4096, False, s[:32], s[1:33])  # a view off a word boundary
    monkeypatch.setattr(mod.moe_mxfp4_wgmma, "PREFILL", "triton")
    assert not mod._w4a8(MX_PREFILL, x, "plain", 2048, 4096, interpret=False)


def _gpu_problem(t, e, i, d, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    (w1, s1), (w3, s3) = _experts(e, i, d, g, 118, 125, "cuda"), _experts(e, i, d, g, 118, 125, "cuda")
    w2, s2 = _experts(e, d, i, g, 114, 121, "cuda")
    x = (torch.randn(t, d, generator=g, device="cuda") * 3).bfloat16()
    x[0, :128] *= 1000  # a block far above the others: the per-128 scales matter
    idx = torch.rand(t, e, generator=g, device="cuda").argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device="cuda")
    mx = (w1, s1, w2, s2, w3, s3)
    refs = tuple(w4a8.row_refs(w_, s_) for w_, s_ in ((w1, s1), (w2, s2), (w3, s3)))
    assert all(r is not None for r in refs)
    return x, idx, w, mx, refs


@hopper_only
@pytest.mark.parametrize(
    ("t", "e", "i", "d", "k"), [(300, 8, 256, 256, 2), (1100, 16, 256, 512, 6), (600, 4, 384, 2304, 3)]
)
def test_gpu_w4a8_matches_w4a16_on_rounded_activations(t, e, i, d, k, monkeypatch):
    """The W4A8 kernels against the W4A16 Triton tiles of the same call (activations rounded the same way): the same
    products, so only the order and the FP8 MMA's precision of the sums differ (then the bf16 roundings)."""
    x, idx, w, mx, refs = _gpu_problem(t, e, i, d, k, seed=t)
    monkeypatch.setattr(mod, "WGMMA_FAILED", None)
    monkeypatch.setattr(mod, "WGMMA_PREFILL", True)
    calls = []
    real = mod._moe_w4a8
    monkeypatch.setattr(mod, "_moe_w4a8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = moe_mxfp4(x, idx, w, *mx, 7.0, act_quant=True, refs=refs)
    assert calls and mod.WGMMA_FAILED is None  # it ran the W4A8 kernels
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    want = moe_mxfp4(x, idx, w, *mx, 7.0, act_quant=True)
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 5e-3
    plain = moe_mxfp4(x, idx, w, *mx, 7.0)  # without the rounded activations: further away
    assert _rel(plain, want) > 2 * _rel(got, want)


@hopper_only
def test_gpu_w4a8_rounds_like_act_quant_fp8():
    """The kernels read ``act_quant_fp8``'s values and scales: on activations that are e4m3 values times powers of
    two already (so the rounding is exact) the result does not depend on the rounding step."""
    x, idx, w, mx, refs = _gpu_problem(256, 8, 256, 256, 2, seed=5)
    xr = ReferenceOps("cuda").act_quant_sim(x, 128)
    a = moe_mxfp4(x, idx, w, *mx, 7.0, act_quant=True, refs=refs)
    b = moe_mxfp4(xr, idx, w, *mx, 7.0, act_quant=True, refs=refs)
    assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_gpu_prepared_experts_go_back_to_the_stored_format_and_again():
    """What ``NvidiaOps.prepare_weights`` derives for the experts on a GPU (W4A8 references where the W4A8 kernels
    run, else the rotate order) is undone by ``stored_experts`` (EPLB moves rows of the stored format: the codes as
    stored, bit for bit) and derived again alike; the experts compute the same before and after."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.quant.native import stored_experts

    g = torch.Generator().manual_seed(4)
    net = torch.nn.ModuleDict({"a": _Experts(g), "b": _Experts(g)}).cuda()
    w4a8.set_w4a8(net["a"], True)
    stored = {k: v.detach().clone() for k, v in net.state_dict().items()}
    ops = NvidiaOps()
    ops.prepare_weights(net)
    prepared = {k: v.detach().clone() for k, v in net.state_dict().items()}
    assert w4a8.refs_of(net["b"]) is None and order_experts(net, "rotate") == 0  # b was rearranged
    assert not torch.equal(prepared["b.w1"], stored["b.w1"])
    x = torch.randn(7, 128, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(7, 4, device="cuda").argsort(dim=1)[:, :2]
    wt = torch.rand(7, 2, device="cuda")
    before = [routed_experts(net[k], x, idx, wt, 10.0, ops) for k in "ab"]
    refs = w4a8.refs_of(net["a"])
    assert stored_experts(net) >= 1
    assert all(torch.equal(v, stored[k]) for k, v in net.state_dict().items())
    ops.prepare_weights(net)
    assert all(torch.equal(v, prepared[k]) for k, v in net.state_dict().items())
    assert (refs is None) == (w4a8.refs_of(net["a"]) is None)
    assert refs is None or all(map(torch.equal, refs, w4a8.refs_of(net["a"])))
    after = [routed_experts(net[k], x, idx, wt, 10.0, ops) for k in "ab"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
