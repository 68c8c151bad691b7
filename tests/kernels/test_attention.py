"""Batch-invariant sparse-attention and indexer kernels (deepinfer.kernels.attention).

Without a GPU they run through the Triton interpreter (fp32 only, tiny shapes); on a CUDA machine with
``TRITON_INTERPRET`` unset the same tests compile and run for real, plus bf16 checks at the real model shapes.
``TRITON_INTERPRET=1`` forces the interpreter on a GPU machine too.
"""

import os

# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU (before triton is imported) and patches the
# interpreter for NumPy >= 2.4 (tests/triton_interpreter.py)
import pytest
import torch  # does not import triton

pytest.importorskip("triton")

from deepinfer.kernels.attention import ATTN_BLOCK_N, sparse_attention_gather  # noqa: E402
from deepinfer.kernels.indexer import indexer_scores_fixed, indexer_scores_ranges  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype=dtype, device=DEVICE)


def _idx(n, W, K, counts, seed, dtype=torch.int32):
    """Distinct valid key rows per query, garbage (out-of-range, negative) beyond ``count``."""
    g = _gen(seed)
    idx = torch.randint(-(10**6), 10**6, (n, W), generator=g)
    for i, c in enumerate(counts):
        idx[i, :c] = torch.randperm(K, generator=g)[:c]
    return idx.to(dtype=dtype, device=DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)


def _ref_attention(q, keys, idx, count, sink, scale):
    """The formula in float64, one query at a time."""
    n, H, d = q.shape
    out = torch.zeros(n, H, d, dtype=torch.float64)
    sk, kd, idx, count = sink.double().cpu(), keys.double().cpu(), idx.long().cpu(), count.cpu()
    for i in range(n):
        c = int(count[i])
        if c == 0:
            continue
        k = kd[idx[i, :c]]  # [c, d]
        s = q[i].double().cpu() @ k.T * scale  # [H, c]
        m = torch.maximum(s.amax(-1), sk)
        e = torch.exp(s - m[:, None])
        den = e.sum(-1) + torch.exp(sk - m)
        out[i] = (e / den[:, None]) @ k
    return out


def _ref_indexer(q, keys, weights):
    s = torch.einsum("nhd,rd->nhr", q.double(), keys.double()).relu()
    return (s * weights.double().unsqueeze(-1)).sum(1)


def _close(out, ref, rtol):
    err = (out.double().cpu() - ref.cpu()).abs().max().item()
    assert err <= rtol * max(ref.abs().max().item(), 1.0), err


