"""Decode steps replayed from CUDA graphs (``deepinfer.models.deepseek_v4.graphs``) against eager steps.

On CPU only the bucket rule and the eager fallback are checked; on a CUDA machine a tiny model decodes the same
tokens from the same state eagerly and from graphs: bit-identical logits at a bucket's size, close ones in a padded
bucket, eager runs for prefill chunks and batches past the largest bucket.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.graphs import BUCKETS, DecodeGraphs, bucket_for  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from gpu_waits import assert_steps_never_wait  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def test_buckets():
    assert [bucket_for(n, 256) for n in (1, 2, 3, 5, 17, 64, 65, 200, 256)] == [1, 2, 4, 8, 24, 64, 96, 256, 256]
    assert bucket_for(0, 256) is None and bucket_for(257, 256) is None and bucket_for(33, 32) is None
    assert bucket_for(300, 512) == 384 and list(BUCKETS) == sorted(BUCKETS)


def _model(dtype: torch.dtype = torch.float32):
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    config = DeepseekV4Config.from_dict({**TINY_V4, "num_nextn_predict_layers": 0})
    model = DeepseekV4Model(config, NvidiaOps(cuda_graphs=True))
    model.step_graphs = FAMILY.step_graphs()  # the runtime's choice of graphs, as the engine's build attaches it
    model.load_state_dict(random_weights(config, seed=0), strict=False)
    return model.to(DEVICE, dtype)


def test_prefill_and_cpu_steps_run_eagerly():
    """``applies`` refuses prefill chunks, empty batches and host tensors: those steps take the eager path."""
    g = DecodeGraphs.__new__(DecodeGraphs)
    st = SequenceState()
    one = ForwardBatch.build([SeqChunk(st, 0, 1, torch.arange(2))], [[5]])
    two = ForwardBatch.build([SeqChunk(st, 0, 2, torch.arange(2))], [[5, 6]])
    assert not DecodeGraphs.applies(g, one)  # on the host
    assert not DecodeGraphs.applies(g, two)
    assert not DecodeGraphs.applies(g, ForwardBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0), []))


def _setup(model, n_seq: int, context: int, seed: int, dev: str = DEVICE, prefill_ops=None):
    """``n_seq`` sequences prefilled (with ``prefill_ops`` when given: the states the steps start from, whichever
    ops made them), and 6 decode steps' token ids."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    pages = -(-(context + 16) // 16)
    cache = PagedKVCache(model.config, pages * n_seq, 16, dtype=model.embed.weight.dtype, device=dev)
    states, tables = [], []
    ops, model.ops.cuda_graphs = model.ops, False
    model.ops = prefill_ops or ops
    for i in range(n_seq):
        st, table = SequenceState(), torch.arange(i * pages, (i + 1) * pages, device=dev)
        n = context - i  # different lengths: different window and compressor phases
        ids = torch.randint(2, vocab, (n,), generator=gen).tolist()
        model(ForwardBatch.build([SeqChunk(st, 0, n, table)], [ids], dev), cache)
        states.append(st)
        tables.append(table)
    model.ops, ops.cuda_graphs = ops, True
    steps = [torch.randint(2, vocab, (n_seq,), generator=gen).tolist() for _ in range(6)]
    return cache, states, tables, steps


def _decode(model, cache, states, tables, steps, graphs: bool, dev: str = DEVICE, keep: bool = False):
    """The logits of ``steps`` from copies of ``cache`` and ``states`` (and, with ``keep``, the copies after them)."""
    model.ops.cuda_graphs = graphs
    cache, states = copy.deepcopy(cache), [s.clone() for s in states]
    out = []
    for ids in steps:
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        out.append(model.logits(model(ForwardBatch.build(chunks, [[i] for i in ids], dev), cache)))
    model.ops.cuda_graphs = True
    return (torch.stack(out), cache, states) if keep else torch.stack(out)


