"""The Gluon prefill MXFP4 kernels (deepinfer.kernels.moe_mxfp4_wgmma) against the Triton prefill tiles of
``kernels.moe_mxfp4`` and ``moe_triton`` on the decoded experts.

Gluon kernels do not run in Triton's interpreter, so these tests need an sm_90 GPU (CI on a CPU host skips them; the
CPU-side dispatch rule is checked everywhere). ``moe_mxfp4`` takes this path by itself for the prefill tiles of
rotate-ordered experts; ``WGMMA_PREFILL = False`` gives the Triton tiles of the same call.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from test_moe_mxfp4 import _decoded, _packed, _rel, _shifted  # noqa: E402

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer import envs  # noqa: E402
from deepinfer.kernels import moe_mxfp4_wgmma as wg  # noqa: E402
from deepinfer.kernels.moe import moe_triton  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import MX_MID64, MX_PREFILL, moe_mxfp4  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = torch.cuda.is_available() and not INTERPRET and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not (HOPPER and wg.HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")


@pytest.fixture(autouse=True)
def _gluon_unless_a_test_says(monkeypatch):
    """Every test runs the Gluon path (not the warp-specialised one) unless it sets otherwise, whatever the
    environment's ``DEEPINFER_MOE_PREFILL``."""
    monkeypatch.setattr(mod, "WGMMA_PREFILL", True)
    monkeypatch.setattr(wg, "WS", False)
    monkeypatch.setattr(wg, "FRAG", False)


def test_the_setting_picks_the_kernels(monkeypatch):
    """``DEEPINFER_MOE_PREFILL``, handed over by the nvidia backend as ``PREFILL`` (the kernels read no settings):
    gluon (default; the fragment kernels, ``test_moe_frag.py``) / gluon-smem / gluon-ws / triton, where the module
    flags are unset; a flag wins."""
    from deepinfer.backends.nvidia.settings import hand_over
    from deepinfer.kernels import attention_wgmma, pdl

    for module, knob in ((wg, "PREFILL"), (attention_wgmma, "ENABLED"), (pdl, "ENABLED")):
        monkeypatch.setattr(module, knob, getattr(module, knob))  # as they were, after the test
    assert envs.registry()["DEEPINFER_MOE_PREFILL"].choices == wg.PREFILL_KERNELS
    monkeypatch.setattr(wg, "available", lambda x: True)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(mod, "WGMMA_PREFILL", None)
    monkeypatch.setattr(wg, "WS", None)
    monkeypatch.delenv("DEEPINFER_MOE_PREFILL", raising=False)
    hand_over()
    assert wg.PREFILL == "gluon"
    assert mod._wgmma(MX_PREFILL, x, "rotate", 2048, 4096, interpret=False) and not wg.use_ws()
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL", "gluon-ws")
    hand_over()
    assert mod._wgmma(MX_PREFILL, x, "rotate", 2048, 4096, interpret=False) and wg.use_ws()
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL", "Triton")
    hand_over()
    assert not mod._wgmma(MX_PREFILL, x, "rotate", 2048, 4096, interpret=False) and not wg.use_ws()
    monkeypatch.setattr(mod, "WGMMA_PREFILL", True)
    monkeypatch.setattr(wg, "WS", True)
    assert mod._wgmma(MX_PREFILL, x, "rotate", 2048, 4096, interpret=False) and wg.use_ws()
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL", "cuda-cores")
    with pytest.raises(envs.EnvError, match="DEEPINFER_MOE_PREFILL"):
        hand_over()


def test_dispatch_rule_on_the_host():
    """Only the prefill tiles of rotate-ordered bf16 experts on sm_90, in whole tiles, and not in the interpreter."""
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not wg.available(x)  # a CPU tensor
    assert wg.fits(2048, 4096) and wg.fits(4096, 2048) and not wg.fits(2304 + 64, 4096) and not wg.fits(2048, 96)
    assert not mod._wgmma(MX_PREFILL, x, "rotate", 2048, 4096, interpret=True)
    assert not mod._wgmma(MX_MID64, x, "rotate", 2048, 4096, interpret=False)
    assert not mod._wgmma(MX_PREFILL, x, "shift", 2048, 4096, interpret=False)


