"""The runtime, not the model, picks a step's graphs (``runtime.step_graphs``, issue 35): without ``step_graphs`` a
model runs every step eagerly whatever its op set says; with it, a step replays the decode graphs, else the piecewise
prefill graphs, each made on the first step that may use it, as the op set's flags (and V4.1's ``piecewise_prefill``
and ``capture``) allow. Stand-in graphs on the CPU; the real ones run in ``tests/kernels/test_graphs*.py`` and
``test_prefill_graphs*.py`` on a GPU."""

from __future__ import annotations

import types

import torch

from deepinfer.backends.reference import BatchInvariantOps, ReferenceOps
from deepinfer.checkpoint.tiny import TINY_V4, random_weights
from deepinfer.models.deepseek_v4 import family as v4_family
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41 import family as v41_family
from deepinfer.runtime.step_graphs import StepGraphs


class Stub:
    """Graphs that take a step when ``takes`` says so (returning ``out``), recording each call."""

    made: list[str] = []

    def __init__(self, model: object, kind: str, takes: bool, out: torch.Tensor) -> None:
        self.kind, self.takes, self.out, self.calls = kind, takes, out, 0
        Stub.made.append(kind)

    def run(self, batch: object, cache: object) -> torch.Tensor | None:
        self.calls += 1
        return self.out if self.takes else None


def _graphs(decode_takes: bool, prefill_takes: bool, out: torch.Tensor) -> StepGraphs:
    return StepGraphs(lambda m: Stub(m, "decode", decode_takes, out), lambda m: Stub(m, "prefill", prefill_takes, out))


def _model(ops: object, **flags: bool) -> types.SimpleNamespace:
    for k, v in flags.items():
        setattr(ops, k, v)
    return types.SimpleNamespace(ops=ops, decode_graphs=None, prefill_graphs=None)


def test_the_choice_follows_the_op_sets_flags() -> None:
    out = torch.ones(1)
    Stub.made = []
    eager = _model(ReferenceOps())  # no cuda_graphs attribute: eager, nothing made
    assert _graphs(True, True, out).run(eager, None, None) is None and Stub.made == []
    inv = _model(BatchInvariantOps(), cuda_graphs=True, prefill_graphs=True)
    assert _graphs(True, True, out).run(inv, None, None) is None and Stub.made == []
    m = _model(ReferenceOps(), cuda_graphs=True, prefill_graphs=False)
    assert _graphs(True, True, out).run(m, None, None, capture=True) is None and Stub.made == []
    graphs = _graphs(True, True, out)
    assert graphs.run(m, None, None) is out and Stub.made == ["decode"]
    m.decode_graphs.takes = False  # not a graphed decode step
    assert graphs.run(m, None, None) is None and Stub.made == ["decode"]  # the decode graphs kept, no prefill ones
    m.ops.prefill_graphs = True
    assert graphs.run(m, None, None) is out and Stub.made == ["decode", "prefill"]
    assert m.decode_graphs.calls == 3 and m.prefill_graphs.calls == 1
    m.piecewise_prefill = False  # V4.1's switch
    assert graphs.run(m, None, None) is None and m.prefill_graphs.calls == 1
    m.piecewise_prefill, given = True, Stub(m, "given", True, out)
    m.prefill_graphs = given  # set by hand (tests, benchmarks): used as it is
    assert graphs.run(m, None, None) is out and given.calls == 1 and Stub.made[-1] == "given"
    m.prefill_graphs = None
    assert StepGraphs(m.decode_graphs.__class__).run(m, None, None) is None  # no prefill graphs at all
    assert m.prefill_graphs is None


def test_the_families_supply_their_graphs() -> None:
    from deepinfer.models.deepseek_v4.graphs import DecodeGraphs
    from deepinfer.models.deepseek_v4.prefill_graphs import PrefillGraphs
    from deepinfer.models.deepseek_v41 import graphs as g41
    from deepinfer.models.deepseek_v41 import prefill_graphs as p41

    v4, v41 = v4_family.FAMILY.step_graphs(), v41_family.FAMILY.step_graphs()
    assert (v4.decode, v4.prefill) == (DecodeGraphs, PrefillGraphs)
    assert (v41.decode, v41.prefill) == (g41.DecodeGraphs, p41.PrefillGraphs)


def test_the_model_asks_its_step_graphs_and_runs_eagerly_without() -> None:
    config = DeepseekV4Config.from_dict({**TINY_V4, "num_nextn_predict_layers": 0})
    model = DeepseekV4Model(config, ReferenceOps())
    model.load_state_dict(random_weights(config, seed=3), strict=False)
    assert model.step_graphs is None and model.decode_graphs is None and model.prefill_graphs is None
    model.ops.cuda_graphs = model.ops.prefill_graphs = True  # without step_graphs: eager all the same
    cache = PagedKVCache(config, 4, 16)
    state, table = SequenceState(), torch.arange(2)
    h = model(ForwardBatch.build([SeqChunk(state, 0, 5, table)], [[5, 6, 7, 8, 9]]), cache)
    assert h.shape[0] == 5 and model.decode_graphs is None and state.num_tokens == 5
    sentinel = torch.zeros(1, config.hc_mult, config.hidden_size)
    model.step_graphs = _graphs(True, False, sentinel)
    got = model(ForwardBatch.build([SeqChunk(state, 5, 1, table)], [[10]]), cache)
    assert got is sentinel and model.decode_graphs.calls == 1 and state.num_tokens == 6
