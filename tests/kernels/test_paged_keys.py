"""Sparse attention and indexer scores over keys read from a paged store (``kernels.paged_keys``, the ``paged``
argument of ``sparse_attention_gather``, ``indexer_scores_ranges`` and the ops): the same outputs, bit for bit, as
over the gathered pool the pages stand for, in both attention modes; the reference ops gather; a store the kernel
cannot read is refused or, through ``NvidiaOps``, gathered. In Triton's interpreter without a GPU, compiled on one."""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import attention_split  # noqa: E402
from deepinfer.kernels.attention import ATTN_BLOCK_N, sparse_attention_gather  # noqa: E402
from deepinfer.kernels.paged_keys import gathered  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _case(seed: int, dtype: torch.dtype = torch.float32):
    """A window pool of 20 rows and a store of 9 pages of 4 rows; three queries listing window rows, then rows of their
    own 3 pages (pages 7, 2, 5 / 0, 8, 1 / 3, 6, 4), garbage past their counts."""
    g = torch.Generator().manual_seed(seed)
    n, H, d, R = 3, 4, 32, 4
    window = torch.randn(20, d, generator=g).to(DEVICE, dtype)
    store = torch.randn(9, R, d, generator=g).to(DEVICE, dtype)
    pages = torch.tensor([7, 2, 5, 0, 8, 1, 3, 6, 4], device=DEVICE)
    per_row = 3 * R
    idx = torch.randint(-(10**6), 10**6, (n, 40), generator=g)
    counts = [0, 17, 30]
    for i, c in enumerate(counts):
        own = 20 + i * per_row + torch.randperm(per_row, generator=g)
        lst = torch.cat([torch.randperm(20, generator=g)[: max(c - per_row, 0)], own])[:c]
        idx[i, :c] = lst
    q = torch.randn(n, H, d, generator=g).to(DEVICE, dtype)
    sink = torch.randn(H, generator=g).to(DEVICE)
    return q, window, (store, pages), idx.to(DEVICE), torch.tensor(counts, device=DEVICE), sink, d**-0.5


@pytest.mark.parametrize("split", [False, True])
def test_paged_keys_read_what_the_gather_holds(split, monkeypatch):
    monkeypatch.setattr(attention_split, "SPLIT_CHUNK", ATTN_BLOCK_N)  # several splits for short lists
    q, window, paged, idx, count, sink, scale = _case(1)
    pool = gathered(window, paged)
    assert pool.shape == (20 + 9 * 4, 32) and torch.equal(pool[20 + 4 : 28], paged[0][2])  # page 2 after page 7
    want = sparse_attention_gather(q, pool, idx, count, sink, scale, split=split)
    got = sparse_attention_gather(q, window, idx, count, sink, scale, split=split, paged=paged)
    assert torch.equal(got, want)
    ref = ReferenceOps().sparse_attention_lists(q, window, idx, count, sink, scale, paged=paged)
    torch.testing.assert_close(ref, ReferenceOps().sparse_attention_lists(q, pool, idx, count, sink, scale))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_store_the_kernel_cannot_read_is_refused_or_gathered():
    from deepinfer.backends.nvidia import NvidiaOps

    q, window, (store, pages), idx, count, sink, scale = _case(2)
    with pytest.raises(ValueError, match="store"):
        sparse_attention_gather(q, window, idx, count, sink, scale, paged=(store.double(), pages))
    with pytest.raises(ValueError, match="store"):
        sparse_attention_gather(q, window, idx, count, sink, scale, paged=(store[..., :16], pages))
    # a store of another dtype through the op set: gathered with torch.cat's promotion, then the kernel
    got = NvidiaOps().sparse_attention_lists(q, window, idx, count, sink, scale, paged=(store.double(), pages))
    want = sparse_attention_gather(q, gathered(window, (store, pages)), idx, count, sink, scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_indexer_range_scores_read_the_pages():
    """``indexer_scores_ranges`` with every key in a paged store: query ``t`` scores keys ``start[t] ..+ width`` of the
    pool the pages stand for (0 past its end), bit for bit the scores of the gathered pool; the reference gathers."""
    from deepinfer.kernels.indexer import indexer_scores_ranges

    g = torch.Generator().manual_seed(5)
    n, nh, d, R = 3, 4, 32, 4
    store = torch.randn(9, R, d, generator=g).to(DEVICE)
    pages = torch.tensor([7, 2, 5, 0, 8, 1, 3, 6, 4], device=DEVICE)
    q, w = torch.randn(n, nh, d, generator=g).to(DEVICE), torch.rand(n, nh, generator=g).to(DEVICE)
    start = torch.tensor([0, 12, 30], device=DEVICE)  # the last range runs past the pool's 36 rows
    none = store.new_empty(0, d)
    pool = gathered(none, (store, pages))
    want = indexer_scores_ranges(q, pool, w, start, 12)
    got = indexer_scores_ranges(q, none, w, start, 12, paged=(store, pages))
    assert torch.equal(got, want) and torch.equal(got[2, 6:], torch.zeros(6, device=DEVICE))
    ref = ReferenceOps().indexer_scores_ranges(q, none, w, start, 12, paged=(store, pages))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pages alone"):
        indexer_scores_ranges(q, pool, w, start, 12, paged=(store, pages))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_bf16_at_v4_flash_widths(n):
    """A decode step's shapes in bf16 (64 heads of 512, a 128-row window a row, 32 compressed rows a page, 8 pages a
    row; the indexer's 64 heads of 128): paged attention (both modes: the split one at 1 row) and paged range scores
    equal the gathered pool's, bit for bit."""
    from deepinfer.kernels.indexer import indexer_scores_ranges

    g = torch.Generator(device=DEVICE).manual_seed(n)
    H, d, W, R, P = 64, 512, 128, 32, 8
    window = torch.randn(n * W, d, generator=g, device=DEVICE).bfloat16()
    store = torch.randn(n * P + 3, R, d, generator=g, device=DEVICE).bfloat16()
    pages = torch.randperm(n * P + 3, generator=g, device=DEVICE)[: n * P]
    q = torch.randn(n, H, d, generator=g, device=DEVICE).bfloat16()
    sink = torch.randn(H, generator=g, device=DEVICE)
    rows = torch.arange(n, device=DEVICE)[:, None]
    own_window = rows * W + torch.arange(W, device=DEVICE)
    own_paged = n * W + rows * P * R + torch.randperm(P * R, generator=g, device=DEVICE)[: 3 * W // 2]
    idx = torch.cat([own_window, own_paged], dim=1)
    count = torch.full((n,), idx.shape[1], device=DEVICE)
    pool = gathered(window, (store, pages))
    for split in (False, True):
        want = sparse_attention_gather(q, pool, idx, count, sink, d**-0.5, split=split)
        got = sparse_attention_gather(q, window, idx, count, sink, d**-0.5, split=split, paged=(store, pages))
        assert torch.equal(got, want)
    iq = torch.randn(n, 64, 128, generator=g, device=DEVICE).bfloat16()
    iw = torch.rand(n, 64, generator=g, device=DEVICE)
    ikeys = torch.randn(n * P + 3, R, 128, generator=g, device=DEVICE).bfloat16()
    start = torch.arange(n, device=DEVICE) * P * R
    none = ikeys.new_empty(0, 128)
    want = indexer_scores_ranges(iq, gathered(none, (ikeys, pages)), iw, start, P * R)
    assert torch.equal(indexer_scores_ranges(iq, none, iw, start, P * R, paged=(ikeys, pages)), want)
