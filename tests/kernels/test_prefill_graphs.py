"""Prefill and mixed steps replayed from piecewise CUDA graphs (``deepinfer.models.deepseek_v4.prefill_graphs``)
against eager steps.

On any host: the token buckets, the weak references, and the pieces' plumbing (static inputs, padding, the eager
attention between pieces writing into the pieces' buffer) with each "graph" run eagerly. On a CUDA machine a tiny
model runs the same chunks eagerly and from graphs: the same streams, caches and states bit for bit at a bucket's
size, close ones in a padded bucket; then the decode steps that follow agree; a failed capture runs eagerly; the
graphs' pool does not keep one layer's activations per piece.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.prefill_graphs import PrefillGraphs  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.runtime.piecewise_graphs import (  # noqa: E402
    PREFILL_BUCKETS,
    prefill_bucket,
    prefill_buckets,
    weak_ref,
    weaken,
)
from prefill_pieces import eager_pieces, failing_capture, run_plan, same_runs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
PAGE = 16


def test_buckets():
    assert [prefill_bucket(n, 8192) for n in (1, 16, 17, 100, 129, 1000, 4096, 4097, 8192)] == [
        16, 16, 32, 128, 192, 1024, 4096, 6144, 8192,
    ]  # fmt: skip
    assert prefill_bucket(9000, 16384) == 10240 and prefill_bucket(0, 8192) is None
    assert prefill_bucket(8193, 8192) is None and prefill_bucket(5000, 5000) == 5000  # clipped to the limit
    assert list(PREFILL_BUCKETS) == sorted(PREFILL_BUCKETS)


@pytest.mark.parametrize("limit", [1, 16, 100, 5000, 8192, 12000, 16384])
@pytest.mark.parametrize("longest", [None, 1, 15, 17, 4000, 6144, 9000, 20000])
def test_the_warm_up_buckets_are_every_bucket_a_step_runs_in(limit: int, longest: int | None):
    """``prefill_buckets``: exactly the buckets of the steps of 1 .. ``longest`` tokens (the warm-up captures them)."""
    steps = range(1, min(limit, longest or limit) + 1)
    assert prefill_buckets(limit, longest) == sorted({prefill_bucket(n, limit) for n in steps})


def test_a_weak_reference_aliases_without_owning():
    base = torch.arange(24.0).view(4, 6)
    view = base[1:, 2:5]
    w = weak_ref(view)
    assert w.data_ptr() == view.data_ptr() and w.shape == view.shape and w.stride() == view.stride()
    base.add_(1)  # the same memory
    assert torch.equal(w, view)
    out = weaken({"a": view, "b": [view, 3], "c": (view,), "d": "x"})
    assert out["b"][1] == 3 and out["d"] == "x" and isinstance(out["c"], tuple)
    assert all(t.data_ptr() == view.data_ptr() for t in (out["a"], out["b"][0], out["c"][0]))
    assert out["a"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _model(dtype: torch.dtype = torch.float32, ops=None, name: str = "base"):
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from models.tiny_configs import CONFIGS

    config = DeepseekV4Config.from_dict({**TINY_V4, **CONFIGS[name], "num_nextn_predict_layers": 0})
    model = DeepseekV4Model(config, ops or NvidiaOps(cuda_graphs=True))
    model.step_graphs = FAMILY.step_graphs()  # the runtime's choice of graphs, as the engine's build attaches it
    model.ops.cuda_graphs = model.ops.prefill_graphs = True
    model.load_state_dict(random_weights(config, seed=0), strict=False)
    return model.to(DEVICE if ops is None else "cpu", dtype)


def _run(model, plan, graphs: bool, seed: int = 0, dev: str = DEVICE, decodes: int = 2):
    """``run_plan`` on the V4 tiny model, then ``decodes`` decode steps."""
    vocab = model.config.vocab_size
    return run_plan(model, plan, graphs, vocab=vocab, low=2, page=PAGE, dev=dev, seed=seed, decodes=decodes)


def _same(a, b, exact: bool) -> None:
    same_runs(a, b, exact, atol=2e-4, rtol=2e-4)


EagerPieces = eager_pieces(PrefillGraphs)


# one sequence at a bucket's size; a padded one; a chunked prefill with a mixed step (a prefill chunk beside decodes)
PLANS = {
    "exact": ([[(0, 32)]], True),
    "padded": ([[(0, 21)], [(0, 19)]], False),
    "mixed": ([[(0, 13), (1, 9)], [(0, 1), (1, 30), (2, 5)]], False),
    "small": ([[(0, 9), (1, 5)]], False),
}


@pytest.mark.parametrize(("plan", "kernels"), [(p, False) for p in sorted(PLANS)] + [("small", True)])
def test_the_pieces_equal_the_eager_step_on_cpu(plan, kernels):
    """The pieces the graphs capture, run eagerly on the host with the eager attention between them, against eager
    steps: bit for bit at a bucket's size, within rounding in padded buckets (torch's GEMMs round by their row
    count). With the reference ops, and with the Triton kernels in the interpreter (the attention kernels writing
    into the pieces' buffer)."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.backends.reference import ReferenceOps

    if kernels and not INTERPRET:
        pytest.skip("the Triton kernels on the host need TRITON_INTERPRET=1")
    model = _model(ops=NvidiaOps(cuda_graphs=True) if kernels else ReferenceOps())
    model.prefill_graphs = EagerPieces(model, max_tokens=64)
    steps, exact = PLANS[plan]
    decodes = 0 if kernels else 2  # the interpreter is slow
    eager = _run(model, steps, graphs=False, dev="cpu", decodes=decodes)
    graphed = _run(model, steps, graphs=True, dev="cpu", decodes=decodes)
    assert model.prefill_graphs.replays == len(steps)
    _same(eager, graphed, exact)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_prefill_equals_eager_bit_for_bit(dtype):
    model = _model(dtype)
    for steps in ([[(0, 64)]], [[(0, 40), (1, 24)], [(0, 32)]]):  # bucket sizes: 64, 64, 32
        eager = _run(model, steps, graphs=False, seed=len(steps))
        before = model.prefill_graphs.replays if model.prefill_graphs else 0
        graphed = _run(model, steps, graphs=True, seed=len(steps))
        assert model.prefill_graphs.replays == before + len(steps) and not model.prefill_graphs.failures
        _same(eager, graphed, exact=True)


@gpu_only
@pytest.mark.parametrize("name", ["base", "odd"])
def test_padded_and_mixed_steps_are_close_to_eager(name):
    model = _model(name=name)
    for steps, _ in PLANS.values():
        eager = _run(model, steps, graphs=False, seed=3)
        graphed = _run(model, steps, graphs=True, seed=3)
        _same(eager, graphed, exact=False)
    assert model.prefill_graphs.replays > 0 and not model.prefill_graphs.failures


@gpu_only
def test_steps_past_the_largest_bucket_and_failed_captures_run_eagerly(monkeypatch):
    model = _model()
    model.prefill_graphs = PrefillGraphs(model, max_tokens=16)
    steps = [[(0, 20)], [(0, 12)]]  # 20 tokens: eager; 12: its capture fails (a host sync while capturing)
    eager = _run(model, steps, graphs=False)
    monkeypatch.setattr(PrefillGraphs, "_segments", failing_capture(PrefillGraphs))
    graphed = _run(model, steps, graphs=True)
    assert model.prefill_graphs.replays == 0 and list(model.prefill_graphs.failures) == [16]
    _same(eager, graphed, exact=True)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(map(_nbytes, obj.values() if isinstance(obj, dict) else obj))


@gpu_only
def test_the_pool_keeps_no_pieces_activations():
    """Once captured, a piece's carried tensors are weak references: what a bucket's capture leaves allocated is far
    below one piece's carried tensors (strong references would keep all seven pieces'). A first bucket's capture
    makes the libraries' workspaces on the capture stream, which stay."""
    model = _model()
    graphs = model.prefill_graphs = PrefillGraphs(model)

    def batch(n: int) -> ForwardBatch:
        table = torch.arange(n // PAGE, device=DEVICE)
        b = ForwardBatch.build([SeqChunk(SequenceState(), 0, n, table)], [[5] * n], DEVICE)
        _ = b.token_ids, b.positions
        return b

    graphs.bucket(batch(512))
    b = batch(1024)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    bk = graphs.bucket(b)
    torch.cuda.synchronize()
    kept, carried = torch.cuda.memory_allocated() - before, _nbytes(bk.carry[1])
    assert len(bk.graphs) == 7 and carried > 0 and kept < carried / 2, (kept, carried)
