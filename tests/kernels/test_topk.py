"""``deepinfer.kernels.topk.select_rows`` (the radix-select kernel) against ``ReferenceOps.select_rows``: equal
``count`` and ``rows[..., :count]``, and past ``count`` the chosen invisible columns, descending. Without a GPU the
kernel runs in Triton's interpreter on fp32 scores (small blocks, so rows span several chunks); the CUDA tests check
the decode shapes against the reference computed on the CPU, and a CUDA-graph capture."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.nvidia import NvidiaOps  # noqa: E402
from deepinfer.backends.nvidia.topk import packed_topk_indices  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels.topk import select_rows, topk_rows  # noqa: E402

REF = ReferenceOps()
NEG, POS, NAN = float("-inf"), float("inf"), float("nan")
host = pytest.mark.skipif(  # these run the kernel on host tensors: Triton's interpreter only (conftest sets it on CPU)
    os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on host tensors needs TRITON_INTERPRET=1"
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA device"
)


def tied(shape: tuple[int, ...], seed: int, levels: int = 3) -> torch.Tensor:
    """Small integer scores (many ties), half of the zeros -0.0."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-levels, levels + 1, shape, generator=g).float()
    return s.masked_fill((s == 0) & (torch.rand(shape, generator=g) < 0.5), -0.0)