def test_a_failed_build_falls_back_once(monkeypatch):
    """A Triton whose Gluon API differs: the first call that fails logs, returns the Triton tiles' result, and later
    calls go straight to the Triton tiles (runs in the interpreter on a CPU host, the real kernels on a GPU)."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    g = torch.Generator(device=dev).manual_seed(3)
    (w1, s1), (w3, s3), (w2, s2) = _packed(6, 64, 64, g), _packed(6, 64, 64, g), _packed(6, 64, 64, g)
    x = torch.randn(5, 64, generator=g, device=dev)
    idx = torch.rand(5, 6, generator=g, device=dev).argsort(dim=1)[:, :2]
    w = torch.rand(5, 2, generator=g, device=dev)
    want = moe_mxfp4(x, idx, w, w1, s1, w2, s2, w3, s3, 10.0)
    tries = []

    def broken(*args, **kw):
        tries.append(1)
        raise RuntimeError("an unknown Gluon builtin")

    monkeypatch.setattr(mod, "WGMMA_FAILED", None)
    monkeypatch.setattr(mod, "_wgmma", lambda *a: not mod.WGMMA_FAILED)
    monkeypatch.setattr(mod, "_moe_wgmma", broken)
    assert torch.equal(moe_mxfp4(x, idx, w, w1, s1, w2, s2, w3, s3, 10.0), want)
    assert tries == [1] and "unknown Gluon builtin" in mod.WGMMA_FAILED
    assert torch.equal(moe_mxfp4(x, idx, w, w1, s1, w2, s2, w3, s3, 10.0), want)
    assert tries == [1]


def _problem(e, i, d, k, t, pool, seed, x_scale=1.0, w_scale=1.0):
    """Random MXFP4 experts ``[E, I, D]`` (plain codes, and copies in the rotate order) and ``t`` routed bf16 rows
    over the first ``pool`` experts, top ``k``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    (w1, s1), (w3, s3) = _packed(e, i, d, g, 118, 122), _packed(e, i, d, g)
    w2, s2 = _packed(e, d, i, g, 116, 120)
    mx = (w1, s1, w2, s2, w3, s3)
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16() * x_scale
    idx = torch.rand(t, pool, generator=g, device="cuda").argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device="cuda") * w_scale
    return mx, _shifted(mx, "rotate"), x, idx, w


def _calls(monkeypatch, module=wg):
    """Counts the launches of ``module``'s Gluon kernels (``gate_up``, ``down``; the kernels themselves run)."""
    calls = []
    for name in ("gate_up", "down"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _n=name, **kw: (calls.append(_n), _real(*a, **kw))[1])
    return calls


@hopper_only
@pytest.mark.parametrize(("t", "pool"), [(300, 16), (700, 16), (400, 7)])
def test_gpu_matches_the_triton_tiles(t, pool, monkeypatch):
    """V4-Flash widths (D = 4096, I = 2048), 16 experts, top 6: 112 to 260 slots an expert (one or two 128-slot
    blocks, padded) or all slots on 7 experts (many blocks an expert, 9 experts empty); against the Triton prefill
    tiles on the same rotate-ordered codes and ``moe_triton`` on the decoded experts."""
    e, i, d, k = 16, 2048, 4096, 6
    mx, rot, x, idx, w = _problem(e, i, d, k, t, pool, seed=t, w_scale=1.5)
    calls = _calls(monkeypatch)
    out = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    assert calls == ["gate_up", "down"]
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    tiles = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    assert calls == ["gate_up", "down"]  # the Triton tiles this time
    ref = moe_triton(x, idx, w, *_decoded(mx, torch.bfloat16), 10.0)
    assert out.dtype == torch.float32 and out.shape == (t, d)
    assert _rel(out, tiles) < 2e-3 and _rel(out, ref) < 5e-3  # fp32 sums in another order (and bf16 roundings)
    assert torch.isfinite(out).all()


