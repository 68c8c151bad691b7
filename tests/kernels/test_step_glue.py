"""DeepSeek-V4's decode-step glue in Triton (deepinfer.kernels.step_glue) against ``ReferenceOps``, bit for bit: the
step's index tensors (``step_indices``), a CSA layer's key lists, the ring appends with the window gather, the page
writes with the pages' gather, the compressor scores and the MoE's last sum; and the tiny models' pooled decode steps
with all of them against the torch glue. In Triton's interpreter without a GPU (``TRITON_INTERPRET=1``); the bf16
rounding of ``moe_combine`` and ``append_rows`` is checked on a GPU only (the interpreter's fp32 → bf16 cast
truncates)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import step_glue  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
KERNEL = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
GPU_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (bf16 rounding)")
REF = ReferenceOps()


def _same(got, ref, path="") -> None:
    """Nested tuples of tensors (or None) equal in shape, dtype and every value."""
    if ref is None or got is None:
        assert got is None and ref is None, path
        return
    if isinstance(ref, tuple):
        assert isinstance(got, tuple) and len(got) == len(ref), path
        for i, (a, b) in enumerate(zip(got, ref)):
            _same(a, b, f"{path}[{i}]")
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype, (path, got.shape, ref.shape, got.dtype, ref.dtype)
    assert torch.equal(got.cpu(), ref.cpu()), path


def _plan(size, window, span, page_size, seed, pad=0, strided=False):
    """A step's ``meta [4, S]`` and block tables: distinct slots (the last ``pad`` rows padding: the scratch slot,
    position 0, not live), positions below ``span``, window starts at or below them (a bounded replay's floor)."""
    g = torch.Generator().manual_seed(seed)
    n = size - pad
    slots = torch.randperm(3 * size, generator=g)[:size]
    pos = torch.randint(0, span, (size,), generator=g)
    pos[0], pos[-1] = span - 1, 0  # the widest row and one at position 0
    floor = torch.where(torch.rand(size, generator=g) < 0.5, 0, (pos * torch.rand(size, generator=g)).long())
    live = torch.ones(size, dtype=torch.long)
    slots[n:], pos[n:], floor[n:], live[n:] = 3 * size, 0, 0, 0
    meta = torch.stack([slots, pos, floor, live])
    pages = span // page_size
    tables = torch.randperm(size * pages + 5, generator=g)[: size * pages].view(size, pages)
    if strided:  # a column slice of a wider matrix, as V4DecodePlan.of's tables may be
        wide = torch.zeros(size, pages + 3, dtype=torch.long)
        wide[:, :pages] = tables
        tables = wide[:, :pages]
    return meta.to(DEVICE), tables.to(DEVICE)


CASES = [  # size, window, span, page_size, ratios (m, rows, pages, lists, visible), rings (m, cap), pad, strided
    (4, 8, 64, 16, ((4, 16, 4, False, True), (8, 8, 4, True, False)), ((4, 8), (8, 8)), 0, False),
    (5, 8, 48, 16, ((4, 12, 3, True, True), (8, 6, 3, True, True)), ((4, 8), (8, 8)), 2, True),
    (3, 6, 96, 32, ((4, 24, 3, False, True), (16, 6, 3, True, False)), ((4, 8), (16, 16)), 1, False),
    (2, 8, 32, 16, ((4, 0, 1, True, True), (8, 0, 1, True, True), (2, 16, 2, True, True)),
     ((4, 8), (8, 8), (2, 4)), 0, True),  # no visible rows yet; three of each
    (1, 128, 512, 128, ((4, 128, 4, False, True), (128, 4, 4, True, False)), ((4, 8), (128, 128)), 0, False),
    (3, 8, 32, 16, (), (), 0, False),  # the window only (an MTP block's plan)
]  # fmt: skip


@KERNEL
@pytest.mark.parametrize(("size", "window", "span", "page_size", "ratios", "rings", "pad", "strided"), CASES)
def test_step_indices(size, window, span, page_size, ratios, rings, pad, strided):
    meta, tables = _plan(size, window, span, page_size, seed=size * window, pad=pad, strided=strided)
    scratch = int(tables.max()) + 1
    for win_width in (window, 3):
        args = (meta, tables if ratios or rings else None, window, win_width, ratios, rings, page_size, scratch)
        _same(step_glue.step_indices(*args), REF.step_indices(*args))


@KERNEL
@pytest.mark.parametrize(("size", "win_width", "c", "strided"), [(4, 8, 3, False), (3, 6, 5, True), (2, 8, 0, False),
                                                                 (5, 128, 300, True)])  # fmt: skip
def test_key_lists(size, win_width, c, strided):
    g = torch.Generator().manual_seed(c)
    w_cnt = torch.randint(1, win_width + 1, (size,), generator=g)
    w_start = torch.arange(size) * win_width + (win_width - w_cnt)
    r_cnt = torch.randint(0, c + 1, (size,), generator=g)
    sel = torch.randint(0, max(c, 1) * 4, (size, 2 * c), generator=g)
    sel = sel[:, ::2] if strided else sel[:, :c].contiguous()
    r_start = 1000 + torch.arange(size) * 50
    args = [t.to(DEVICE) for t in (w_start, w_cnt)] + [win_width] + [t.to(DEVICE) for t in (sel, r_start, r_cnt)]
    _same(step_glue.key_lists(*args), REF.key_lists(*args))


@KERNEL
@pytest.mark.parametrize("gather", ["none", "new", "into"])
def test_append_rows(gather):
    """Seven (dst, idx, src) triples (two launches): a window ring, compressor rings with one index, casts to a wider
    dtype and between fp32 and fp16, strided sources; rows not indexed keep their values. With ``take``: the first
    ring's rows in window order after the appends (each row's own new row among them), into a new tensor or a view."""
    g = torch.Generator().manual_seed(0)
    s, w = 4, 8
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    specs = [(f32, f32, 16), (f32, f32, 40), (f32, f16, 40), (f16, f32, 8), (bf16, bf16, 24), (f32, bf16, 5),
             (f32, f32, 300)]  # (dst, src, width)  # fmt: skip
    slot = torch.tensor([3, 0, 5, 1])
    pos = torch.tensor([17, 2, 7, 30])
    put = slot * w + pos % w  # the window: ring rows of six slots
    take = (slot.unsqueeze(1) * w + (pos.unsqueeze(1) - w + 1 + torch.arange(w)) % w).flatten()
    dsts, idxs, srcs = [], [], []
    for i, (dd, sd, c) in enumerate(specs):
        n = 6 * w if i == 0 else 12
        dsts.append(torch.randn(n, c, generator=g).to(dd))
        idxs.append(put if i == 0 else torch.randperm(n, generator=g)[:s] if i % 2 else torch.arange(s) * 3)
        src = torch.randn(s, 2 * c, generator=g).to(sd)
        srcs.append(src[:, ::2].contiguous() if i % 3 else src[:, :c])  # unit column stride, any row stride
    dsts, idxs, srcs = ([t.to(DEVICE) for t in ts] for ts in (dsts, idxs, srcs))
    take = take.to(DEVICE)
    want = [d.clone() for d in dsts]
    args = () if gather == "none" else (take,)
    buf = torch.full((s * w + 3, 16), 7.0, device=DEVICE)
    out = buf[3:] if gather == "into" else None
    ref = REF.append_rows(want, idxs, srcs, *args)
    got = step_glue.append_rows(dsts, idxs, srcs, *args, *(() if out is None else (out,)))
    for a, b in zip(dsts, want):
        _same(a, b)
    _same(got, ref)
    if out is not None:
        assert got.data_ptr() == out.data_ptr() and torch.equal(buf[:3], torch.full((3, 16), 7.0, device=DEVICE))


@KERNEL
@pytest.mark.parametrize(("store_dtype", "rows_dtype", "into"), [(torch.float32, torch.float32, True),
                                                                 (torch.float32, torch.float16, False),
                                                                 (torch.bfloat16, torch.bfloat16, True)])  # fmt: skip
def test_store_rows(store_dtype, rows_dtype, into):
    """A compressor's rows stored (rows completing a group in their pages, the others in the scratch page) and every
    row's pages gathered, each row's new row among them; tables padded with page 0, which one row owns; the pages
    strided (an eager step's table columns) or not."""
    g = torch.Generator().manual_seed(4)
    s, p, r, d, scratch = 3, 4, 5, 40, 12
    store = torch.randn(scratch + 1, r, d, generator=g).to(store_dtype)
    tables = torch.tensor([[4, 7, 0, 0], [2, 9, 11, 1], [0, 3, 5, 0]])  # row 2 owns page 0; rows 0 and 2 pad with it
    done = torch.tensor([True, False, True])
    w = torch.tensor([5, 13, 11])  # row 0: page 1 row 0; row 2: page 2 row 1
    page = torch.where(done, tables.gather(1, (w // r).unsqueeze(1)).squeeze(1), scratch)
    row = w % r
    rows = torch.randn(s, 2 * d, generator=g).to(rows_dtype)[:, :d]  # a row stride past the width
    pages = tables.reshape(-1) if into else torch.stack([tables.reshape(-1)] * 2, 1)[:, 0]  # any stride
    args = [t.to(DEVICE) for t in (page, row, rows, pages)]
    a, b = store.to(DEVICE), store.to(DEVICE)
    buf = torch.zeros(s * p + 1, r, d, dtype=store_dtype, device=DEVICE) if into else None
    ref = REF.store_rows(a, *args)
    got = step_glue.store_rows(b, *args, *(() if buf is None else (buf[1:],)))
    _same(b, a)
    listed = torch.tensor([0, 1, 4, 5, 6, 8, 9, 10])  # pages 4, 7 / 2, 9, 11 / 0, 3, 5: their own rows
    _same(got[listed.to(DEVICE)], ref[listed.to(DEVICE)])
    new = got.cpu()[[10, 1], [1, 0]]  # row 2: its page 2 (5), row 1; row 0: its page 1 (7), row 0
    assert torch.equal(new, rows[[2, 0]].to(store_dtype))


@KERNEL
@pytest.mark.parametrize("ape_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compress_score(ape_dtype):
    g = torch.Generator().manual_seed(1)
    for t, c, m in ((5, 16, 4), (3, 300, 128), (1, 8, 8)):
        gate = (torch.randn(t, c + 3, generator=g) * 100)[:, :c]  # a row stride past the width
        ape = torch.randn(m, c, generator=g).to(ape_dtype)
        pos = torch.randint(0, 10 * m, (t,), generator=g)
        args = gate.to(DEVICE), ape.to(DEVICE), pos.to(DEVICE), m
        _same(step_glue.compress_score(*args), REF.compress_score(*args))


@KERNEL
@pytest.mark.parametrize(
    ("shared", "out"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
     (torch.float32, torch.float16)],
)  # fmt: skip
def test_moe_combine(shared, out):
    g = torch.Generator().manual_seed(2)
    y = torch.randn(5, 3000, generator=g) * torch.logspace(-3, 3, 3000)
    s = (torch.randn(5, 3000, generator=g) * 10).to(shared)
    _same(step_glue.moe_combine(y.to(DEVICE), s.to(DEVICE), out), REF.moe_combine(y.to(DEVICE), s.to(DEVICE), out))


@GPU_ONLY
def test_bf16_rounding_on_gpu():
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(7, 4096, generator=g) * torch.logspace(-4, 4, 4096)).cuda()
    s = (torch.randn(7, 4096, generator=g) * 10).bfloat16().cuda()
    _same(step_glue.moe_combine(y, s, torch.bfloat16), REF.moe_combine(y, s, torch.bfloat16))
    d = torch.zeros(9, 4096, dtype=torch.bfloat16, device="cuda")
    want = d.clone()
    idx = torch.tensor([8, 0, 3], device="cuda")
    step_glue.append_rows([d], [idx], [y[:3]])
    REF.append_rows([want], [idx], [y[:3]])
    _same(d, want)


class KernelGlueOps(ReferenceOps):
    """``ReferenceOps`` with the decode-step glue run by the kernels (``step_glue``) on host tensors."""

    def step_indices(self, *args):
        return step_glue.step_indices(*args)

    def key_lists(self, *args):
        return step_glue.key_lists(*args)

    def append_rows(self, *args):
        return step_glue.append_rows(*args)

    def store_rows(self, *args):
        return step_glue.store_rows(*args)

    def compress_score(self, *args):
        return step_glue.compress_score(*args)

    def moe_combine(self, *args):
        return step_glue.moe_combine(*args)


@KERNEL
@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's run of the whole model (host tensors)")
@pytest.mark.parametrize("name", ["base", "odd"])
def test_pooled_decode_with_the_kernels_is_the_reference(name):
    """The tiny models' pooled decode steps (every compressor completing rows, a sequence joining late) with the glue
    run by the kernels: the same logits, caches and pooled state as with the torch glue, bit for bit."""
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState
    from models.tiny_configs import CONFIGS

    config = DeepseekV4Config.from_dict({**TINY_V4, **CONFIGS[name], "num_nextn_predict_layers": 0})
    weights = random_weights(config, seed=5)

    def run(ops):
        model = DeepseekV4Model(config, ops)
        model.load_state_dict(weights, strict=False)
        cache = PagedKVCache(config, 4 * 4, 16)
        gen = torch.Generator().manual_seed(9)
        seqs = [torch.randint(2, config.vocab_size, (60,), generator=gen).tolist() for _ in range(4)]
        states, tables, out = [SequenceState() for _ in seqs], [torch.arange(i * 4, i * 4 + 4) for i in range(4)], []
        for plan in ([{0: 9, 1: 14, 2: 11}] + [dict.fromkeys(range(3), 1)] * 5 + [{3: 12}]
                                    + [dict.fromkeys(range(4), 1)] * 5):  # fmt: skip
            chunks = [SeqChunk(states[i], states[i].num_tokens, n, tables[i]) for i, n in plan.items()]
            batch = ForwardBatch.build(chunks, [seqs[i][c.start : c.end] for i, c in zip(plan, chunks)])
            out.append(model.logits(model(batch, cache)))
        pool = model.state_pool
        return torch.cat(out), cache, [pool.rings[k].clone() for k in sorted(pool.rings)], pool.rbufs

    want, cache_a, rings_a, bufs_a = run(ReferenceOps())
    got, cache_b, rings_b, bufs_b = run(KernelGlueOps())
    assert torch.equal(got, want)
    for kind, layer in cache_a.stores():
        assert torch.equal(cache_a._store(kind, layer)[:-1], cache_b._store(kind, layer)[:-1]), (kind, layer)
    assert all(torch.equal(a, b) for a, b in zip(rings_a, rings_b))
    assert all(torch.equal(bufs_a[k][i], bufs_b[k][i]) for k in bufs_a for i in (0, 1))