def prefix_masked(scores: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row visible up to a random length (the first row fully, the second not at all), -inf past it."""
    g = torch.Generator().manual_seed(seed)
    width = scores.shape[-1]
    seen = torch.randint(0, width + 1, scores.shape[:-1], generator=g)
    seen.view(-1)[0] = width
    if seen.numel() > 1:
        seen.view(-1)[1] = 0
    visible = torch.arange(width) < seen.unsqueeze(-1)
    return scores.masked_fill(~visible, NEG), visible


def check(scores: torch.Tensor, visible: torch.Tensor, k: int, block: int | None = None) -> torch.Tensor:
    """The kernel against the reference (computed on the CPU); returns ``count``."""
    rows, count = select_rows(scores, visible, k, block)
    rows, count = rows.cpu(), count.cpu()
    scores, visible = scores.cpu(), visible.cpu()
    ref_rows, ref_count = REF.select_rows(scores, visible, k)
    assert rows.dtype == count.dtype == torch.long and rows.shape == ref_rows.shape
    assert torch.equal(count, ref_count)
    valid = torch.arange(rows.shape[-1]) < count.unsqueeze(-1)
    assert torch.equal(rows[valid], ref_rows[valid])
    top = REF.topk_indices(scores, k).reshape(-1, rows.shape[-1])
    shown = visible.reshape(-1, visible.shape[-1]).gather(-1, top)
    for r, c, t, s in zip(rows.reshape(-1, rows.shape[-1]), count.view(-1), top, shown):  # the tail, descending
        assert r[c:].tolist() == sorted(t[~s].tolist(), reverse=True)
    return count


def mixed_masks(scores: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 visible up to a random length and -inf past it, row 1 visible everywhere, row 2 nowhere (all -inf),
    the other rows a random mask over finite scores (invisible columns may outscore the visible ones)."""
    g = torch.Generator().manual_seed(seed)
    width = scores.shape[-1]
    visible = torch.rand(scores.shape, generator=g) < 0.6
    visible[0] = torch.arange(width) < int(torch.randint(1, width + 1, (), generator=g))
    visible[1:2], visible[2:3] = True, False
    scores = scores.clone()
    scores[:3] = scores[:3].masked_fill(~visible[:3], NEG)
    return scores, visible


@host
@pytest.mark.parametrize(
    "n,width,k,block",
    [
        (4, 50, 8, 16),  # group maxima of 4 columns; W not a multiple of the block
        (4, 200, 2, 64),  # k = 2
        (4, 100, 40, 32),  # W < 4k: the exact histogram
        (3, 64, 64, 16),  # W == k: every column
        (3, 20, 64, 16),  # W < k
    ],
)
def test_ties_and_masks_match_the_reference(n: int, width: int, k: int, block: int):
    check(*mixed_masks(tied((n, width), seed=width + k), seed=k), k, block)
    check(torch.tensor([[2.0]]), torch.tensor([[True]]), 4, 16)  # one column


@host
def test_continuous_scores_resolve_every_digit():
    """Distinct fp32 scores (three digit passes inside a coarse bin), scores packed into one coarse bin, negative
    scores only, huge magnitudes (clamped bins), and one repeated value (no digit pass)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.stack(
        [
            torch.randn(300, generator=g),
            1 + torch.rand(300, generator=g) * 1e-3,
            -torch.rand(300, generator=g) - 1e-3,
            torch.randn(300, generator=g) * 1e30,
            torch.full((300,), 0.5),
        ]
    )
    check(*mixed_masks(scores, seed=2), 37, 128)


@host
def test_special_values():
    """±0.0 tie (the lower column wins), NaN (any sign) ranks above +inf, -inf below everything, denormals."""
    row = [0.0, -0.0, 1.0, -0.0, NAN, POS, NEG, -NAN, 1e-45, -1e-45, -1.0, 0.0, POS, NEG, 3e38, -3e38]
    scores = torch.tensor([row, row[::-1], [-0.0, 0.0] * 8])
    visible = (torch.arange(48) % 3 != 1).view(3, 16)
    for k in (1, 6, 15):
        check(scores, visible, k, 16)


@host
def test_fewer_finite_scores_than_k():
    """Rows whose finite scores number at most k: all of them, then the first -inf columns."""
    scores = torch.full((3, 90), NEG)
    scores[0, [5, 40, 77]] = torch.tensor([1.0, -2.0, 1.0])
    scores[1, :10] = 0.0
    visible = torch.ones(3, 90, dtype=torch.bool)
    visible[0, 41:] = False
    assert check(scores, visible, 10, 32).tolist() == [9, 10, 10]  # row 0: column 77 is chosen, invisible


@host
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores(dtype: torch.dtype):
    g = torch.Generator().manual_seed(2)
    scores = (torch.randn(1, 150, generator=g) * 4).to(dtype)
    check(scores, torch.rand(1, 150, generator=g) < 0.7, 24, 64)


@host
def test_shapes_and_errors():
    scores, visible = prefix_masked(tied((2, 2, 40), seed=3), seed=4)
    check(scores, visible, 5, 64)  # leading dims
    rows, count = select_rows(torch.zeros(0, 10), torch.zeros(0, 10, dtype=torch.bool), 4)
    assert rows.shape == (0, 4) and count.shape == (0,)
    rows, count = select_rows(torch.zeros(3, 10), torch.ones(3, 10, dtype=torch.bool), 0)
    assert rows.shape == (3, 0) and count.tolist() == [0, 0, 0]
    with pytest.raises(TypeError):
        select_rows(torch.zeros(2, 8, dtype=torch.float64), torch.ones(2, 8, dtype=torch.bool), 2)
    with pytest.raises(ValueError):
        select_rows(torch.zeros(2, 8), torch.ones(2, 7, dtype=torch.bool), 2)


def test_nvidia_ops_backends():
    """``select_backend``: ``kernel`` forced off CUDA runs the interpreter; ``auto`` keeps the CPU on the reference
    (or on the packed path with ``packed_topk``); an unknown name is refused."""
    scores, visible = prefix_masked(tied((3, 70), seed=5), seed=6)
    ref_rows, ref_count = REF.select_rows(scores, visible, 9)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the kernel on host tensors: the interpreter only
    for backend in ("kernel", "packed", "reference", "auto")[0 if interpreted else 1 :]:
        ops = NvidiaOps(packed_topk=backend == "auto")
        ops.select_backend = backend
        rows, count = ops.select_rows(scores, visible, 9)
        valid = torch.arange(9) < ref_count.unsqueeze(-1)
        assert torch.equal(count, ref_count) and torch.equal(rows[valid], ref_rows[valid])
    assert NvidiaOps.select_backend == "auto"
    ops.select_backend = "sorted"
    with pytest.raises(ValueError):
        ops.select_rows(scores, visible, 9)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 64, 256])
@pytest.mark.parametrize("width", [1280, 5120, 32768])
def test_cuda_decode_shapes(n: int, width: int, dtype: torch.dtype):
    """k = 512 at the decode shapes: continuous scores (visible prefixes, -inf past them), then heavy ties."""
    g = torch.Generator().manual_seed(n + width)
    scores = torch.randn(n, width, generator=g).to(dtype)
    scores, visible = prefix_masked(scores, seed=n)
    check(scores.cuda(), visible.cuda(), 512)
    scores, visible = prefix_masked(tied((n, width), seed=width, levels=20).to(dtype), seed=n + 1)
    check(scores.cuda(), visible.cuda(), 512)


@needs_gpu
def test_cuda_nvidia_ops_takes_the_kernel():
    scores, visible = prefix_masked(tied((4, 3000), seed=7, levels=50), seed=8)
    rows, count = NvidiaOps().select_rows(scores.cuda(), visible.cuda(), 512)
    expected_rows, expected_count = select_rows(scores.cuda(), visible.cuda(), 512)
    assert torch.equal(rows, expected_rows) and torch.equal(count, expected_count)


@needs_gpu
def test_cuda_graph_capture_and_replay():
    scores, visible = prefix_masked(tied((64, 5120), seed=9, levels=50), seed=10)
    cuda_scores, cuda_visible = scores.cuda(), visible.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        select_rows(cuda_scores, cuda_visible, 512)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, count = select_rows(cuda_scores, cuda_visible, 512)
    for seed in (11, 12):
        fresh, seen = prefix_masked(torch.randn(64, 5120, generator=torch.Generator().manual_seed(seed)), seed)
        cuda_scores.copy_(fresh.cuda())
        cuda_visible.copy_(seen.cuda())
        graph.replay()
        torch.cuda.synchronize()
        ref_rows, ref_count = REF.select_rows(fresh, seen, 512)
        valid = torch.arange(512) < ref_count.unsqueeze(-1)
        assert torch.equal(count.cpu(), ref_count) and torch.equal(rows.cpu()[valid], ref_rows[valid])


# topk_rows: the routers' small top-k (one program a row)


@host
@pytest.mark.parametrize(("n", "width", "k"), [(1, 1, 1), (3, 7, 6), (5, 256, 6), (4, 384, 8), (2, 300, 32)])
def test_topk_rows_ties_match_the_stable_sort(n: int, width: int, k: int):
    for levels in (1, 3, 1000):
        scores = tied((n, width), seed=width + levels, levels=levels)
        assert torch.equal(topk_rows(scores, k), REF.topk_indices(scores, k))


@host
def test_topk_rows_special_values_and_dtypes():
    row = [0.0, -0.0, 1.0, -0.0, NAN, POS, NEG, -NAN, 1e-45, -1e-45, -1.0, 0.0, POS, NEG, 3e38, -3e38]
    scores = torch.tensor([row, row[::-1], [-0.0, 0.0] * 8])
    for k in (1, 6, 16):
        got = topk_rows(scores, k)
        # NaN above +inf and tied with the other NaNs, as packed_keys (the CPU sort's order)
        assert torch.equal(got, packed_topk_indices(scores, k))
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        s = torch.randn(6, 256, generator=g).to(dtype)
        assert torch.equal(topk_rows(s, 6), REF.topk_indices(s, 6))
    assert topk_rows(torch.randn(2, 3, 40), 6).shape == (2, 3, 6)
    assert topk_rows(torch.randn(0, 40), 6).shape == (0, 6)
    with pytest.raises(ValueError, match="at most"):
        topk_rows(torch.randn(2, 5000), 6)
    with pytest.raises(ValueError, match="k <= 32"):
        topk_rows(torch.randn(2, 50), 33)
    with pytest.raises(TypeError):
        topk_rows(torch.zeros(2, 5, dtype=torch.int32), 2)


@needs_gpu
def test_cuda_topk_rows_router_shapes_and_graph():
    g = torch.Generator().manual_seed(4)
    for n in (1, 64, 4096):
        scores = tied((n, 256), seed=n, levels=20) + torch.rand(n, 256, generator=g) * 0.5
        assert torch.equal(NvidiaOps().topk_indices(scores.cuda(), 6).cpu(), REF.topk_indices(scores, 6))
    s = torch.randn(64, 384, device="cuda")
    topk_rows(s, 6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_rows(s, 6)
    fresh = torch.randn(64, 384)
    s.copy_(fresh.cuda())
    graph.replay()
    assert torch.equal(out.cpu(), REF.topk_indices(fresh, 6))
