"""``NvidiaOps.topk_indices`` / ``select_rows`` through packed unique keys
(``deepinfer.backends.nvidia.topk.packed_keys``) against the reference's stable sorts. On the CPU ``packed_topk=True``
forces the packed path, so the packing and the selection are checked here bit for bit; the CUDA test checks the default
(auto) path on a GPU against the reference computed on the CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.nvidia import NvidiaOps  # noqa: E402
from deepinfer.backends.nvidia.topk import packed_keys, packed_select_rows  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.models.deepseek_v4.compressor import Indexer  # noqa: E402

REF = ReferenceOps()
NEG, POS, NAN = float("-inf"), float("inf"), float("nan")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA device"
)


@pytest.fixture(scope="module")
def packed() -> NvidiaOps:
    """The nvidia op set with the packed path forced on every device."""
    return NvidiaOps(packed_topk=True)


def tied_scores(shape: tuple[int, ...], seed: int, levels: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small integer-valued scores (many ties), some -0.0 among the zeros."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-levels, levels + 1, shape, generator=g).float()
    zeros = (s == 0) & (torch.rand(shape, generator=g) < 0.5)
    return s.masked_fill(zeros, -0.0).to(dtype)


def masked(scores: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` masked to -inf past a random visible prefix per row (some rows see nothing), and that mask."""
    g = torch.Generator().manual_seed(seed)
    width = scores.shape[-1]
    lead = scores.shape[:-1]
    seen = torch.randint(0, width + 1, lead, generator=g)
    seen.view(-1)[0] = width  # one row sees everything
    visible = torch.arange(width) < seen.unsqueeze(-1)
    return scores.masked_fill(~visible, NEG), visible


def check_select(ops: NvidiaOps, scores: torch.Tensor, visible: torch.Tensor, k: int) -> None:
    """The packed ``select_rows`` against the reference: same shapes and counts, equal rows up to each count, and
    every entry past it a row index in ``[0, W)``."""
    rows, count = ops.select_rows(scores, visible, k)
    ref_rows, ref_count = REF.select_rows(scores.cpu(), visible.cpu(), k)
    rows, count = rows.cpu(), count.cpu()
    assert rows.dtype == count.dtype == torch.long
    assert rows.shape == ref_rows.shape and torch.equal(count, ref_count)
    valid = torch.arange(rows.shape[-1]) < count.unsqueeze(-1)
    assert torch.equal(rows[valid], ref_rows[valid])
    assert bool(((rows >= 0) & (rows < scores.shape[-1])).all())


def test_packed_keys_order_special_values():
    s = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, NAN, -NAN, POS, NEG, 0.0, -1.0, 1e-45, -1e-45, NAN]])
    keys = packed_keys(s)
    assert keys.unique().numel() == keys.numel()
    order = torch.sort(keys, dim=-1, descending=True).indices
    assert torch.equal(order, torch.sort(s, dim=-1, descending=True, stable=True).indices)
    value = torch.div(keys, 1 << 32, rounding_mode="floor")
    assert value[0, 0] == value[0, 1] == 0  # -0.0 and +0.0 tie
    assert value[0, 5] == value[0, 6] == value[0, 13] > value[0, 7]  # every NaN ties, above +inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,k", [((7, 300), 64), ((3, 40), 40), ((5, 33), 1), ((2, 3, 50), 17), ((9,), 4)])
def test_topk_indices_equal_the_stable_sort(packed: NvidiaOps, dtype: torch.dtype, shape: tuple, k: int):
    for seed in range(3):
        scores, _ = masked(tied_scores(shape, seed, dtype=dtype), seed + 100)
        assert torch.equal(packed.topk_indices(scores, k), REF.topk_indices(scores, k))


def test_topk_indices_k_beyond_width_and_continuous_scores(packed: NvidiaOps):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 20, generator=g)
    assert torch.equal(packed.topk_indices(scores, 30), REF.topk_indices(scores, 30))
    assert packed.topk_indices(scores, 30).shape == (6, 20)
    wide = torch.randn(4, 5000, generator=g).bfloat16()  # bf16: many accidental ties
    assert torch.equal(packed.topk_indices(wide, 512), REF.topk_indices(wide, 512))