@pytest.mark.parametrize(("H", "d"), [(3, 16), (4, 48)])
def test_attention_matches_reference_fp32(H, d):
    n, K, W = 5, 90, 70
    counts = [0, 1, ATTN_BLOCK_N, ATTN_BLOCK_N + 5, W]  # empty, partial blocks, exactly one block, full width
    q = _randn(n, H, d, seed=d)
    keys = _randn(K, d, seed=d + 1)
    idx, count = _idx(n, W, K, counts, seed=d + 2, dtype=torch.int64 if d == 16 else torch.int32)
    sink = _randn(H, seed=d + 3)
    scale = d**-0.5
    out = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False)
    assert out.shape == (n, H, d) and out.dtype == torch.float32
    ref = _ref_attention(q, keys, idx, count, sink, scale)
    _close(out, ref, 2e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # count 0


def test_attention_large_sink_and_sharp_scores():
    n, H, d, K, W = 2, 2, 16, 40, 40
    q = _randn(n, H, d, seed=1) * 4
    keys = _randn(K, d, seed=2)
    idx, count = _idx(n, W, K, [40, 33], seed=3)
    for sink in (torch.tensor([60.0, -60.0]), torch.tensor([-1e4, 1e4])):
        sink = sink.to(DEVICE)
        out = sparse_attention_gather(q, keys, idx, count, sink, 1.0, split=False)
        ref = _ref_attention(q, keys, idx, count, sink, 1.0)
        assert torch.isfinite(out).all()
        _close(out, ref, 2e-5)


def _check_attention_invariance(n, H, d, K, W, counts, dtype, split=False, wide=None):
    """Query ``n // 2`` alone, in the batch, and in another batch with wider lists: the same bits (a fixed mode)."""
    q = _randn(n, H, d, seed=50, dtype=dtype)
    keys = _randn(K, d, seed=51, dtype=dtype)
    idx, count = _idx(n, W, K, counts, seed=52)
    sink = _randn(H, seed=53)
    scale = d**-0.5
    pos = n // 2
    alone = sparse_attention_gather(
        q[pos : pos + 1],
        keys,
        idx[pos : pos + 1, : counts[pos]],
        count[pos : pos + 1],
        sink,
        scale,
        split=split,
        wide=wide,
    )
    full = sparse_attention_gather(q, keys, idx, count, sink, scale, split=split, wide=wide)
    assert torch.equal(full[pos : pos + 1], alone)
    # the same query at another position of a different batch, its key list padded wider with garbage
    wide_idx, _ = _idx(n + 1, W + 2 * ATTN_BLOCK_N + 3, K, [0] * (n + 1), seed=54)
    wide_idx[:n, :W] = idx
    wide_idx[n] = wide_idx[pos]
    wide_idx[n, : counts[pos]] = idx[pos, : counts[pos]]
    q2 = torch.cat([_randn(n, H, d, seed=55, dtype=dtype), q[pos : pos + 1]])
    count2 = torch.cat([count, count[pos : pos + 1]])
    assert torch.equal(
        sparse_attention_gather(q2, keys, wide_idx, count2, sink, scale, split=split, wide=wide)[n:], alone
    )


def test_attention_batch_invariant_fp32():
    _check_attention_invariance(4, 3, 48, 80, 70, [5, 70, 37, 12], torch.float32)


def test_wide_tiles_match_reference_and_are_invariant_fp32():
    """The prefill tiles (``ATTN_WIDE``: all heads of a query in one program, 64 keys a step) on the same lists:
    the reference's values, and batch-invariant as a fixed mode; the lists run past several 64-key blocks."""
    n, H, d, K, W = 5, 6, 40, 300, 200
    q, keys = _randn(n, H, d, seed=90), _randn(K, d, seed=91)
    idx, count = _idx(n, W, K, [0, 1, 64, 65, 200], seed=92)
    sink = _randn(H, seed=93)
    out = sparse_attention_gather(q, keys, idx, count, sink, d**-0.5, split=False, wide=True)
    _close(out, _ref_attention(q, keys, idx, count, sink, d**-0.5), 2e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _check_attention_invariance(4, 3, 48, 80, 70, [5, 70, 37, 12], torch.float32, wide=True)


def test_the_automatic_mode_rule():
    from deepinfer.kernels.attention import ATTN_WIDE_MIN_QUERIES, use_split, use_wide

    assert use_split(1, 64) and not use_split(64, 64)  # 4 programs a query at 16 heads a program
    assert use_wide(ATTN_WIDE_MIN_QUERIES, torch.bfloat16) and not use_wide(ATTN_WIDE_MIN_QUERIES - 1, torch.bfloat16)
    assert not use_wide(4096, torch.float32)  # fp32 tiles of that size exceed the shared memory
    q, keys = _randn(1, 2, 16, seed=1), _randn(4, 16, seed=2)
    idx, count = _idx(1, 4, 4, [4], seed=3)
    with pytest.raises(ValueError, match="split=True takes the narrow tiles"):
        sparse_attention_gather(q, keys, idx, count, _randn(2, seed=4), 0.25, split=True, wide=True)


def test_indexer_matches_reference_fp32():
    for n, h, d, R in [(3, 4, 16, 70), (1, 8, 32, 64), (2, 4, 48, 5)]:
        q = _randn(n, h, d, seed=R)
        keys = _randn(R, d, seed=R + 1)
        weights = _randn(n, h, seed=R + 2)
        out = indexer_scores_fixed(q, keys, weights)
        assert out.shape == (n, R) and out.dtype == torch.float32
        _close(out, _ref_indexer(q, keys, weights), 2e-5)


def _check_indexer_invariance(n, h, d, R, dtype):
    q = _randn(n, h, d, seed=60, dtype=dtype)
    keys = _randn(R, d, seed=61, dtype=dtype)
    weights = _randn(n, h, seed=62)
    full = indexer_scores_fixed(q, keys, weights)
    for pos in (0, n - 1):
        assert torch.equal(indexer_scores_fixed(q[pos : pos + 1], keys, weights[pos : pos + 1]), full[pos : pos + 1])
    grown = torch.cat([keys, _randn(R // 2 + 7, d, seed=63, dtype=dtype)])
    assert torch.equal(indexer_scores_fixed(q, grown, weights)[:, :R], full)


def test_indexer_invariant_fp32():
    _check_indexer_invariance(3, 4, 32, 70, torch.float32)


def test_empty_inputs():
    q, keys, sink = _randn(0, 2, 16, seed=1), _randn(10, 16, seed=2), _randn(2, seed=3)
    idx = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert sparse_attention_gather(q, keys, idx, cnt, sink, 1.0).shape == (0, 2, 16)
    q = _randn(2, 2, 16, seed=4)
    idx = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert torch.equal(sparse_attention_gather(q, keys, idx, cnt, sink, 1.0), torch.zeros_like(q))
    w = _randn(2, 2, seed=5)
    assert indexer_scores_fixed(q, keys[:0], w).shape == (2, 0)
    assert indexer_scores_fixed(q[:0], keys, w[:0]).shape == (0, 10)


def test_bad_inputs_raise():
    q, keys, sink = _randn(2, 2, 16, seed=1), _randn(10, 16, seed=2), _randn(2, seed=3)
    idx, cnt = _idx(2, 4, 10, [4, 2], seed=4)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        sparse_attention_gather(q, keys.bfloat16(), idx, cnt, sink, 1.0)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        sparse_attention_gather(q.half(), keys.half(), idx, cnt, sink, 1.0)
    with pytest.raises(ValueError, match=r"keys \[K, d\]"):
        sparse_attention_gather(q, keys[:, :8], idx, cnt, sink, 1.0)
    with pytest.raises(ValueError, match="idx must be"):
        sparse_attention_gather(q, keys, idx.float(), cnt, sink, 1.0)
    with pytest.raises(ValueError, match="idx must be"):
        sparse_attention_gather(q, keys, idx[:1], cnt, sink, 1.0)
    with pytest.raises(ValueError, match="count must be"):
        sparse_attention_gather(q, keys, idx, cnt[:1], sink, 1.0)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_attention_gather(q, keys, idx, cnt, sink.double(), 1.0)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_attention_gather(q, keys, idx, cnt, sink[:1], 1.0)
    w = _randn(2, 2, seed=5)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        indexer_scores_fixed(q, keys.bfloat16(), w)
    with pytest.raises(ValueError, match=r"keys \[R, d\]"):
        indexer_scores_fixed(q, keys[None], w)
    with pytest.raises(ValueError, match="weights must be"):
        indexer_scores_fixed(q, keys, w.bfloat16())
    with pytest.raises(ValueError, match="weights must be"):
        indexer_scores_fixed(q, keys, w[:, :1])
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="one device"):
            sparse_attention_gather(q, keys, idx.cpu(), cnt, sink, 1.0)
        with pytest.raises(ValueError, match="are on"):
            indexer_scores_fixed(q, keys.cpu(), w)


def _rel(out, ref):
    out = out.double().cpu()
    return ((out - ref).norm() / ref.norm()).item(), (out - ref).abs().max().item() / ref.abs().max().item()


@gpu_only
def test_gpu_bf16_attention_real_shapes():
    n, H, d, K, W = 64, 64, 512, 5000, 640
    counts = [0, 1, 31, 32, 33, 127, 128, 129, 500, 640] + [
        int(c) for c in torch.randint(1, W + 1, (n - 10,), generator=_gen(7))
    ]
    q = _randn(n, H, d, seed=70, dtype=torch.bfloat16)
    keys = _randn(K, d, seed=71, dtype=torch.bfloat16)
    idx, count = _idx(n, W, K, counts, seed=72)
    sink = _randn(H, seed=73)
    scale = d**-0.5
    out = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False)
    assert out.dtype == torch.bfloat16
    ref = _ref_attention(q, keys, idx, count, sink, scale)
    rel, rel_max = _rel(out, ref)
    assert rel < 2e-2 and rel_max < 5e-2, (rel, rel_max)
    _check_attention_invariance(n, H, d, K, W, counts, torch.bfloat16, split=False)
    _check_attention_invariance(n, H, d, K, W, counts, torch.bfloat16, split=True)
    wide = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False, wide=True)
    rel, rel_max = _rel(wide, ref)
    assert rel < 2e-2 and rel_max < 5e-2, (rel, rel_max)
    _check_attention_invariance(n, H, d, K, W, counts, torch.bfloat16, split=False, wide=True)
    # a prefill's worth of queries takes the wide tiles by itself
    many = torch.cat([q] * 5), torch.cat([idx] * 5), torch.cat([count] * 5)
    auto = sparse_attention_gather(many[0], keys, many[1], many[2], sink, scale)
    assert torch.equal(auto[:n], wide)


@gpu_only
def test_gpu_fp32_attention_real_head_dim():
    """fp32 (IEEE products) at d=512 compiles too (slow, register-heavy: tests only) and agrees tightly."""
    n, H, d, K, W = 4, 64, 512, 5000, 640
    q = _randn(n, H, d, seed=74)
    keys = _randn(K, d, seed=75)
    idx, count = _idx(n, W, K, [0, 1, 333, 640], seed=76)
    sink = _randn(H, seed=77)
    scale = d**-0.5
    out32 = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False)
    _close(out32, _ref_attention(q, keys, idx, count, sink, scale), 2e-5)


@gpu_only
def test_gpu_bf16_indexer_real_shapes():
    n, h, d, R = 64, 64, 128, 1024
    q = _randn(n, h, d, seed=80, dtype=torch.bfloat16)
    keys = _randn(R, d, seed=81, dtype=torch.bfloat16)
    weights = _randn(n, h, seed=82)
    out = indexer_scores_fixed(q, keys, weights)
    rel, rel_max = _rel(out, _ref_indexer(q.cpu(), keys.cpu(), weights.cpu()))
    assert rel < 1e-2 and rel_max < 2e-2, (rel, rel_max)
    _check_indexer_invariance(n, h, d, R, torch.bfloat16)
    _check_indexer_invariance(n, h, d, R + 13, torch.float32)


def _check_ranges(n, h, d, R, width, dtype, rtol):
    q, keys, weights = _randn(n, h, d, seed=R, dtype=dtype), _randn(R, d, seed=R + 1, dtype=dtype), _randn(n, h, seed=3)
    start = torch.randint(-5, R, (n,), generator=_gen(R)).to(DEVICE)  # ranges that begin before or run past the keys
    out = indexer_scores_ranges(q, keys, weights, start, width)
    r = start.cpu().unsqueeze(1) + torch.arange(width)
    inside = (r >= 0) & (r < R)
    kg = keys.cpu().double()[r.clamp(0, R - 1)] * inside.unsqueeze(-1)
    ref = (torch.einsum("nhd,nrd->nhr", q.cpu().double(), kg).relu() * weights.cpu().double().unsqueeze(-1)).sum(1)
    _close(out, ref, rtol)
    # the same bits as the shared-keys kernel where a range lies inside the keys
    if dtype == torch.float32 or DEVICE == "cuda":
        full = indexer_scores_fixed(q, keys, weights)
        for i in range(n):
            a = int(start[i])
            if 0 <= a and a + width <= R:
                assert torch.equal(out[i], full[i, a : a + width])


def test_indexer_ranges_several_key_blocks_a_program(monkeypatch):
    """A prefill's range programs score ``INDEXER_RANGE_STEPS`` key blocks each (the query loaded once): the same bits
    as one block a program, blocks past the width included (5 blocks of 64 here: programs of blocks 0-3 and 4-7)."""
    import deepinfer.kernels.indexer as ix

    n, h, d, R, width = 4, 3, 16, 400, 300
    q, keys, weights = _randn(n, h, d, seed=80), _randn(R, d, seed=81), _randn(n, h, seed=82)
    start = torch.tensor([-7, 0, 90, 350]).to(DEVICE)
    one = indexer_scores_ranges(q, keys, weights, start, width)
    monkeypatch.setattr(ix, "INDEXER_RANGE_MIN_PROGRAMS", 1)
    assert n * -(-width // ix.INDEXER_BLOCK_R) >= ix.INDEXER_RANGE_STEPS  # so the merged launch is taken
    assert torch.equal(indexer_scores_ranges(q, keys, weights, start, width), one)


def test_indexer_ranges_fp32():
    _check_ranges(5, 3, 16, 70, 40, torch.float32, 1e-5)


@gpu_only
def test_gpu_bf16_indexer_ranges_real_shapes():
    _check_ranges(256, 64, 128, 4096, 1024, torch.bfloat16, 2e-2)


def test_matches_reference_ops_fp32():
    """Same semantics as ``ReferenceOps`` (mask-based; the key list is the mask's set of rows)."""
    from deepinfer.backends.reference import ReferenceOps

    ops = ReferenceOps()
    n, H, d, K, W = 3, 2, 16, 50, 45
    q, keys, sink = _randn(n, H, d, seed=90), _randn(K, d, seed=91), _randn(H, seed=92)
    idx, count = _idx(n, W, K, [0, 45, 20], seed=93)
    mask = torch.zeros(n, K, dtype=torch.bool, device=DEVICE)
    for i in range(n):
        mask[i, idx[i, : int(count[i])].long()] = True
    out = sparse_attention_gather(q, keys, idx, count, sink, 0.3)
    torch.testing.assert_close(out, ops.sparse_attention(q, keys, mask, sink, 0.3), rtol=2e-5, atol=2e-5)
    w = _randn(n, H, seed=94)
    torch.testing.assert_close(indexer_scores_fixed(q, keys, w), ops.indexer_scores(q, keys, w), rtol=2e-5, atol=2e-5)
