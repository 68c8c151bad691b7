"""The mHC mixes GEMM (``deepinfer.kernels.hc_mixes.mixes_gemm``) against ``h.float() @ fn.T``: fp32 and bf16-valued
streams, layer (``M = (2 + N) · N``) and head (``M = N``) widths, split and unsplit K. Without a GPU it runs in Triton's
interpreter (fp32 storage, small shapes); on a CUDA machine with ``TRITON_INTERPRET`` unset, bf16 at V4-Flash widths."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from deepinfer.kernels import hc_mixes  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET, reason="needs CUDA with TRITON_INTERPRET unset"
)


def _inputs(t: int, n: int, d: int, m: int, seed: int, bf16_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, n, d, generator=g)
    if bf16_values:  # exactly representable in bf16, stored fp32 (the interpreter's bf16 arithmetic is wrong)
        h = h.bfloat16().float()
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    return h.to(DEVICE), fn.to(DEVICE)


def _check(got: torch.Tensor, h: torch.Tensor, fn: torch.Tensor, rel: float = 1e-6) -> None:
    """``got`` is ``h.float() @ fn.T`` up to fp32 summation order: within ``rel`` of ``Σ_k |h_k · fn_k|`` (fp64)."""
    hd, fd = h.reshape(h.shape[0], -1).double(), fn.double()
    want, mag = hd @ fd.t(), hd.abs() @ fd.abs().t()
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = ((got.double() - want).abs() - rel * mag).max().item() if got.numel() else 0.0
    assert err <= 0.0, err
    ref = torch.mm(h.reshape(h.shape[0], -1).float(), fn.float().t())
    assert ((got - ref).abs() <= 2 * rel * mag.float()).all()


@pytest.mark.parametrize(
    ("t", "n", "d"),
    [(1, 4, 8), (3, 3, 50), (17, 4, 96), (64, 4, 40), (64, 3, 96)],  # K = 32, 150, 384, 160, 288: partial K blocks
)
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_mixes_match_the_fp32_gemm(t, n, d, head, bf16_values):
    m = n if head else (2 + n) * n
    h, fn = _inputs(t, n, d, m, seed=t * 7 + n + d, bf16_values=bf16_values)
    _check(hc_mixes.mixes_gemm(h, fn), h, fn)


@pytest.mark.parametrize(("t", "n", "d"), [(3, 4, 96), (17, 3, 50)])  # K = 384 (6 blocks), 150 (3, a partial one)
def test_split_and_unsplit_agree(t, n, d):
    h, fn = _inputs(t, n, d, (2 + n) * n, seed=5, bf16_values=True)
    one = hc_mixes.mixes_gemm(h, fn, split=1)
    _check(one, h, fn)
    mag = h.reshape(t, -1).abs() @ fn.abs().t()
    for split in (2, 3, 100):  # 100: more splits than K blocks (reduced to one block each, none empty)
        got = hc_mixes.mixes_gemm(h, fn, split=split)
        _check(got, h, fn)
        assert ((got - one).abs() <= 2e-6 * mag).all()
    assert torch.equal(hc_mixes.mixes_gemm(h, fn, split=3), hc_mixes.mixes_gemm(h, fn, split=3))  # deterministic


def test_bf16_and_fp16_storage_and_views():
    """h stored in bf16 / fp16 (cast to fp32 right after the load), ``[T, K]`` input, no tokens."""
    h, fn = _inputs(5, 4, 24, 24, seed=3, bf16_values=True)
    for dt in (torch.bfloat16, torch.float16):
        hh = h.to(dt)
        _check(hc_mixes.mixes_gemm(hh, fn), hh.float(), fn)
    _check(hc_mixes.mixes_gemm(h.reshape(5, -1), fn), h, fn)
    assert hc_mixes.mixes_gemm(h[:0], fn).shape == (0, 24)
    with pytest.raises(ValueError):
        hc_mixes.mixes_gemm(h, fn[:, :-1])


def test_split_is_a_function_of_the_shapes():
    k = 16384
    assert hc_mixes.split_for(1, k) == hc_mixes.split_for(64, k) > 1  # decode: split K to fill the GPU
    assert hc_mixes.split_for(1 << 16, k) == 1  # long prefill: enough token blocks
    for t in (1, 64, 256, 4096, 1 << 16):
        s = hc_mixes.split_for(t, k)
        assert 1 <= s <= k // hc_mixes.MIN_CHUNK
        assert triton.cdiv(t, hc_mixes.block_t_for(t)) * s <= max(hc_mixes.TARGET_PROGRAMS, triton.cdiv(t, 64))
    assert hc_mixes.split_for(5, 32) == 1  # K smaller than a chunk


def test_cached_split3_follows_the_tensor_not_its_address():
    """The split is made again for an in-place change and for a new tensor (which may take a freed one's address)."""
    from deepinfer.kernels.hc import cached_split3, split3

    fn = torch.randn(4, 64)
    first = cached_split3(fn)
    assert cached_split3(fn) is first and torch.equal(first, split3(fn))
    fn.mul_(2)
    assert torch.equal(cached_split3(fn), split3(fn))
    for seed in range(4):  # fresh tensors of one shape: the allocator hands the same memory back
        del fn
        fn = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(cached_split3(fn), split3(fn))


@gpu_only
def test_split_mixes_against_the_fp32_gemm():
    """``hc.split_mixes_parts`` (one bf16 GEMM against the split weight, its three column groups summed) against the
    exact product of the same bf16 streams: the products are exact, so the error is the fp32 sums' (measured on an
    H200: at most 3e-7 of ``Σ|h·fn|``, where a weight rounded to bf16 would give ~1e-5); fresh weights each time
    (their split must not be a stale one)."""
    from deepinfer.kernels.hc import split_mixes_parts

    for t in (1, 2, 8, 64, 4096):
        g = torch.Generator().manual_seed(t)
        h = torch.randn(t, 4 * 4096, generator=g).bfloat16().cuda()
        fn = (torch.randn(24, 4 * 4096, generator=g) * 0.01).cuda()
        want = h.double() @ fn.double().t()
        scale = h.double().abs() @ fn.double().abs().t()
        r = split_mixes_parts(h, fn).double()
        got = (r[:, :24] + r[:, 24:48]) + r[:, 48:]
        assert ((got - want).abs() <= 2e-6 * scale).all(), t


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
def test_hc_pre_sums_the_three_column_groups_of_split_mixes():
    """``_hc_pre_kernel`` reading mixes in three column groups (``split_mixes_parts``' layout) gives what it gives on
    their sum: groups ``(a, b, 0)`` with ``a + b`` the mixes exactly, bit for bit."""
    from deepinfer.kernels import hc

    g = torch.Generator().manual_seed(8)
    t, n, d = 5, 4, 64
    h = torch.randn(t, n, d, generator=g).to(DEVICE)
    for m in ((2 + n) * n, n):  # a layer, the head
        mixes = torch.randn(t, m, generator=g).to(DEVICE)
        a = mixes.bfloat16().float()
        parts = torch.cat([a, mixes - a, torch.zeros_like(a)], dim=1)
        scale, base = torch.rand(3, generator=g).to(DEVICE), torch.randn(m, generator=g).to(DEVICE)
        one = hc._from_mixes(h, mixes, 1, m, scale, base, 20, 1e-6, 1e-6, True)
        three = hc._from_mixes(h, parts, 3, m, scale, base, 20, 1e-6, 1e-6, True)
        for x, y in zip(one, three, strict=True):
            assert torch.equal(x, y)