def _same_state(a, b, exact: bool) -> None:
    """Two runs' caches (every page a block table may name) and sequence states agree."""
    same = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=1e-4, rtol=1e-4))
    (ca, sa), (cb, sb) = a, b
    for kind, layer in ca.stores():
        assert same(ca._store(kind, layer)[: ca.num_pages], cb._store(kind, layer)[: cb.num_pages]), (kind, layer)
    for x, y in zip(sa, sb):
        assert x.num_tokens == y.num_tokens and x.windows.keys() == y.windows.keys()
        assert all(same(x.windows[k], y.windows[k]) for k in x.windows)
        for k, buf in x.buffers.items():
            assert (
                buf.start == y.buffers[k].start
                and same(buf.kv, y.buffers[k].kv)
                and same(buf.score, y.buffers[k].score)
            )


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_bit_for_bit(dtype):
    model = _model(dtype)
    for n_seq in (4, 1):  # bucket sizes: the replay runs the eager kernels on the eager shapes
        cache, states, tables, steps = _setup(model, n_seq, 37, seed=n_seq)
        eager = _decode(model, cache, states, tables, steps, graphs=False)
        before = model.decode_graphs.replays if model.decode_graphs else 0
        graphed = _decode(model, cache, states, tables, steps, graphs=True)
        assert model.decode_graphs.replays == before + len(steps)
        assert torch.equal(eager, graphed), (eager - graphed).abs().max().item()


@gpu_only
def test_a_padded_bucket_is_close_to_eager():
    model = _model()
    cache, states, tables, steps = _setup(model, 3, 41, seed=7)  # runs in bucket 4
    eager = _decode(model, cache, states, tables, steps, graphs=False)
    graphed = _decode(model, cache, states, tables, steps, graphs=True)
    assert model.decode_graphs.replays == len(steps)
    assert (eager - graphed).abs().max().item() < 1e-4


@gpu_only
def test_batches_past_the_largest_bucket_run_eagerly_or_piecewise():
    """Past the largest decode bucket a step runs eagerly, or with ``prefill_graphs`` as a piecewise one (the
    attention eager between graphs, in a padded token bucket: close to eager)."""
    model = _model()
    model.decode_graphs = DecodeGraphs(model, max_batch=2)
    cache, states, tables, steps = _setup(model, 3, 20, seed=3)
    eager = _decode(model, cache, states, tables, steps, graphs=False)
    model.ops.prefill_graphs = False
    graphed = _decode(model, cache, states, tables, steps, graphs=True)
    assert model.decode_graphs.replays == 0 and torch.equal(eager, graphed)
    model.ops.prefill_graphs = True
    piecewise = _decode(model, cache, states, tables, steps, graphs=True)
    assert model.decode_graphs.replays == 0 and model.prefill_graphs.replays == len(steps)
    assert (eager - piecewise).abs().max().item() < 1e-4


class _Segments:
    """Stands in for a captured graph: ``replay`` runs the segment eagerly."""

    def __init__(self, seg) -> None:
        self.replay = seg


class EagerSegments(DecodeGraphs):
    """``DecodeGraphs``' step plumbing (static inputs, the plan, padding) without CUDA: each "graph" runs its
    segment eagerly, on any device."""

    def applies(self, batch: ForwardBatch) -> bool:
        return bool(batch.chunks) and all(c.length == 1 for c in batch.chunks)

    def _capture(self, size: int, device: torch.device, extra: tuple = (), before=None):
        bk = self._bucket(size, device, *extra)
        if before is not None:
            before(bk)
        bk.graphs = [_Segments(seg) for seg in self._segments(bk)]
        return bk