@hopper_only
@pytest.mark.parametrize(("t", "pool"), [(300, 16), (400, 7)])
def test_gpu_warp_specialised_variant_bit_identical(t, pool, monkeypatch):
    """``moe_mxfp4_ws`` (producer warps decode, consumer warpgroups multiply) gives the same tiles to the same MMAs in
    the same order as ``moe_mxfp4_wgmma``: bit-identical results."""
    e, i, d, k = 16, 2048, 4096, 6
    mx, rot, x, idx, w = _problem(e, i, d, k, t, pool, seed=t + 1)
    want = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    monkeypatch.setattr(wg, "WS", True)
    calls = _calls(monkeypatch)
    assert torch.equal(moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate"), want)
    assert calls == ["gate_up", "down"]


def test_exponent_words_a_row_loads_at_once(monkeypatch):
    """16-byte groups where a row's exponents make them (V4-Flash: 128 and 64 a row), 8 bytes for V4.1's 72-byte rows,
    a byte a step where no 4-byte word lines up or ``SCALE_WORDS`` is off."""
    assert wg.scale_words(4096) == 4 and wg.scale_words(2048) == 4 and wg.scale_words(5120) == 4
    assert wg.scale_words(2304) == 2 and wg.scale_words(64 * 3) == 0 and wg.scale_words(64 * 6) == 1
    rows = torch.zeros(2 * 128 + 4, dtype=torch.uint8)
    assert wg.scale_words(4096, rows[:128]) == 4  # an allocation's start: 16-byte aligned
    assert wg.scale_words(4096, rows[4:]) == 1 and wg.scale_words(4096, rows[8:]) == 2  # views: narrower loads
    assert wg.scale_words(4096, rows[1:]) == 0  # not even 4-byte aligned: a byte a step
    monkeypatch.setattr(wg, "SCALE_WORDS", False)
    assert wg.scale_words(4096) == 0


@hopper_only
@pytest.mark.parametrize(("i", "d"), [(2048, 4096), (2304, 5120)])
def test_gpu_exponent_words_bit_identical(i, d, monkeypatch):
    """The exponents loaded as words every few steps give the decode the same exponents as a byte a step: the same
    bits, at V4-Flash's widths (16-byte groups) and V4.1's (the down projection's 72-byte rows: 8-byte groups)."""
    mx, rot, x, idx, w = _problem(16, i, d, 6, 300, 16, seed=i)
    monkeypatch.setattr(wg, "SCALE_WORDS", False)
    want = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    monkeypatch.setattr(wg, "SCALE_WORDS", True)
    calls = _calls(monkeypatch)
    assert torch.equal(moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate"), want)
    assert calls == ["gate_up", "down"]


@hopper_only
def test_gpu_v41_widths(monkeypatch):
    """V4.1-Flash's expert widths (D = 5120, I = 2304: 18 gate/up tiles, 36 down K steps, 72-byte scale rows), 16
    experts: against the Triton prefill tiles."""
    e, i, d, k, t = 16, 2304, 5120, 6, 300
    mx, rot, x, idx, w = _problem(e, i, d, k, t, e, seed=41)
    calls = _calls(monkeypatch)
    out = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    assert calls == ["gate_up", "down"]
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    assert _rel(out, moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")) < 2e-3


@hopper_only
def test_gpu_act_quant_and_tight_limit(monkeypatch):
    """The official FP8 activations (input and hidden rows rounded) and a clamping SwiGLU limit, as the Triton tiles."""
    e, i, d, k, t = 16, 2048, 4096, 6, 300
    mx, rot, x, idx, w = _problem(e, i, d, k, t, e, seed=5, x_scale=4.0)
    out = moe_mxfp4(x, idx, w, *rot, 0.05, order="rotate", act_quant=True)
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    assert _rel(out, moe_mxfp4(x, idx, w, *rot, 0.05, order="rotate", act_quant=True)) < 2e-3


@hopper_only
def test_gpu_graph_replay_bit_identical():
    """Captured in a CUDA graph (no host reads of device values) and replayed: bit-identical to the eager call."""
    e, i, d, k, t = 16, 2048, 4096, 6, 300
    mx, rot, x, idx, w = _problem(e, i, d, k, t, e, seed=9)
    eager = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
