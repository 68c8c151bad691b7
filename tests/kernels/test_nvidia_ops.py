"""The nvidia op sets' kernel attention (``deepinfer.backends.nvidia``) against the reference ops, and batch
invariance of a model running them. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.nvidia import NvidiaOps  # noqa: E402
from deepinfer.backends.nvidia.invariant import visible_keys  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402


def test_visible_keys_are_in_list_order_first():
    mask = torch.tensor([[False, True, False, True], [False, False, False, False], [True, True, True, False]])
    idx, count = visible_keys(mask)
    assert count.tolist() == [2, 0, 3]
    assert idx[0, :2].tolist() == [1, 3] and idx[2, :3].tolist() == [0, 1, 2]


def test_invariant_attention_indexer_and_pooling_match_the_reference():
    """The batch-invariant mode's own ops (``backends.nvidia.invariant``) compute the reference's functions."""
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(5, 3, 48, generator=g), torch.randn(40, 48, generator=g)
    mask, sink, w = torch.rand(5, 40, generator=g) < 0.5, torch.randn(3, generator=g), torch.rand(5, 3, generator=g)
    kv, score, h, pre = (torch.randn(*s, generator=g) for s in ((6, 4, 48), (6, 4, 48), (5, 4, 48), (5, 4)))
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        q, keys, mask, sink, w, kv, score, h, pre = (t.cuda() for t in (q, keys, mask, sink, w, kv, score, h, pre))
    mask[2] = False  # a query that sees nothing but the sink
    k, r = NvidiaOps(invariant=True), ReferenceOps()
    got, ref = k.sparse_attention(q, keys, mask, sink, 0.1), r.sparse_attention(q, keys, mask, sink, 0.1)
    assert (got - ref).abs().max().item() < 1e-5 and not got[2].any()
    assert (k.indexer_scores(q, keys, w) - r.indexer_scores(q, keys, w)).abs().max().item() < 1e-5
    assert (k.softmax_pool(kv, score) - r.softmax_pool(kv, score)).abs().max().item() < 1e-5
    assert (k.hc_collapse(h, pre) - r.hc_collapse(h, pre)).abs().max().item() < 1e-5
    x, wt = torch.randn(7, 48, generator=g).to(h.device), torch.randn(24, 48, generator=g).to(h.device)
    assert (k.linear(x, wt) - r.linear(x, wt)).abs().max().item() < 1e-4
    assert (k.logits_linear(x, wt) - r.logits_linear(x, wt)).abs().max().item() < 1e-4
    xg, wg = torch.randn(7, 2, 48, generator=g).to(h.device), torch.randn(2, 12, 48, generator=g).to(h.device)
    assert (k.grouped_linear(xg, wg) - r.grouped_linear(xg, wg)).abs().max().item() < 1e-4


# -- the default nvidia op set (NvidiaOps) and the model's batched attention path ------------------------------------


class PerSequenceOps(ReferenceOps):
    """The reference numerics through the model's per-sequence attention loop (taken for the reference's
    batch-invariant op set)."""

    invariant_by_sequence = True


def _device():
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def test_attention_lists_and_index_ranges_match_the_per_sequence_ops():
    """The list / range forms of sparse attention and indexer scores equal the per-sequence ops on each sequence's keys
    (reference ops, and NvidiaOps' kernels: the interpreter on CPU)."""
    from deepinfer.backends.nvidia import NvidiaOps

    dev = _device()
    g = torch.Generator().manual_seed(3)
    H, d, dk, nh = 3, 48, 16, 4
    lens, nkeys = [3, 1, 5], [20, 7, 33]  # queries and keys of three sequences
    q = torch.randn(sum(lens), H, d, generator=g)
    iq, iw = torch.randn(sum(lens), nh, dk, generator=g), torch.rand(sum(lens), nh, generator=g)
    keys = [torch.randn(k, d, generator=g) for k in nkeys]
    ikeys = [torch.randn(k, dk, generator=g) for k in nkeys]
    masks = [torch.rand(n, k, generator=g) < 0.4 for n, k in zip(lens, nkeys)]
    sink = torch.randn(H, generator=g)
    ref = ReferenceOps()
    want = torch.cat([ref.sparse_attention(q_, k, m, sink, 0.2) for q_, k, m in zip(q.split(lens), keys, masks)])
    width = max(nkeys)
    want_i = torch.cat(
        [
            torch.nn.functional.pad(ref.indexer_scores(a, k, w), (0, width - k.shape[0]))
            for a, k, w in zip(iq.split(lens), ikeys, iw.split(lens))
        ]
    )
    base = torch.tensor([0] + nkeys[:-1]).cumsum(0)
    idx, count = [], []
    for b, m in zip(base, masks):
        order, cnt = visible_keys(m)
        idx.append(torch.nn.functional.pad(order + b, (0, width - m.shape[1]), value=-1))
        count.append(cnt)
    idx, count = torch.cat(idx), torch.cat(count)
    start = torch.repeat_interleave(base, torch.tensor(lens))
    pool, ipool = torch.cat(keys), torch.cat(ikeys)
    for ops in (ref, NvidiaOps()):
        args = (t.to(dev) for t in (q, pool, idx, count, sink))
        got = ops.sparse_attention_lists(*args, 0.2).cpu()
        assert (got - want).abs().max().item() < 1e-5
        got_i = ops.indexer_scores_ranges(iq.to(dev), ipool.to(dev), iw.to(dev), start.to(dev), width).cpu()
        for r, k in enumerate(nkeys):  # columns past a sequence's own keys are the caller's to mask
            rows = slice(sum(lens[:r]), sum(lens[: r + 1]))
            assert (got_i[rows, :k] - want_i[rows, :k]).abs().max().item() < 1e-5


def _model(name, ops, **overrides):
    from models.tiny_configs import in_memory

    return in_memory(name, ops, **overrides)


@pytest.mark.parametrize("name", ["base", "odd"])
def test_batched_attention_equals_the_per_sequence_loop(name):
    """Mixed prefill chunks and decodes of several sequences: the batched path (default op sets) gives the logits of the
    per-sequence loop, within fp32 rounding of the attention sums."""
    import random

    from bench.engine.compositions import sequence_logits
    from models.test_batch_invariance import PAGE, composition, tokens

    def run(model, seqs, plans, rng):
        return sequence_logits(model, seqs, plans, rng, PAGE)

    model = _model(name, ReferenceOps())
    target = tokens(150, 7, model.config.vocab_size)
    for seed in (0, 5):
        seqs, plans, rng = composition(model, target, seed)
        got = run(model, seqs, plans, random.Random(seed))
        model.ops = PerSequenceOps()
        want = run(model, seqs, plans, random.Random(seed))
        model.ops = ReferenceOps()
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() < 1e-4, (a - b).abs().max().item()


def test_batched_attention_replays_like_the_per_sequence_loop():
    """A bounded replay (compact resume point: no window rows below the replay, compressed rows not rewritten)."""
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState, StateSnapshot
    from models.test_batch_invariance import tokens

    model = _model("base", ReferenceOps())
    seq = tokens(90, 11, model.config.vocab_size)
    outs = []
    for ops in (ReferenceOps(), PerSequenceOps()):
        model.ops = ops
        cache, table = PagedKVCache(model.config, 16, 16), torch.arange(16)
        st = SequenceState()
        model(ForwardBatch.build([SeqChunk(st, 0, 64, table)], [seq[:64]]), cache)
        snap = StateSnapshot.take(st, cache, table, compact=True)
        st = snap.restore_replay(cache, table, "cpu", 48)  # replay tokens 48..63, then go on
        h = model(ForwardBatch.build([SeqChunk(st, 48, 16, table)], [seq[48:64]]), cache)
        logits = [model.logits(h)]
        for p in range(64, 70):
            logits.append(model.logits(model(ForwardBatch.build([SeqChunk(st, p, 1, table)], [[seq[p]]]), cache)))
        outs.append(torch.cat(logits))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4


def _run_on(model, seqs, plans, dev):
    """``models.test_batch_invariance.run`` on ``dev``: each step batches the next chunk of every sequence."""
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState

    pages = -(-max(len(s) for s in seqs) // 16)
    cache = PagedKVCache(model.config, pages * len(seqs), 16, device=dev)
    states = [SequenceState() for _ in seqs]
    tables = [torch.arange(i * pages, (i + 1) * pages, device=dev) for i in range(len(seqs))]
    pos, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in range(max(len(p) for p in plans)):
        who = [i for i, p in enumerate(plans) if step < len(p)]
        chunks = [SeqChunk(states[i], pos[i], plans[i][step], tables[i]) for i in who]
        toks = [seqs[i][pos[i] : pos[i] + plans[i][step]] for i in who]
        for i in who:
            pos[i] += plans[i][step]
        batch = ForwardBatch.build(chunks, toks, dev)
        logits = model.logits(model(batch, cache)).cpu()
        for (a, b), i in zip(batch.offsets(), who):
            outs[i].append(logits[a:b])
    return [torch.cat(o) for o in outs]


def test_a_model_on_nvidia_ops_matches_the_reference():
    """NvidiaOps end to end (on CPU its Triton kernels run in the interpreter): MoE, batched attention, indexer."""
    from deepinfer.backends.nvidia import NvidiaOps
    from models.test_batch_invariance import tokens

    dev = _device()
    model = _model("base", ReferenceOps())
    vocab = model.config.vocab_size
    seqs = [tokens(40, 1, vocab), tokens(13, 2, vocab), tokens(9, 3, vocab)]
    plans = [[36, 1, 1, 1, 1], [4, 9], [1] * 9]
    want = _run_on(model, seqs, plans, "cpu")
    model.to(dev)
    for backend in ("triton", "grouped_mm") if dev == "cpu" else ("triton",):  # CUDA grouped_mm: bf16 (test_moe.py)
        model.ops = NvidiaOps(moe_backend=backend)
        got = _run_on(model, seqs, plans, dev)
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() < 1e-4, (backend, (a - b).abs().max().item())


def test_the_output_head_in_half_precision_matches_the_fp32_reference():
    """bf16 operands are exact in fp32: the fast head (one bf16 GEMM, fp32 accumulate and output) equals the
    reference's cast-then-fp32 GEMM up to summation order. On CPU both take the reference path."""
    from deepinfer.backends.nvidia import NvidiaOps

    dev = _device()
    torch.manual_seed(0)
    w = (torch.randn(1000, 256, device=dev) * 0.05).bfloat16()
    y = torch.randn(2, 3, 256, device=dev).bfloat16()
    fast, ref = NvidiaOps().logits_linear(y, w), ReferenceOps("cpu").logits_linear(y, w)
    assert fast.dtype == torch.float32 and fast.shape == (2, 3, 1000)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_a_model_on_native_weights_matches_the_reference():
    """NvidiaOps with the weights kept as stored (``quant.native``: FP8 linears through ``kernels.fp8_gemm``, MXFP4
    experts through ``kernels.moe_mxfp4``; the interpreter on CPU) against the reference ops on the same stored
    weights (which decode them per call), with the official FP8 activation rounding on and off."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer.quant.native import prepare_native
    from models.test_batch_invariance import tokens

    dev = _device()
    # three layers (SWA with hash routing, CSA, HCA): the interpreter runs every kernel of the model
    config = DeepseekV4Config.from_dict(
        {**TINY_V4, "num_hidden_layers": 3, "compress_ratios": [0, 4, 8, 0], "num_hash_layers": 1}
    )
    model = DeepseekV4Model(config, ReferenceOps())
    model.step_graphs = FAMILY.step_graphs()  # NvidiaOps below: graphs where it allows them, as the engine's build
    model.load_state_dict(random_weights(config, seed=5))
    prepare_native(model, tuple(config.weight_block_size), quantize=True)
    vocab = model.config.vocab_size
    seqs = [tokens(13, 1, vocab), tokens(4, 2, vocab)]
    plans = [[12, 1], [3, 1]]  # a prefill chunk and a decode step of two sequences
    for act in (False, True):
        for m in model.modules():
            if hasattr(m, "quant_sim") and (getattr(m, "keeps_fp8", False) or hasattr(m, "w1_scale")):
                m.quant_sim = act
        model.ops = ReferenceOps()
        want = _run_on(model.to("cpu"), seqs, plans, "cpu")
        model.to(dev).ops = NvidiaOps(native_weights=True)
        got = _run_on(model, seqs, plans, dev)
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() < 1e-4, (act, (a - b).abs().max().item())


def test_joined_projections_match_the_separate_ones():
    """``NvidiaOps.prepare_weights`` joins the projections of a layer's input (``join_projections``: ``wq_a`` with
    ``wkv`` in FP8, the compressors' ``wkv`` / ``wgate``; here by hand, as on CPU it does not): the model gives what
    it gave with separate GEMMs (kernels in the interpreter on CPU), prefill and decode, V4 and V4.1."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer.quant.native import prepare_native
    from models.test_batch_invariance import tokens

    dev = _device()
    # 32-row scale blocks, so that wq_a (32 rows) fills one and joins with wkv; SWA, CSA (indexer) and HCA layers
    config = DeepseekV4Config.from_dict(
        {**TINY_V4, "num_hidden_layers": 3, "compress_ratios": [0, 4, 8, 0], "num_hash_layers": 1,
         "quantization_config": {**TINY_V4["quantization_config"], "weight_block_size": [32, 32]}}
    )  # fmt: skip
    model = DeepseekV4Model(config, ReferenceOps())
    model.step_graphs = FAMILY.step_graphs()  # NvidiaOps below: graphs where it allows them, as the engine's build
    model.load_state_dict(random_weights(config, seed=6))
    prepare_native(model, (32, 32), quantize=True)
    model.to(dev).ops = NvidiaOps(native_weights=True)
    vocab = model.config.vocab_size
    seqs = [tokens(13, 1, vocab), tokens(4, 2, vocab)]
    plans = [[12, 1], [3, 1]]
    want = _run_on(model, seqs, plans, dev)
    joined = 0
    for m in model.modules():
        if hasattr(m, "join_projections"):
            m.join_projections()
            joined += 1
    attn = model.layers[1].attn
    w1, w2 = attn.wq_a.weight, attn.wkv.weight
    assert joined >= 3 and w2.data_ptr() == w1.data_ptr() + w1.numel() * w1.element_size()
    c1, c2 = attn.compressor.wgate.weight, attn.indexer.compressor.wkv.weight
    assert c2.data_ptr() == c1.data_ptr() + c1.numel() * c1.element_size()
    # the first run captured CUDA graphs (on a GPU) that read the separate weights' old storage: prepare_weights joins
    # before any capture; here they are dropped, so the second run captures the joined GEMMs
    model.decode_graphs = model.prefill_graphs = None
    got = _run_on(model, seqs, plans, dev)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-5, (a - b).abs().max().item()
