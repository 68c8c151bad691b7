"""The fused mHC, RMSNorm and RoPE kernels (``deepinfer.kernels.hc``, ``deepinfer.kernels.norm``) against the
reference ops they replace. Without a GPU they run in Triton's interpreter (fp32, small shapes); on a CUDA machine with
``TRITON_INTERPRET`` unset the same tests compile and run for real, plus bf16 at V4-Flash widths."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import hc, norm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
REF = ReferenceOps()


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _mhc(t: int, n: int, d: int, seed: int, dtype: torch.dtype = torch.float32, head: bool = False) -> tuple:
    g = torch.Generator().manual_seed(seed)
    m = n if head else (2 + n) * n
    h = _randn(g, t, n, d, dtype=dtype)
    fn = _randn(g, m, n * d, scale=(n * d) ** -0.5)
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).to(DEVICE)
    base = _randn(g, m, scale=0.3)
    return h, fn, scale, base


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, err


@pytest.mark.parametrize(("t", "n", "d"), [(1, 4, 64), (7, 4, 96), (5, 3, 48), (0, 4, 32)])
def test_hc_pre_and_mixes_match_the_reference(t, n, d):
    h, fn, scale, base = _mhc(t, n, d, seed=t + n)
    for iters in (1, 20):
        pre, post, comb = REF.hc_mixes(h, fn, scale, base, iters, 1e-6, 1e-6)
        x, post2, comb2 = hc.hc_pre(h, fn, scale, base, iters, 1e-6, 1e-6)
        _close(x, REF.hc_collapse(h, pre), 2e-6)
        _close(post2, post, 1e-6)
        _close(comb2, comb, 1e-6)
        for got, want in zip(hc.hc_mixes(h, fn, scale, base, iters, 1e-6, 1e-6), (pre, post, comb)):
            _close(got, want, 1e-6)


def test_hc_pre_of_the_head_is_pre_only():
    h, fn, scale, base = _mhc(6, 4, 64, seed=1, head=True)
    pre, _, _ = REF.hc_mixes(h, fn, scale, base, 0, 1e-6, 1e-6)
    x, post, comb = hc.hc_pre(h, fn, scale, base, 0, 1e-6, 1e-6)
    _close(x, REF.hc_collapse(h, pre), 2e-6)
    _close(post, pre, 1e-6)
    assert comb is post


def test_sinkhorn_with_a_tiny_eps_has_no_nan():
    """V4.1 uses eps = 1e-20: padded lanes (3 streams in a 4-wide tile) must stay exact zeros, not 0/0."""
    h, fn, scale, base = _mhc(4, 3, 32, seed=2)
    pre, post, comb = hc.hc_mixes(h, fn, scale, base, 20, 1e-20, 1e-6)
    assert torch.isfinite(comb).all() and torch.isfinite(pre).all()
    _close(comb, REF.hc_mixes(h, fn, scale, base, 20, 1e-20, 1e-6)[2], 1e-6)


@pytest.mark.parametrize(("t", "n", "d"), [(1, 4, 64), (9, 4, 600), (5, 3, 48), (150, 4, 600)])  # 150: wide rows
def test_hc_expand_matches_the_reference(t, n, d):
    g = torch.Generator().manual_seed(t)
    y, res = _randn(g, t, d), _randn(g, t, n, d)
    post, comb = torch.rand(t, n, generator=g).to(DEVICE) * 2, torch.rand(t, n, n, generator=g).to(DEVICE)
    _close(hc.hc_expand(y, res, post, comb), REF.hc_expand(y, res, post, comb), 2e-6)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 48), (1, 1000), (0, 16)])
def test_rms_norm_matches_the_reference(shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w = _randn(g, *shape), _randn(g, shape[-1])
    _close(norm.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), 2e-6)
    _close(norm.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6), 2e-6)


def test_rms_norm_reads_strided_rows():
    """A column slice of a joined GEMM's output (``layers.rows_forward``): read in place, a contiguous result."""
    g = torch.Generator().manual_seed(7)
    y, w = _randn(g, 6, 80), _randn(g, 48)
    x = y[:, 16:64]
    got = norm.rms_norm(x, w, 1e-6)
    assert got.is_contiguous()
    _close(got, REF.rms_norm(x.contiguous(), w, 1e-6), 2e-6)


