"""DeepSeek-V4.1 prefill and mixed steps replayed from piecewise CUDA graphs
(``deepinfer.models.deepseek_v41.prefill_graphs``) against eager steps.

On any host the pieces' plumbing (static inputs with the Engram row ids or looked-up rows, padding, one step context
for the eager attention between pieces, the histories advanced once) runs with each "graph" eager: the same trunk
outputs, caches and states as eager steps, bit for bit at a bucket's size. On a CUDA machine a tiny model with every
layer kind and Engram (``tests/models/tiny_v41.py``) prefills the same chunks eagerly and from graphs: bit-identical
at bucket sizes in fp32 and bf16, with the Engram tables on the device and on the host, close in padded buckets; the
steps the pieces refuse and a failed capture run eagerly with eager results and histories.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_graphs_v41 import PADDED_ATOL, _model  # noqa: E402

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.models.deepseek_v41.prefill_graphs import PrefillGraphs  # noqa: E402
from models.tiny_v41 import build_tokenizer  # noqa: E402
from prefill_pieces import eager_pieces, failing_capture, run_plan, same_runs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
PAGE = 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _run(model, plan, graphs: bool, seed: int = 0, dev: str = DEVICE):
    """``run_plan`` on the V4.1 tiny model."""
    return run_plan(model, plan, graphs, vocab=model.text.vocab_size, low=5, page=PAGE, dev=dev, seed=seed)


def _same(a, b, exact: bool, atol: float = 1e-4) -> None:
    same_runs(a, b, exact, atol=atol)


EagerPieces = eager_pieces(PrefillGraphs)


# one sequence at a bucket's size; padded chunks continuing a sequence; a mixed step (prefill chunks beside a decode)
PLANS = {
    "exact": ([[(0, 32)]], True),
    "padded": ([[(0, 21)], [(0, 13)]], False),
    "mixed": ([[(0, 11), (1, 6)], [(0, 1), (1, 20)]], False),
}


def _eager_pieces_model(tokenizer, name: str, tables: str, ops=None):
    from deepinfer.backends.reference import ReferenceOps

    model = _model(tokenizer, ops or ReferenceOps(), name, dev="cpu")
    if tables == "host":
        model.place_engram_tables("cpu")  # the same device here: a bucket takes the looked-up rows only on CUDA
    model.ops.cuda_graphs = model.ops.prefill_graphs = model.piecewise_prefill = True
    model.prefill_graphs = EagerPieces(model, max_tokens=64)
    return model


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("name", ["sketch", "mixed"])
def test_the_v41_pieces_equal_the_eager_step_on_cpu(tokenizer, name, plan):
    model = _eager_pieces_model(tokenizer, name, "device")
    steps, exact = PLANS[plan]
    eager = _run(model, steps, graphs=False, dev="cpu")
    graphed = _run(model, steps, graphs=True, dev="cpu")
    assert model.prefill_graphs.replays == len(steps)
    _same(eager, graphed, exact)


def test_the_v41_pieces_with_looked_up_engram_rows_on_cpu(tokenizer):
    """With ``tables_on_device`` false the pieces read looked-up Engram rows from their static buffers."""
    model = _eager_pieces_model(tokenizer, "sketch", "host")
    model.prefill_graphs.tables_on_device = lambda device: False
    steps, _ = PLANS["padded"]
    eager = _run(model, steps, graphs=False, dev="cpu")
    graphed = _run(model, steps, graphs=True, dev="cpu")
    bk = next(iter(model.prefill_graphs.buckets.values()))
    assert bk.engram is None and bk.engram_rows and model.prefill_graphs.replays == len(steps)
    _same(eager, graphed, exact=False)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on the host need TRITON_INTERPRET=1")
def test_the_v41_pieces_with_the_kernels_on_cpu(tokenizer):
    from deepinfer.backends.nvidia import NvidiaOps

    model = _eager_pieces_model(tokenizer, "sketch", "device", NvidiaOps(cuda_graphs=True))
    steps = [[(0, 9), (1, 5)]]  # bucket 16: the interpreter is slow
    _same(_run(model, steps, False, dev="cpu"), _run(model, steps, True, dev="cpu"), exact=False)


def test_v41_steps_the_pieces_refuse(tokenizer):
    """Image embeddings, a bounded decoder replay, host tensors: no pieces; DSpark feature capture never asks."""
    model = _eager_pieces_model(tokenizer, "sketch", "device")
    graphs = model.prefill_graphs
    st = SequenceState()
    two = ForwardBatch.build([SeqChunk(st, 0, 2, torch.arange(4))], [[7, 8]])
    assert graphs.applies(two) and not PrefillGraphs.applies(graphs, two)  # on the host
    assert not graphs.applies(ForwardBatch(two.token_ids, two.positions, two.chunks, image_mask=torch.ones(2) > 0))
    assert not graphs.applies(ForwardBatch(two.token_ids, two.positions, two.chunks, input_embeds=torch.zeros(2, 64)))
    assert not graphs.applies(ForwardBatch.build([SeqChunk(st, 0, 2, torch.arange(4), decoder_from=1)], [[7, 8]]))


# -- GPU -------------------------------------------------------------------------------------------------------


def _nvidia_model(tokenizer, dtype: torch.dtype, name: str = "sketch"):
    from deepinfer.backends.nvidia import NvidiaOps

    model = _model(tokenizer, NvidiaOps(cuda_graphs=True), name, dtype)
    model.ops.prefill_graphs = model.piecewise_prefill = True
    return model


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_graphed_prefill_equals_eager_bit_for_bit(tokenizer, dtype):
    model = _nvidia_model(tokenizer, dtype)
    for steps in ([[(0, 64)]], [[(0, 20), (1, 12)], [(0, 16)]]):  # bucket sizes: 64, 32, 16
        eager = _run(model, steps, graphs=False, seed=len(steps))
        before = model.prefill_graphs.replays if model.prefill_graphs else 0
        graphed = _run(model, steps, graphs=True, seed=len(steps))
        assert model.prefill_graphs.replays == before + len(steps) and not model.prefill_graphs.failures
        _same(eager, graphed, exact=True)


@gpu_only
def test_v41_engram_tables_on_the_host_and_padded_steps(tokenizer):
    model = _nvidia_model(tokenizer, torch.float32)
    model.place_engram_tables("cpu")
    steps, _ = PLANS["exact"]
    _same(_run(model, steps, graphs=False), _run(model, steps, graphs=True), exact=True)
    for name in ("padded", "mixed"):
        steps, _ = PLANS[name]
        _same(_run(model, steps, graphs=False, seed=1), _run(model, steps, graphs=True, seed=1), False, PADDED_ATOL)
    assert not model.prefill_graphs.failures and all(bk.engram is None for bk in model.prefill_graphs.buckets.values())


@gpu_only
def test_v41_failed_captures_and_refused_steps_run_eagerly(tokenizer, monkeypatch):
    model = _nvidia_model(tokenizer, torch.float32)
    steps = [[(0, 12)], [(0, 7), (1, 3)]]
    eager = _run(model, steps, graphs=False)
    monkeypatch.setattr(PrefillGraphs, "_segments", failing_capture(PrefillGraphs))
    graphed = _run(model, steps, graphs=True)  # the Engram histories are hashed again by the eager steps
    assert model.prefill_graphs.replays == 0 and list(model.prefill_graphs.failures) == [16]
    _same(eager, graphed, exact=True)


def test_v41_pieces_switch_off(tokenizer):
    """The pieces are on by default (their GPU tests passed on an H200); ``piecewise_prefill = False`` runs prefill
    steps eagerly whatever ``ops.prefill_graphs`` says."""
    from deepinfer.backends.reference import ReferenceOps

    model = _model(tokenizer, ReferenceOps(), "sketch", dev="cpu")
    assert model.piecewise_prefill
    model.ops.cuda_graphs = model.ops.prefill_graphs = True
    model.piecewise_prefill = False
    _run(model, PLANS["exact"][0], graphs=True, dev="cpu")
    assert model.prefill_graphs is None
