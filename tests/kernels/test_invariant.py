"""Batch-invariant Triton kernels (deepinfer.kernels.invariant).

Without a GPU they run through the Triton interpreter (fp32 only: the interpreter's bf16 arithmetic is not the
GPU's); on a CUDA machine with ``TRITON_INTERPRET`` unset the same tests compile and run for real, plus the bf16
checks. ``TRITON_INTERPRET=1`` forces the interpreter on a GPU machine too.
"""

import os

# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU (before triton is imported) and patches the
# interpreter for NumPy >= 2.4 (tests/triton_interpreter.py)
import pytest
import torch  # does not import triton

pytest.importorskip("triton")

from deepinfer.kernels import invariant  # noqa: E402
from deepinfer.kernels.invariant import matmul_fixed, rowsum  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def _ref_matmul(x, w):
    return x.double() @ w.double().T


@pytest.mark.parametrize("M", [1, 3, 65, 130])
@pytest.mark.parametrize("K", [7, 64, 96])
@pytest.mark.parametrize("N", [5, 64, 130])
def test_matmul_matches_reference_fp32(M, K, N):
    x = _randn(M, K, seed=M * 1000 + K)
    w = _randn(N, K, seed=N * 1000 + K + 1)
    y = matmul_fixed(x, w)
    assert y.shape == (M, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _ref_matmul(x, w), rtol=1e-5, atol=1e-5 * K**0.5)


def test_matmul_leading_dims_strides_and_out_dtype():
    x = _randn(2, 3, 40, seed=1)
    w = _randn(70, 40, seed=2)
    y = matmul_fixed(x, w)
    assert y.shape == (2, 3, 70)
    torch.testing.assert_close(y.double(), _ref_matmul(x, w), rtol=1e-5, atol=1e-4)
    # non-contiguous inputs (transposed views) give the same bits as their contiguous copies
    xt = _randn(40, 9, seed=3).T
    wt = _randn(40, 70, seed=4).T
    assert torch.equal(matmul_fixed(xt, wt), matmul_fixed(xt.contiguous(), wt.contiguous()))
    assert matmul_fixed(xt, wt, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_matmul_empty():
    w = _randn(5, 8, seed=5)
    y = matmul_fixed(torch.empty(0, 8, device=DEVICE), w)
    assert y.shape == (0, 5)
    assert matmul_fixed(torch.empty(2, 0, 8, device=DEVICE), w).shape == (2, 0, 5)
    y = matmul_fixed(torch.ones(3, 0, device=DEVICE), torch.ones(5, 0, device=DEVICE))
    assert torch.equal(y, torch.zeros(3, 5, device=DEVICE))


def _check_matmul_invariance(dtype):
    K, N = 96, 130
    w = _randn(N, K, seed=10, dtype=dtype)
    row = _randn(1, K, seed=11, dtype=dtype)
    alone = matmul_fixed(row, w)
    for M, pos in [(37, 0), (37, 17), (37, 36), (130, 64), (130, 129)]:
        batch = _randn(M, K, seed=100 + M + pos, dtype=dtype)
        batch[pos] = row[0]
        out = matmul_fixed(batch, w)
        assert torch.equal(out[pos : pos + 1], alone), (M, pos)


# the plans bench/kernels/pinned_plans.py's head family weighs (None: the shipped plan of the operands' dtype)
PLANS = [None, (64, 64, 32, 4, 3), (64, 64, 64, 4, 4), (64, 128, 128, 8, 3), (64, 256, 64, 8, 3)]


@pytest.mark.parametrize("plan", PLANS)
def test_matmul_batch_invariant_fp32(monkeypatch, plan):
    if plan is not None:
        monkeypatch.setattr(invariant, "MATMUL_PLAN_FP32", plan)
    _check_matmul_invariance(torch.float32)


def test_rowsum_matches_reference():
    for shape in [(1, 1), (3, 100), (4, 128), (2, 5, 300), (7, 1000)]:
        x = _randn(*shape, seed=sum(shape))
        y = rowsum(x)
        assert y.shape == shape[:-1] and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), x.double().sum(-1), rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)


def test_rowsum_empty():
    assert rowsum(torch.empty(0, 10, device=DEVICE)).shape == (0,)
    y = rowsum(torch.empty(3, 0, device=DEVICE))
    assert y.shape == (3,) and torch.equal(y, torch.zeros(3, device=DEVICE))
    assert rowsum(torch.empty(2, 0, 0, device=DEVICE)).shape == (2, 0)
    assert torch.equal(rowsum(torch.tensor([1.0, 2.0], device=DEVICE)), torch.tensor(3.0, device=DEVICE))


def _check_rowsum_invariance(dtype):
    row = _randn(100, seed=20, dtype=dtype)
    alone = rowsum(row[None])
    batch = _randn(50, 100, seed=21, dtype=dtype)
    for pos in (0, 23, 49):
        b = batch.clone()
        b[pos] = row
        assert torch.equal(rowsum(b)[pos : pos + 1], alone), pos
    for L in (128, 300, 1000):
        padded = torch.zeros(2, L, dtype=dtype, device=DEVICE)
        padded[0, :100] = row
        padded[1] = _randn(L, seed=L, dtype=dtype)
        assert torch.equal(rowsum(padded)[:1], alone), L


def test_rowsum_batch_and_padding_invariant_fp32():
    _check_rowsum_invariance(torch.float32)


def test_bad_inputs_raise():
    x = _randn(4, 8, seed=30)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        matmul_fixed(x, _randn(5, 8, seed=31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        matmul_fixed(x.half(), _randn(5, 8, seed=31).half())
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        matmul_fixed(x, _randn(5, 9, seed=32))
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        matmul_fixed(x, _randn(5, 8, 1, seed=33))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rowsum(x.half())


@gpu_only
@pytest.mark.parametrize("plan", PLANS)
def test_gpu_bf16_matmul_and_invariance(monkeypatch, plan):
    if plan is not None:
        monkeypatch.setattr(invariant, "MATMUL_PLAN", plan)
    x = _randn(130, 96, seed=40, dtype=torch.bfloat16)
    w = _randn(130, 96, seed=41, dtype=torch.bfloat16)
    y = matmul_fixed(x, w, out_dtype=torch.float32)
    ref = _ref_matmul(x, w)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(matmul_fixed(x, w).float(), (x @ w.T).float(), rtol=1e-2, atol=1e-2)
    _check_matmul_invariance(torch.bfloat16)
    _check_rowsum_invariance(torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_invariance_at_model_widths(dtype):
    """A row's product is bit-identical for every batch size, at V4-Flash widths (hidden 4096)."""
    w = _randn(2048, 4096, seed=50, dtype=dtype)
    rows = _randn(4096, 4096, seed=51, dtype=dtype)
    first = matmul_fixed(rows[:1], w)
    for m in (7, 64, 65, 1000, 4096):
        assert torch.equal(matmul_fixed(rows[:m], w)[:1], first), m
    assert torch.equal(matmul_fixed(torch.cat([rows[1:300], rows[:1]]), w)[-1:], first)
