"""The register-fragment MXFP4 prefill kernels (``deepinfer.kernels.moe_mxfp4_frag``): each thread decodes the
weights of its own ``wgmma`` A fragment, the activations' columns permuted within each 32 to match.

The column permutation and the dispatch rule are checked on any host; the kernels (Gluon: not in Triton's
interpreter) on an sm_90 GPU against the shared-memory Gluon kernels (``moe_mxfp4_wgmma``), the Triton prefill tiles
and ``moe_triton`` on the decoded experts.
"""

import pytest
import torch

pytest.importorskip("triton")

from test_moe_mxfp4 import _decoded, _rel  # noqa: E402
from test_moe_wgmma import _calls as _wg_calls  # noqa: E402
from test_moe_wgmma import _problem, hopper_only  # noqa: E402

import deepinfer.kernels.moe_mxfp4 as mod  # noqa: E402
from deepinfer.kernels import moe_mxfp4_frag as frag  # noqa: E402
from deepinfer.kernels import moe_mxfp4_wgmma as wg  # noqa: E402
from deepinfer.kernels.moe import moe_triton  # noqa: E402


@pytest.fixture(autouse=True)
def _frag_unless_a_test_says(monkeypatch):
    """The Gluon prefill path with the fragment kernels, whatever the environment's ``DEEPINFER_MOE_PREFILL``."""
    monkeypatch.setattr(mod, "WGMMA_PREFILL", True)
    monkeypatch.setattr(mod, "WGMMA_FAILED", None)
    monkeypatch.setattr(wg, "WS", False)
    monkeypatch.setattr(wg, "FRAG", True)