@pytest.mark.parametrize(("name", "kernels"), [("base", False), ("odd", False), ("base", True)])
def test_the_graphed_step_equals_the_eager_step_on_cpu(name, kernels):
    """The whole-step function the graphs capture, run eagerly on the host, against the eager steps: at a bucket's
    size (4 sequences) with the Triton kernels (``NvidiaOps`` in the interpreter) the same logits, caches and states
    bit for bit (its lists are as wide as the bucket's span, the kernels read only the listed rows); with the
    reference ops within rounding (torch's reductions over the wider lists round differently). In a padded bucket (3
    in 4) within rounding: the padding rows write only to the scratch slot and page."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from models.tiny_configs import CONFIGS

    if kernels and not INTERPRET:
        pytest.skip("the Triton kernels on the host need TRITON_INTERPRET=1")
    config = DeepseekV4Config.from_dict({**TINY_V4, **CONFIGS[name], "num_nextn_predict_layers": 0})
    ops = NvidiaOps(cuda_graphs=True) if kernels else ReferenceOps()
    ops.cuda_graphs = True
    model = DeepseekV4Model(config, ops)
    model.step_graphs = FAMILY.step_graphs()  # the runtime's choice of graphs, as the engine's build attaches it
    model.load_state_dict(random_weights(config, seed=1), strict=False)
    model.decode_graphs = EagerSegments(model, max_batch=8)
    for n_seq, exact in ((4, True), (3, False))[: 1 if kernels else 2]:  # the interpreter is slow: one bucket
        # (the prefill on the reference ops: in the interpreter it took most of the test's time)
        cache, states, tables, steps = _setup(model, n_seq, 30, seed=n_seq, dev="cpu", prefill_ops=ReferenceOps())
        steps = steps[:4] if kernels else steps  # every sequence completes a group of 4 (positions 27 .. 33)
        exact = exact and kernels
        eager, *a = _decode(model, cache, states, tables, steps, graphs=False, dev="cpu", keep=True)
        before = model.decode_graphs.replays
        graphed, *b = _decode(model, cache, states, tables, steps, graphs=True, dev="cpu", keep=True)
        assert model.decode_graphs.replays == before + len(steps)
        if exact:
            assert torch.equal(eager, graphed)
        else:
            assert (eager - graphed).abs().max().item() < 1e-4
        _same_state(a, b, exact)


@gpu_only
def test_a_decode_step_never_waits_for_the_gpu():
    """The host issues a whole decode step (pooled state, graphs, eager attention between them, the logits) while
    the GPU is still busy with work queued before it: no synchronising call (sync debug mode "error"), and the work
    queued ahead is still running when the step returns. Synchronous metadata copies (``host_copy.BLOCKING``, as
    ``ForwardBatch.build`` made them before) make it fail."""
    model = _model(torch.bfloat16)
    cache, states, tables, steps = _setup(model, 4, 37, seed=11)
    steps = steps + [s[::-1] for s in steps]  # 12 steps: every compressor completes rows on the way

    def step(ids):
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        return model.logits(model(ForwardBatch.build(chunks, [[i] for i in ids], DEVICE), cache))

    assert_steps_never_wait(step, steps)


@gpu_only
def test_pdl_launches_change_no_bit(monkeypatch):
    """Every Triton kernel launched with programmatic dependent launch (``kernels.pdl``, on from compute capability
    9.0) against ordinary launches: the same logits, caches and states bit for bit, eager and graphed (eager prefill
    included: ``_setup`` runs it)."""
    from deepinfer.kernels import pdl

    monkeypatch.setattr(pdl, "ENABLED", pdl.ENABLED)  # as it was, after the test
    runs = []
    for flag in (True, False):
        pdl.configure(flag)  # DEEPINFER_PDL, as the nvidia backend hands it over
        assert bool(pdl.launch()) == (flag and torch.cuda.get_device_capability()[0] >= 9)
        model = _model(torch.bfloat16)
        cache, states, tables, steps = _setup(model, 4, 37, seed=5)
        eager = _decode(model, cache, states, tables, steps, graphs=False, keep=True)
        graphed = _decode(model, cache, states, tables, steps, graphs=True, keep=True)
        assert torch.equal(eager[0], graphed[0])
        runs.append(graphed)
    pdl.reset()
    assert torch.equal(runs[0][0], runs[1][0])
    _same_state(runs[0][1:], runs[1][1:], exact=True)
