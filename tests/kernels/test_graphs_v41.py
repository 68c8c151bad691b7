"""Decode steps of DeepSeek-V4.1 replayed from CUDA graphs (``deepinfer.models.deepseek_v41.graphs``) against eager
steps.

A step is one graph (``decode_step``: the attention bookkeeping in fixed shapes from a ``V41DecodePlan``). On CPU the
plumbing is checked with the reference ops: the "graph" runs the whole-step function eagerly (static inputs, the plan
loaded for the bucket, Engram row ids or looked-up rows, padding rows on the scratch slot and page), bit-identical to
the eager step at a bucket's size (logits, every page a block table may name, windows and compressor rings; the lists
of the bucket's span select what the exact ones select: every compressed layer attends to a top-k), within rounding
in a padded bucket; which steps are refused. On a CUDA machine a tiny model (``tests/models/tiny_v41.py``, every layer
kind and Engram) decodes the same tokens from the same state eagerly and from graphs: bit-identical logits and state at
bucket sizes in fp32 and bf16, with the Engram tables on the device and on the host, close ones in a padded bucket.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.models.deepseek_v41.graphs import DecodeGraphs  # noqa: E402
from eager_graphs import EagerCapture  # noqa: E402
from gpu_waits import assert_steps_never_wait  # noqa: E402
from models.tiny_v41 import build_tokenizer, random_model  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
# a padded bucket's GEMMs have more rows than the eager step's, and a CPU BLAS may round a row differently with
# another row count (an AMD EPYC host: 1e-5 apart), enough to flip a near-tie in a top-k or a routing choice, after
# which that sequence's logits move by ~5e-3 (the tiny model's logits have a std of 1; a wrong slot, page or state
# moves them by 2-4)
PADDED_ATOL = 5e-2


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _setup(model, n_seq: int, context: int, seed: int, dev: str = DEVICE, split: bool = False):
    """``n_seq`` sequences of different lengths (other window, ring and ratio-2 phases) prefilled eagerly, and the
    tokens of 6 decode steps. ``split``: the first sequence's prefill is a bounded decoder replay of its last 2
    tokens (its decoder layers' windows start there)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.text.vocab_size
    pages = -(-(context + 16) // 8)
    cache = PagedKVCache(model.config, pages * n_seq, 8, dtype=model.embed.weight.dtype, device=dev)
    states, tables = [], []
    ops, prev = model.ops, model.ops.cuda_graphs
    ops.cuda_graphs = False
    for i in range(n_seq):
        st, table = SequenceState(), torch.arange(i * pages, (i + 1) * pages, device=dev)
        n = context - i
        ids = torch.randint(5, vocab, (n,), generator=gen).tolist()
        d = n - 2 if split and i == 0 else None
        model(ForwardBatch.build([SeqChunk(st, 0, n, table, decoder_from=d)], [ids], dev), cache)
        states.append(st)
        tables.append(table)
    ops.cuda_graphs = prev
    steps = [torch.randint(5, vocab, (n_seq,), generator=gen).tolist() for _ in range(6)]
    return cache, states, tables, steps


def _decode(model, cache, states, tables, steps, graphs: bool, dev: str = DEVICE, keep: bool = False):
    """The logits of ``steps`` from copies of ``cache`` and ``states`` (and, with ``keep``, the copies after them)."""
    prev, model.ops.cuda_graphs = model.ops.cuda_graphs, graphs
    cache, states = copy.deepcopy(cache), [s.clone() for s in states]
    out = []
    for ids in steps:
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        out.append(model.logits(model(ForwardBatch.build(chunks, [[i] for i in ids], dev), cache)))
    model.ops.cuda_graphs = prev
    return (torch.stack(out), cache, states) if keep else torch.stack(out)


def _same_state(a, b) -> None:
    """Two runs' caches (every page a block table may name) and sequence states agree bit for bit."""
    (ca, sa), (cb, sb) = a, b
    for kind, layer in ca.stores():
        assert torch.equal(ca._store(kind, layer)[: ca.num_pages], cb._store(kind, layer)[: cb.num_pages]), kind
    for x, y in zip(sa, sb):
        assert x.num_tokens == y.num_tokens and x.history == y.history and x.windows.keys() == y.windows.keys()
        assert all(torch.equal(x.windows[k], y.windows[k]) for k in x.windows)
        assert x.buffers.keys() == y.buffers.keys()
        for k, buf in x.buffers.items():
            other = y.buffers[k]
            assert buf.start == other.start and torch.equal(buf.kv, other.kv) and torch.equal(buf.score, other.score)


def _check(model, cases, dev: str = DEVICE, split: bool = False, context: int = 23, n_steps: int = 6) -> None:
    """Eager against graphed logits for ``(n_seq, exact)`` cases (and, exact, the caches and states after them);
    every graphed step replays."""
    for n_seq, exact in cases:
        cache, states, tables, steps = _setup(model, n_seq, context, seed=n_seq, dev=dev, split=split)
        steps = steps[:n_steps]
        eager, *a = _decode(model, cache, states, tables, steps, graphs=False, dev=dev, keep=True)
        before = model.decode_graphs.replays if model.decode_graphs else 0
        graphed, *b = _decode(model, cache, states, tables, steps, graphs=True, dev=dev, keep=True)
        assert model.decode_graphs.failures == {}
        assert model.decode_graphs.replays == before + len(steps)
        if exact:
            assert torch.equal(eager, graphed), (eager - graphed).abs().max().item()
            _same_state(a, b)
        else:
            assert (eager - graphed).abs().max().item() < PADDED_ATOL


# -- CPU: the plumbing ------------------------------------------------------------------------------------------


class EagerSegments(EagerCapture, DecodeGraphs):
    """``DecodeGraphs``' step plumbing without CUDA: each "graph" runs its segment eagerly, on any device."""

    on_device = True

    def tables_on_device(self, device: torch.device) -> bool:
        return self.on_device


def _model(tokenizer, ops, name: str = "sketch", dtype: torch.dtype = torch.float32, dev: str = DEVICE):
    return random_model(tokenizer, ops, name, dtype, dev)


def _reference_model(tokenizer, name: str):
    from deepinfer.backends.reference import ReferenceOps

    ops = ReferenceOps()
    ops.cuda_graphs = True
    model = _model(tokenizer, ops, name, dev="cpu")
    model.decode_graphs = EagerSegments(model, max_batch=8)
    return model


@pytest.mark.parametrize("name", ["sketch", "mixed"])
@pytest.mark.parametrize("tables", ["device", "host"])
def test_the_whole_v41_step_equals_the_eager_step_on_cpu(tokenizer, name, tables):
    """Reference ops on the host: the whole decode step (what the graph captures) gives the eager logits, caches and
    states bit for bit at a bucket's size (4 and 1 sequences) and logits within fp32 rounding in a padded bucket (3 in
    4); Engram from row ids (tables on the device: the gather is captured) or from rows looked up before the replay."""
    model = _reference_model(tokenizer, name)
    model.decode_graphs.on_device = tables == "device"
    _check(model, [(4, True), (1, True), (3, False)], dev="cpu")
    bk = next(iter(model.decode_graphs.buckets.values()))
    assert (bk.engram is None) == (tables == "host") and bool(bk.engram_rows) == (tables == "host")
    assert len(bk.graphs) == 1 and bk.plan.widths  # one graph a step, the lists of the bucket's span


def test_v41_decode_graphs_give_the_dspark_features_on_cpu(tokenizer):
    """A decode step asked for DSpark's features (the steps the drafter follows) replays the whole-step graph, which
    computes them: trunk output and features bit for bit the eager step's."""
    model = _reference_model(tokenizer, "sketch")
    cache, states, tables, steps = _setup(model, 4, 23, seed=4, dev="cpu")
    out = []
    for graphs in (False, True):
        model.ops.cuda_graphs = graphs
        c, sts = copy.deepcopy(cache), [s.clone() for s in states]
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(sts, tables)]
        y = model(ForwardBatch.build(chunks, [[i] for i in steps[0]], "cpu"), c, capture=True)
        out.append((y, model.dspark_features.clone()))
    assert model.decode_graphs.replays == 1
    (y0, f0), (y1, f1) = out
    assert torch.equal(y0, y1) and f0.shape == (4, model.dspark.feature_dim) and torch.equal(f0, f1)


def test_v41_whole_step_after_a_bounded_decoder_replay_on_cpu(tokenizer):
    """A sequence whose decoder layers' windows start later than its encoder layers' (a bounded decoder replay): the
    plan's two window floors, bit for bit."""
    _check(_reference_model(tokenizer, "sketch"), [(4, True)], dev="cpu", split=True)


def test_v41_whole_step_across_spans_on_cpu(tokenizer):
    """Positions 1021 .. 1026: the first steps in the smallest span's graphs (1024 positions), the next in the next
    span's (1280), bit for bit; the largest sequence fills its lists."""
    model = _reference_model(tokenizer, "sketch")
    _check(model, [(2, True)], dev="cpu", context=1022)
    assert sorted(k[-2] for k in model.decode_graphs.buckets) == [1024, 1280]


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on the host need TRITON_INTERPRET=1")
def test_the_whole_v41_step_with_the_kernels_on_cpu(tokenizer):
    """``NvidiaOps`` in Triton's interpreter (the list attention, the indexer's scores and its top-k kernels): the whole
    step at a bucket's size (4 sequences) gives the eager step's logits, caches and states bit for bit, the eager
    step's lists being narrower (exact widths; at these positions some rows see fewer compressed rows than the
    top-k): the kernels read only the listed rows."""
    from deepinfer.backends.nvidia import NvidiaOps

    ops = NvidiaOps(cuda_graphs=True)
    ops.select_backend = "kernel"
    model = _model(tokenizer, ops, "sketch", dev="cpu")
    model.decode_graphs = EagerSegments(model, max_batch=8)
    _check(model, [(4, True)], dev="cpu", context=7, n_steps=2)  # the interpreter is slow: 2 short steps


def test_v41_steps_the_graphs_refuse(tokenizer):
    """Prefill chunks, image embeddings, a bounded decoder replay and host tensors run eagerly; a step asked for
    DSpark's features replays (the graph computes them)."""
    model = _reference_model(tokenizer, "sketch")
    graphs = model.decode_graphs
    st = SequenceState(num_tokens=5)
    one = ForwardBatch.build([SeqChunk(st, 5, 1, torch.arange(4))], [[7]])
    assert graphs.applies(one) and not DecodeGraphs.applies(graphs, one)  # on the host
    assert not graphs.applies(ForwardBatch.build([SeqChunk(st, 5, 2, torch.arange(4))], [[7, 8]]))
    assert not graphs.applies(ForwardBatch(one.token_ids, one.positions, one.chunks, image_mask=torch.ones(1) > 0))
    assert not graphs.applies(ForwardBatch(one.token_ids, one.positions, one.chunks, input_embeds=torch.zeros(1, 64)))
    for d in (3, 6):  # the eager step checks the layout (and may skip rows) whenever decoder_from is set
        assert not graphs.applies(ForwardBatch.build([SeqChunk(st, 5, 1, torch.arange(4), decoder_from=d)], [[7]]))
    cache, states, tables, steps = _setup(model, 2, 15, seed=5, dev="cpu")
    chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
    model(ForwardBatch.build(chunks, [[i] for i in steps[0]]), cache, capture=True)
    assert graphs.replays == 1 and model.dspark_features.shape[0] == 2
    chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
    model(ForwardBatch.build(chunks, [[i] for i in steps[1]]), cache)
    assert graphs.replays == 2 and all(s.num_tokens == 15 - i + 2 for i, s in enumerate(states))
    # the whole-step graph needs the pooled state; a sequence still in a bounded replay runs eagerly
    for pooled, ahead in ((False, 0), (True, 1)):
        model.pooled_decode, states[0].replay_until = pooled, (states[0].num_tokens + 1) * ahead
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        model(ForwardBatch.build(chunks, [[i] for i in steps[2]]), cache)
        assert graphs.replays == 2
    model.pooled_decode = True


# -- GPU: the graphs -------------------------------------------------------------------------------------------


def _nvidia_model(tokenizer, dtype: torch.dtype, name: str = "sketch"):
    from deepinfer.backends.nvidia import NvidiaOps

    return _model(tokenizer, NvidiaOps(cuda_graphs=True), name, dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_graph_replay_equals_eager_bit_for_bit(tokenizer, dtype):
    """Bucket sizes (4 and 1 sequences): the replay runs the eager kernels on the eager shapes."""
    _check(_nvidia_model(tokenizer, dtype), [(4, True), (1, True)])


@gpu_only
def test_v41_graphs_with_engram_tables_on_the_host(tokenizer):
    """``place_engram_tables("cpu")``: the rows are looked up on the host before the replay, same logits."""
    model = _nvidia_model(tokenizer, torch.float32, "mixed")
    model.place_engram_tables("cpu")
    _check(model, [(2, True)])
    bk = next(iter(model.decode_graphs.buckets.values()))
    assert bk.engram is None and len(bk.engram_rows) == 2


@gpu_only
def test_v41_graphs_across_spans(tokenizer):
    """Positions 1021 .. 1026 in bf16: the graphs of two spans, bit-identical logits and state."""
    model = _nvidia_model(tokenizer, torch.bfloat16)
    _check(model, [(2, True)], context=1022)
    assert sorted(k[-2] for k in model.decode_graphs.buckets) == [1024, 1280]


@gpu_only
def test_v41_decode_step_never_waits_for_the_gpu(tokenizer):
    """The host issues a whole decode step (the plan, the Engram rows, one graph, the logits) while the GPU is still
    busy with work queued before it: no synchronising call (sync debug mode "error"), and the work queued ahead is
    still running when the step returns."""
    model = _nvidia_model(tokenizer, torch.bfloat16)
    cache, states, tables, steps = _setup(model, 4, 23, seed=11)
    steps = steps + [s[::-1] for s in steps]

    def step(ids):
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        return model.logits(model(ForwardBatch.build(chunks, [[i] for i in ids], DEVICE), cache))

    assert_steps_never_wait(step, steps)
    assert model.decode_graphs.replays == len(steps)


@gpu_only
def test_v41_padded_bucket_is_close_and_large_batches_run_eagerly_or_piecewise(tokenizer):
    """Past the largest decode bucket a step runs eagerly, or with ``prefill_graphs`` as a piecewise one (close)."""
    model = _nvidia_model(tokenizer, torch.float32)
    _check(model, [(3, False)])  # runs in bucket 4
    model.decode_graphs = DecodeGraphs(model, max_batch=2)
    cache, states, tables, steps = _setup(model, 3, 20, seed=3)
    eager = _decode(model, cache, states, tables, steps, graphs=False)
    model.ops.prefill_graphs = False
    graphed = _decode(model, cache, states, tables, steps, graphs=True)
    assert model.decode_graphs.replays == 0 and torch.equal(eager, graphed)
    model.ops.prefill_graphs = model.piecewise_prefill = True
    piecewise = _decode(model, cache, states, tables, steps, graphs=True)
    assert model.decode_graphs.replays == 0 and model.prefill_graphs.replays == len(steps)
    assert (eager - piecewise).abs().max().item() < PADDED_ATOL