@pytest.mark.parametrize(
    ("xs", "cs"), [((5, 3, 48), (5, 1, 8)), ((6, 32), (6, 8)), ((4, 16), (4, 8)), ((1, 2, 8), (1, 1, 4))]
)
def test_rope_matches_the_reference(xs, cs):
    g = torch.Generator().manual_seed(xs[-1])
    x, cos, sin = _randn(g, *xs), _randn(g, *cs), _randn(g, *cs)
    assert norm.rope_supported(x, cos, sin)
    for inverse in (False, True):
        _close(norm.rope(x, cos, sin, inverse), REF.rope(x, cos, sin, inverse), 1e-6)


@pytest.mark.parametrize(("xs", "cs"), [((5, 3, 48), (5, 1, 8)), ((6, 32), (6, 8))])
def test_rope_in_place_rotates_only_the_rotary_dims(xs, cs):
    """``inplace``: a contiguous input becomes the result (the same values as out of place), its other dims left
    where they are; a non-contiguous one is left alone and a new tensor returned."""
    g = torch.Generator().manual_seed(xs[-1] + 1)
    x, cos, sin = _randn(g, *xs), _randn(g, *cs), _randn(g, *cs)
    for inverse in (False, True):
        want, before = norm.rope(x, cos, sin, inverse), x.clone()
        y = x.clone()
        got = norm.rope(y, cos, sin, inverse, inplace=True)
        assert got.data_ptr() == y.data_ptr() and torch.equal(got, want)
        assert torch.equal(got[..., : xs[-1] - 2 * cs[-1]], before[..., : xs[-1] - 2 * cs[-1]])
        wide = torch.cat([x, x], dim=-1)[..., : xs[-1]]  # rows strided: not rotated in place
        got = norm.rope(wide, cos, sin, inverse, inplace=True)
        assert got.data_ptr() != wide.data_ptr() and torch.equal(got, want) and torch.equal(wide, before)


def test_rope_refuses_broadcasts_it_does_not_read():
    x = torch.zeros(4, 3, 16)
    assert not norm.rope_supported(x, torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))  # broadcast over the leading dim
    assert not norm.rope_supported(x, torch.zeros(4, 8), torch.zeros(4, 8))  # other rank
    assert not norm.rope_supported(x, torch.zeros(4, 1, 10), torch.zeros(4, 1, 10))  # wider than x


@gpu_only
def test_bf16_at_v4_flash_widths():
    """bf16 streams of V4-Flash (4 × 4096), heads 64 × 512 with a 64-dim rope, against the reference on the GPU (bf16
    outputs: within a rounding step)."""

    def bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

    h, fn, scale, base = _mhc(64, 4, 4096, seed=3, dtype=torch.bfloat16)
    pre, post, comb = REF.hc_mixes(h, fn, scale, base, 20, 1e-6, 1e-6)
    x, post2, comb2 = hc.hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6)
    bf16_close(x, REF.hc_collapse(h, pre))
    _close(comb2, comb, 1e-5)
    _close(post2, post, 1e-5)
    g = torch.Generator().manual_seed(4)
    y = _randn(g, 64, 4096, dtype=torch.bfloat16)
    bf16_close(hc.hc_expand(y, h, post, comb), REF.hc_expand(y, h, post, comb))
    q, w = _randn(g, 64, 64, 512, dtype=torch.bfloat16), _randn(g, 512)
    bf16_close(norm.rms_norm(q, w, 1e-6), REF.rms_norm(q, w, 1e-6))
    cos, sin = _randn(g, 64, 1, 32), _randn(g, 64, 1, 32)
    bf16_close(norm.rope(q, cos, sin, True), REF.rope(q, cos, sin, True))
