"""The small-M fp32-output GEMM (``deepinfer.kernels.small_gemm.small_mm_fp32``) against ``x.float() @ w.float().T``:
bf16 / fp16 inputs, M = 1 … 40, K not a multiple of the block, odd N, unsplit and split K (one launch, tickets);
bitwise determinism, the ticket counters left at zero, and bad inputs. Without a GPU it runs in Triton's interpreter
at small shapes; on a CUDA machine with ``TRITON_INTERPRET`` unset, also against ``torch.mm(out_dtype=fp32)`` at the
decode shapes of V4-Flash and V4.1-Flash, eager and replayed from a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from deepinfer.kernels import small_gemm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_kernel = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET, reason="needs CUDA with TRITON_INTERPRET unset"
)
# (K, N) of decode's fp32 GEMMs: V4-Flash's router (and indexer compressor), CSA / HCA compressors, mHC mixes of a
# layer and of the head (split in three bf16 parts), V4.1-Flash's router and mixes
DECODE_SHAPES = [(4096, 256), (4096, 1024), (4096, 512), (16384, 72), (16384, 12), (5120, 384), (20480, 72)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 1e-6) -> None:
    """``got`` is ``x.float() @ w.float().T`` up to fp32 summation order: within ``rel`` of ``Σ_k |x_k · w_k|`` of the
    exact (fp64) product, and within ``2 · rel`` of torch's fp32 GEMM (the products are exact in fp32)."""
    xd, wd = x.double(), w.double()
    want, mag = xd @ wd.t(), xd.abs() @ wd.abs().t()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= rel * mag).all(), ((got.double() - want).abs() / mag).max().item()
    ref = x.float() @ w.float().t()
    assert ((got - ref).abs() <= 2 * rel * mag.float()).all()


def _counters_zero(device: str) -> bool:
    cnt = small_gemm._COUNTERS.get(small_gemm._device_key(torch.device(device)))
    return cnt is None or not cnt.any().item()


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 700), (3, 65, 257), (16, 37, 200), (40, 129, 760)])
@pytest.mark.parametrize("split", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_fp32_gemm(m, n, k, split, dtype):
    x, w = _inputs(m, n, k, dtype, seed=m * 31 + n + k)
    _, s, chunk = small_gemm.plan(m, n, k, split=split)
    assert split != 3 or s == min(3, triton.cdiv(k, small_gemm.BLOCK_K))  # fewer steps than 3: fewer splits
    assert (s - 1) * chunk < k <= s * chunk  # no empty split
    _check(small_gemm.small_mm_fp32(x, w, split=split), x, w)
    assert _counters_zero(DEVICE)


@needs_kernel
@pytest.mark.parametrize("split", [1, 4])
def test_bitwise_deterministic_and_counters_back_to_zero(split):
    x, w = _inputs(5, 71, 1100, torch.bfloat16, seed=3)
    one = small_gemm.small_mm_fp32(x, w, split=split)
    two = small_gemm.small_mm_fp32(x, w, split=split)
    assert torch.equal(one, two)
    assert _counters_zero(DEVICE)
    if split > 1:
        cnt = small_gemm._COUNTERS[small_gemm._device_key(torch.device(DEVICE))]
        assert cnt.shape == (small_gemm.COUNTERS,) and cnt.dtype == torch.int32


@needs_kernel
def test_strided_rows_and_empty_shapes():
    x, w = _inputs(4, 33, 600, torch.bfloat16, seed=9)
    wide = torch.zeros(4, 640, dtype=x.dtype, device=x.device)
    wide[:, :600] = x
    xs = wide[:, :600]  # row stride 640
    assert torch.equal(small_gemm.small_mm_fp32(xs, w, split=2), small_gemm.small_mm_fp32(x, w, split=2))
    assert small_gemm.small_mm_fp32(x[:0], w).shape == (0, 33)
    assert small_gemm.small_mm_fp32(x, w[:0]).shape == (4, 0)
    z = small_gemm.small_mm_fp32(x[:, :0], w[:, :0])
    assert z.shape == (4, 33) and not z.any()


def test_plan_from_shapes():
    for m, n, k, sms in [(1, 256, 4096, 132), (64, 1024, 4096, 132), (1, 72, 16384, 132), (1, 12, 16384, 78)]:
        bm, s, chunk = small_gemm.plan(m, n, k, sms)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, small_gemm.BLOCK_N)
        assert 16 <= bm <= small_gemm.MAX_M and 1 <= s <= small_gemm.MAX_SPLIT
        assert chunk % small_gemm.BLOCK_K == 0 and (s - 1) * chunk < k <= s * chunk
        assert tiles * s <= max(tiles, small_gemm.PROGRAMS_PER_SM * sms)
    assert small_gemm.plan(64, 1 << 20, 4096, split=8)[1] == 1  # more tiles than counters: no split


def test_bad_inputs_raise():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="both bfloat16 or both float16"):
        small_gemm.small_mm_fp32(x, torch.zeros(8, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="both bfloat16 or both float16"):
        small_gemm.small_mm_fp32(x.float(), torch.zeros(8, 64))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        small_gemm.small_mm_fp32(x, torch.zeros(8, 65, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        small_gemm.small_mm_fp32(x[0], torch.zeros(8, 64, dtype=torch.bfloat16))


def test_callers_keep_torch_off_cuda():
    """CPU tensors never take the kernel (``applies``): ``linear_fp32`` and the mixes keep their torch paths."""
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not small_gemm.applies(x, w)


@gpu_only
@pytest.mark.parametrize(("k", "n"), DECODE_SHAPES)
def test_decode_shapes_against_torch_mm(k, n):
    for m in (1, 2, 16, 64):
        x, w = _inputs(m, n, k, torch.bfloat16, seed=m + k + n)
        got = small_gemm.small_mm_fp32(x, w)
        _check(got, x, w)
        assert torch.equal(got, small_gemm.small_mm_fp32(x, w))
        ref = torch.mm(x, w.t(), out_dtype=torch.float32)
        mag = x.float().abs() @ w.float().abs().t()
        assert ((got - ref).abs() <= 2e-6 * mag).all()
    assert _counters_zero("cuda")


@gpu_only
def test_cuda_graph_replay_matches_eager():
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.kernels.hc import split_mixes_parts

    ops = NvidiaOps()
    x, w = _inputs(1, 256, 4096, torch.bfloat16, seed=1)
    h = torch.randn(4, 16384, device="cuda").bfloat16()
    fn = torch.randn(24, 16384, device="cuda") * 0.01
    eager = [ops.linear_fp32(x, w), split_mixes_parts(h, fn), small_gemm.small_mm_fp32(x, w, split=1)]
    assert torch.equal(eager[0], small_gemm.small_mm_fp32(x, w))  # the ops route to the kernel
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (compiles the kernels) off the default stream, as torch's docs do
            ops.linear_fp32(x, w)
            split_mixes_parts(h, fn)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        outs = [ops.linear_fp32(x, w), split_mixes_parts(h, fn), small_gemm.small_mm_fp32(x, w, split=1)]
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, outs, strict=True):
            assert torch.equal(a, b)
    assert _counters_zero("cuda")