def test_routing_topk_is_bit_identical(packed: NvidiaOps):
    """The MoE router's use: ``[T, 256]`` biased scores, k = 6 (here with forced ties among experts)."""
    g = torch.Generator().manual_seed(2)
    scores = torch.nn.functional.softplus(torch.randn(64, 256, generator=g)).sqrt()
    bias = torch.randn(256, generator=g) * 0.1
    biased = scores + bias
    biased[:, 128:] = biased[:, :128]  # every expert ties with its twin 128 apart
    biased[::3] = (biased[::3] * 4).round() / 4  # coarse values: ties inside a row too
    got = packed.topk_indices(biased, 6)
    assert got.dtype == torch.long and torch.equal(got, REF.topk_indices(biased, 6))


def test_special_values_in_topk_and_select(packed: NvidiaOps):
    s = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, POS, NEG, 0.0, -1.0, -0.0, POS, NEG]])
    for k in (1, 3, 5, 8, 12):
        assert torch.equal(packed.topk_indices(s, k), REF.topk_indices(s, k))
        check_select(packed, s, torch.ones_like(s, dtype=torch.bool), k)
        check_select(packed, s, torch.arange(12).unsqueeze(0) % 3 != 1, k)
    nan = torch.tensor([[1.0, NAN, 2.0, -NAN, POS, NAN]])  # the CPU sort's NaN order: above +inf, tied
    assert torch.equal(packed.topk_indices(nan, 6), REF.topk_indices(nan, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,k", [((6, 300), 64), ((4, 64), 64), ((4, 40), 64), ((5, 1), 1), ((2, 3, 90), 20), ((1, 2000), 512)]
)
def test_select_rows_matches_the_reference(packed: NvidiaOps, dtype: torch.dtype, shape: tuple, k: int):
    for seed in range(3):
        scores, visible = masked(tied_scores(shape, seed, dtype=dtype), seed + 7)
        check_select(packed, scores, visible, k)
        check_select(packed, scores, torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.7, k)


def test_select_rows_with_unmasked_invisible_rows(packed: NvidiaOps):
    """Invisible rows that outscore the visible ones still take a top-k slot (as in the reference), and are not
    counted."""
    scores = torch.tensor([[5.0, 1.0, 9.0, 2.0, 9.0, 0.0, 3.0]])
    visible = torch.tensor([[True, True, False, True, True, False, True]])
    rows, count = packed.select_rows(scores, visible, 3)
    assert count.tolist() == [2] and rows[0, :2].tolist() == [0, 4]
    assert sorted(rows[0, 2:].tolist()) == [2]
    check_select(packed, scores, visible, 3)


def test_select_rows_empty(packed: NvidiaOps):
    scores, visible = torch.zeros(0, 10), torch.zeros(0, 10, dtype=torch.bool)
    rows, count = packed.select_rows(scores, visible, 4)
    assert rows.shape == (0, 4) and count.shape == (0,)
    rows, count = packed.select_rows(torch.zeros(3, 10), torch.ones(3, 10, dtype=torch.bool), 0)
    assert rows.shape == (3, 0) and count.tolist() == [0, 0, 0]


def test_auto_path_keeps_the_reference_off_cuda():
    """Without ``packed_topk`` the CPU (and short rows, and non-float scores) keep the reference's sorts."""
    ops = NvidiaOps()
    assert not ops._packs(torch.zeros(2, 10000))
    assert not NvidiaOps(packed_topk=True)._packs(torch.zeros(2, 100, dtype=torch.float64))
    assert not NvidiaOps(packed_topk=False)._packs(torch.zeros(2, 100))
    assert NvidiaOps(packed_topk=True)._packs(torch.zeros(2, 100))


class PackedReferenceOps(ReferenceOps):
    """The reference ops with the packed ``select_rows`` (the indexer's scores stay the reference's)."""

    def select_rows(self, scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_select_rows(scores, visible, k)


def test_indexer_select_ranges_keeps_its_results():
    """``Indexer.select_ranges`` through ``ops.select_rows``: the reference gives exactly the former inline code's
    rows and counts, the packed path the same rows up to each count."""
    g = torch.Generator().manual_seed(3)
    n, h, d, width = 6, 2, 8, 50
    q = torch.randn(n, h, d, generator=g).round()  # coarse values: tied scores
    w = torch.rand(n, h, generator=g).round() - 0.5
    keys = torch.randn(70, d, generator=g).round()
    start = torch.randint(0, 30, (n,), generator=g)
    visible_rows = torch.randint(0, width + 1, (n,), generator=g)
    indexer = SimpleNamespace(topk=12)
    rows, count = Indexer.select_ranges(indexer, q, w, visible_rows, keys, start, width, REF)
    visible = torch.arange(width).unsqueeze(0) < visible_rows.unsqueeze(1)
    scores = REF.indexer_scores_ranges(q, keys, w, start, width).masked_fill(~visible, NEG)
    top = REF.topk_indices(scores, 12)
    chosen = torch.zeros_like(visible).scatter_(1, top, True) & visible
    assert torch.equal(rows, torch.sort((~chosen).to(torch.uint8), dim=1, stable=True).indices[:, :12])
    assert torch.equal(count, chosen.sum(1))
    p_rows, p_count = Indexer.select_ranges(indexer, q, w, visible_rows, keys, start, width, PackedReferenceOps())
    valid = torch.arange(12) < count.unsqueeze(1)
    assert torch.equal(p_count, count) and torch.equal(p_rows[valid], rows[valid])


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,width,k", [(1, 1280, 512), (3, 5120, 512), (2, 32768, 512), (64, 256, 6), (5, 300, 512)])
def test_cuda_path_matches_the_cpu_reference(dtype: torch.dtype, n: int, width: int, k: int):
    """The packed path on CUDA (forced for every width; the default takes it above ``packed_above`` for
    ``topk_indices``; ``select_rows`` on CUDA defaults to the kernel, ``tests/kernels/test_topk.py``) against the
    reference on the CPU (the CPU's stable sort defines the tie rule, ±0.0 included)."""
    ops = NvidiaOps(packed_topk=True)
    ops.select_backend = "packed"
    rows = NvidiaOps.packed_rows  # the default packs from this many rows of more than packed_above columns
    assert NvidiaOps()._packs(torch.zeros(rows, width, device="cuda", dtype=dtype)) == (width > NvidiaOps.packed_above)
    for seed in range(2):
        levels = 3 if seed == 0 else 1000  # heavy ties, then few
        scores, visible = masked(tied_scores((n, width), seed, levels=levels, dtype=dtype), seed + 11)
        cuda_scores, cuda_visible = scores.cuda(), visible.cuda()
        got = ops.topk_indices(cuda_scores, min(k, width))
        assert got.is_cuda and torch.equal(got.cpu(), REF.topk_indices(scores, min(k, width)))
        check_select(ops, cuda_scores, cuda_visible, k)


@needs_gpu
def test_cuda_select_rows_captures_in_a_graph():
    ops = NvidiaOps(packed_topk=True)
    ops.select_backend = "packed"
    scores, visible = masked(tied_scores((4, 8192), 0, levels=50), 1)
    cuda_scores, cuda_visible = scores.cuda(), visible.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.select_rows(cuda_scores, cuda_visible, 512)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, count = ops.select_rows(cuda_scores, cuda_visible, 512)
    fresh, _ = masked(tied_scores((4, 8192), 5, levels=50), 1)
    cuda_scores.copy_(fresh.cuda())
    graph.replay()
    torch.cuda.synchronize()
    ref_rows, ref_count = REF.select_rows(fresh, visible, 512)
    assert torch.equal(count.cpu(), ref_count)
    valid = torch.arange(512) < ref_count.unsqueeze(-1)
    assert torch.equal(rows.cpu()[valid], ref_rows[valid])