def test_fragment_columns_swap_pair_and_quad_index():
    """MMA column ``8p + 2q + j`` of each 32 holds original column ``8q + 2p + j``: a permutation of each 32-column
    block, its own inverse, and ``permute_columns`` is the gather by it."""
    perm = frag.frag_columns(96)
    assert sorted(perm.tolist()) == list(range(96))
    assert torch.equal(perm[perm], torch.arange(96))
    assert perm[:8].tolist() == [0, 1, 8, 9, 16, 17, 24, 25] and perm[8:10].tolist() == [2, 3]
    assert ((perm // 32) == (torch.arange(96) // 32)).all()  # within blocks: 128-column scales keep their sets
    x = torch.randn(5, 96)
    assert torch.equal(frag.permute_columns(x), x[:, perm])
    assert torch.equal(frag.permute_columns(frag.permute_columns(x)), x)
    assert torch.equal(frag.permute_columns(x.T.contiguous().T), x[:, perm])  # a strided view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_permutation_kernel_is_the_gather(dtype):
    """``_permute_kernel`` (what ``permute_columns`` runs on CUDA; here in Triton's interpreter on a CPU host, on the
    GPU itself there): the gather by ``frag_columns``, bit for bit, rows past the end untouched."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(21, 512, device=dev).to(dtype)
    out = torch.full_like(x, 7.0)
    frag._permute_kernel[(2, 2)](x, out, 20, 512, BLOCK_T=16, BLOCK_K=256)
    assert torch.equal(out[:20], x[:20, frag.frag_columns(512).to(dev)]) and (out[20] == 7.0).all()
    if dev == "cuda":
        assert torch.equal(frag.permute_columns(x), x[:, frag.frag_columns(512).to(dev)])


def test_which_shapes_and_scales_take_the_fragment_kernels(monkeypatch):
    """Whole 128-row tiles, whole 128-column steps (two at least), exponent rows on 4-byte boundaries; the choice is
    ``FRAG`` or, where that is None, ``PREFILL == "gluon"`` (``DEEPINFER_MOE_PREFILL``'s default; ``gluon-smem``: the
    decoded tiles through shared memory)."""
    assert frag.fits(2048, 4096) and frag.fits(4096, 2048) and frag.fits(2304, 5120) and frag.fits(5120, 2304)
    assert not frag.fits(2048 + 64, 4096) and not frag.fits(2048, 4096 + 64) and not frag.fits(2048, 128)
    rows = torch.zeros(3 * 128 + 4, dtype=torch.uint8)
    assert mod._frag(2048, 4096, rows[:128], rows[128:256], rows[256:384])
    assert not mod._frag(2048, 4096, rows[2:130], rows[128:256], rows[256:384])  # a view off a 4-byte boundary
    assert not mod._frag(2048, 4096 + 64, rows[:128], rows[128:256], rows[256:384])
    monkeypatch.setattr(wg, "FRAG", None)
    monkeypatch.setattr(wg, "WS", None)
    monkeypatch.setattr(wg, "PREFILL", "gluon")
    assert wg.use_frag() and mod._frag(2048, 4096, rows[:128])
    monkeypatch.setattr(wg, "PREFILL", "gluon-smem")
    assert not wg.use_frag() and not mod._frag(2048, 4096, rows[:128]) and not wg.use_ws()
    monkeypatch.setattr(wg, "PREFILL", "gluon-ws")
    assert not wg.use_frag() and wg.use_ws()


def _calls(monkeypatch):
    """Counts the fragment kernels' launches (the kernels themselves run)."""
    return _wg_calls(monkeypatch, frag)


@hopper_only
@pytest.mark.parametrize(("t", "pool"), [(300, 16), (700, 16), (400, 7)])
def test_gpu_matches_the_shared_memory_kernels(t, pool, monkeypatch):
    """V4-Flash widths (D = 4096, I = 2048), 16 experts, top 6: one or two 128-slot blocks an expert, or all slots on
    7 experts; against the shared-memory Gluon kernels and the Triton tiles on the same codes, and ``moe_triton`` on
    the decoded experts (only the fp32 sums' order differs)."""
    e, i, d, k = 16, 2048, 4096, 6
    mx, rot, x, idx, w = _problem(e, i, d, k, t, pool, seed=t + 7, w_scale=1.5)
    calls = _calls(monkeypatch)
    out = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    assert calls == ["gate_up", "down"]
    monkeypatch.setattr(wg, "FRAG", False)
    smem = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    monkeypatch.setattr(mod, "WGMMA_PREFILL", False)
    tiles = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    assert calls == ["gate_up", "down"]
    ref = moe_triton(x, idx, w, *_decoded(mx, torch.bfloat16), 10.0)
    assert out.dtype == torch.float32 and out.shape == (t, d) and torch.isfinite(out).all()
    assert _rel(out, smem) < 2e-3 and _rel(out, tiles) < 2e-3 and _rel(out, ref) < 5e-3
    assert mod.WGMMA_FAILED is None


@hopper_only
def test_gpu_v41_widths_and_act_quant(monkeypatch):
    """V4.1-Flash's expert widths (D = 5120, I = 2304: 72-byte exponent rows, 18 down steps), with the official FP8
    activations and a clamping SwiGLU limit: against the shared-memory Gluon kernels."""
    e, i, d, k, t = 16, 2304, 5120, 6, 300
    mx, rot, x, idx, w = _problem(e, i, d, k, t, e, seed=41, x_scale=4.0)
    calls = _calls(monkeypatch)
    for limit, act_quant in ((10.0, False), (0.05, True)):
        out = mod.moe_mxfp4(x, idx, w, *rot, limit, order="rotate", act_quant=act_quant)
        monkeypatch.setattr(wg, "FRAG", False)
        want = mod.moe_mxfp4(x, idx, w, *rot, limit, order="rotate", act_quant=act_quant)
        monkeypatch.setattr(wg, "FRAG", True)
        assert _rel(out, want) < 2e-3 and torch.isfinite(out).all()
    assert calls == ["gate_up", "down"] * 2 and mod.WGMMA_FAILED is None


@hopper_only
def test_gpu_every_output_written_and_graph_replay():
    """Every slot row of ``o`` written (poisoned first), padding rows never; captured in a CUDA graph and replayed:
    bit-identical to the eager call."""
    e, i, d, k, t = 16, 2048, 4096, 6, 300
    mx, rot, x, idx, w = _problem(e, i, d, k, t, e, seed=9)
    slots, bexp = mod.padded_slots(idx, e, frag.BLOCK_M)
    w1, s1, w2, s2, w3, s3 = rot
    words = [mod._words(v) for v in (w1, w2, w3)]
    bits = [mod._bits(v).contiguous() for v in (s1, s2, s3)]
    rw = w.reshape(-1).float().contiguous()
    h = torch.full((t * k, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    frag.gate_up(frag.permute_columns(x), words[0], bits[0], words[2], bits[2], rw, slots, bexp, h, k, 10.0)
    o = torch.full((t * k + 8, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    frag.down(h, words[1], bits[1], slots, bexp, o[: t * k])
    assert torch.isfinite(h).all() and torch.isfinite(o[: t * k]).all() and torch.isnan(o[t * k :]).all()
    eager = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@hopper_only
def test_gpu_down_tile_pairs_bit_identical(monkeypatch):
    """A down program over two tiles of weight rows (``DOWN_PAIRS``) runs each output's MMAs in the same order as one
    over a single tile: the same bits; ``down_rows`` picks pairs only where the rows make whole pairs."""
    assert frag.down_rows(4096) == 256 and frag.down_rows(4096 + 128) == 128
    mx, rot, x, idx, w = _problem(16, 2048, 4096, 6, 300, 16, seed=12)
    want = mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate")
    monkeypatch.setattr(frag, "DOWN_PAIRS", False)
    assert frag.down_rows(4096) == 128
    assert torch.equal(mod.moe_mxfp4(x, idx, w, *rot, 10.0, order="rotate"), want)
