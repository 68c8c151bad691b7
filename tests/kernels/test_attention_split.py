"""The key-list split of the sparse attention (deepinfer.kernels.attention_split, ``split=True``).

In the interpreter (no GPU) the split size is cut to 64 list entries (two 32-key blocks) so that small lists give
several splits; on a CUDA machine with ``TRITON_INTERPRET`` unset the same tests compile and run for real, plus bf16
checks at the real model shapes with the real split size.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import attention, attention_split  # noqa: E402
from deepinfer.kernels.attention import ATTN_BLOCK_N, sparse_attention_gather, use_split  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
CHUNK = 2 * ATTN_BLOCK_N


@pytest.fixture
def small_chunk(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(attention_split, "SPLIT_CHUNK", CHUNK)
    return CHUNK


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def _lists(n: int, W: int, K: int, counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct valid key rows per query, garbage (out of range, negative) past ``count``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-(10**6), 10**6, (n, W), generator=g)
    for i, c in enumerate(counts):
        idx[i, :c] = torch.randperm(K, generator=g)[:c]
    return idx.to(torch.int32).to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)


def _case(n: int, H: int, d: int, K: int, W: int, counts: list[int], seed: int, dtype: torch.dtype = torch.float32):
    q, keys, sink = _randn(n, H, d, seed=seed, dtype=dtype), _randn(K, d, seed=seed + 1, dtype=dtype), _randn(H, seed=2)
    idx, count = _lists(n, W, K, counts, seed + 3)
    return q, keys, idx, count, sink, d**-0.5


def test_split_matches_the_reference_ops(small_chunk: int) -> None:
    # empty, one key, a partial split, exactly one and two splits (ends on a boundary), one past, the full width
    counts = [0, 1, 40, small_chunk, 2 * small_chunk, 2 * small_chunk + 1, 200]
    q, keys, idx, count, sink, scale = _case(len(counts), 5, 48, 300, 200, counts, seed=10)
    out = sparse_attention_gather(q, keys, idx, count, sink, scale, split=True)
    ref = ReferenceOps().sparse_attention_lists(q, keys, idx, count, sink, scale)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # count 0: zeros
    unsplit = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False)
    torch.testing.assert_close(out, unsplit, rtol=1e-5, atol=1e-5)


def test_split_is_invariant_to_batch_and_list_width(small_chunk: int) -> None:
    counts = [3 * small_chunk, 70, 0, 2 * small_chunk + 9]
    H, d, K, W = 4, 32, 400, 3 * small_chunk
    q, keys, idx, count, sink, scale = _case(len(counts), H, d, K, W, counts, seed=20)
    full = sparse_attention_gather(q, keys, idx, count, sink, scale, split=True)
    for pos, c in enumerate(counts):  # each query alone, its list cut to its count (fewer splits launched)
        alone = sparse_attention_gather(
            q[pos : pos + 1], keys, idx[pos : pos + 1, :c], count[pos : pos + 1], sink, scale, split=True
        )
        assert torch.equal(full[pos : pos + 1], alone)
    # the same queries after two others, their lists padded wider with garbage (more, empty, splits launched)
    pad, _ = _lists(len(counts) + 2, W + 2 * small_chunk + 5, K, [0] * (len(counts) + 2), seed=21)
    pad[2:, :W] = idx
    q2 = torch.cat([_randn(2, H, d, seed=22), q])
    count2 = torch.cat([torch.tensor([W, 5], dtype=torch.int32, device=DEVICE), count])
    pad[:2, :W] = torch.randint(0, K, (2, W)).to(DEVICE)
    assert torch.equal(sparse_attention_gather(q2, keys, pad, count2, sink, scale, split=True)[2:], full)


def test_one_split_is_the_unsplit_kernel(small_chunk: int) -> None:
    """With every count within one split the merge is exact: the unsplit kernel's bits (in the interpreter; a
    compiler may contract the two kernels' arithmetic differently)."""
    counts = [1, 17, small_chunk, 0]
    q, keys, idx, count, sink, scale = _case(len(counts), 3, 32, 100, 2 * small_chunk + 3, counts, seed=30)
    out = sparse_attention_gather(q, keys, idx, count, sink, scale, split=True)
    unsplit = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False)
    if INTERPRET:
        assert torch.equal(out, unsplit)
    else:
        torch.testing.assert_close(out, unsplit, rtol=1e-5, atol=1e-5)


def test_split_with_large_sinks(small_chunk: int) -> None:
    q, keys, idx, count, _, _ = _case(2, 2, 16, 300, 200, [200, 3 * small_chunk], seed=40)
    q = q * 4
    ref_ops = ReferenceOps()
    for sink in (torch.tensor([60.0, -60.0]), torch.tensor([-1e4, 1e4])):
        sink = sink.to(DEVICE)
        out = sparse_attention_gather(q, keys, idx, count, sink, 1.0, split=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(
            out, ref_ops.sparse_attention_lists(q, keys, idx, count, sink, 1.0), rtol=1e-5, atol=1e-5
        )


def test_split_false_is_the_unsplit_kernel_and_the_auto_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    q, keys, idx, count, sink, scale = _case(2, 3, 16, 90, 80, [80, 33], seed=50)
    want = torch.empty_like(q)
    attention._sparse_attention_kernel[(2, 1)](
        q,
        keys,
        keys,  # no paged store (PAGED off)
        idx,
        keys.shape[0],
        1,
        idx,
        count,
        sink,
        want,
        80,
        scale,
        H=3,
        D=16,
        BLOCK_D=16,
        BLOCK_H=16,
        BLOCK_N=ATTN_BLOCK_N,
        PRECISION="ieee",
    )
    assert torch.equal(sparse_attention_gather(q, keys, idx, count, sink, scale, split=False), want)
    assert use_split(1, 64) and use_split(32, 64) and not use_split(33, 64) and not use_split(256, 64)
    monkeypatch.setattr(attention, "ATTN_SPLIT_DEFAULT", False)
    assert not use_split(1, 64)
    monkeypatch.setattr(attention_split, "SPLIT_CHUNK", ATTN_BLOCK_N + 1)
    with pytest.raises(ValueError, match="SPLIT_CHUNK"):
        sparse_attention_gather(q, keys, idx, count, sink, scale, split=True)


@gpu_only
def test_gpu_bf16_split_real_shapes() -> None:
    """H = 64, d = 512, lists of 640 / 1152 entries at the real split size: close to the float64 formula and to the
    unsplit kernel, each query's bits independent of the batch and the list width."""
    from test_attention import _check_attention_invariance, _ref_attention, _rel

    for W in (640, 1152):
        n, K = 16, 6000
        g = torch.Generator().manual_seed(W)
        counts = [0, 1, 255, 256, 257, 512, W] + [int(c) for c in torch.randint(1, W + 1, (n - 7,), generator=g)]
        q, keys, idx, count, sink, scale = _case(n, 64, 512, K, W, counts, seed=W, dtype=torch.bfloat16)
        out = sparse_attention_gather(q, keys, idx, count, sink, scale, split=True)
        rel, rel_max = _rel(out, _ref_attention(q, keys, idx, count, sink, scale))
        assert rel < 2e-2 and rel_max < 5e-2, (rel, rel_max)
        _check_attention_invariance(n, 64, 512, K, W, counts, torch.bfloat16, split=True)
