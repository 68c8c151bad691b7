"""Speculative verify steps replayed from CUDA graphs against the same steps run eagerly.

* On the decode path (``verify_step``, ``verify_graphs.VerifyGraphs``): two verify steps of four sequences (three,
  two, one and no drafts: dead rows in the last sub-steps), each rolled back, then a decode step: the logits of
  every step, and the pooled state (window and compressor rings) and the paged cache after each, are bit for bit
  the eager path's; the second step replays a captured bucket.
* DeepSeek-V4.1 on the decode path (``deepseek_v41.verify_graphs``): the same, with DSpark's features and the
  Engram histories; DSpark's draft pass (``deepseek_v41.dspark_graphs``) as its eager pass.
* On the ragged path (the model without pooled decode steps): a step that keeps its compressor projections
  (``model.verifying``) never replays decode graphs and may replay the piecewise prefill graphs, whose attention
  runs eagerly between the pieces. At a bucket's size (16 rows: four sequences, each its token and three drafts)
  the logits, and after the rollback the states and the paged cache, are bit for bit the eager step's; the
  projections kept for the rollback are copies (the pieces reuse their buffers, so views would hold a later layer's
  rows).

On a host without CUDA: the choice of graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.speculative import verify  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.runtime.step_graphs import StepGraphs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")
PAGE, PAGES = 16, 8


class _Graphs:
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def run(self, batch, cache):
        self.seen.append(self.name)
        return None


class _Model:
    def __init__(self) -> None:
        flags = {"cuda_graphs": True, "prefill_graphs": True, "batch_invariant": False, "invariant_by_sequence": False}
        self.ops = type("Ops", (), flags)()
        self.decode_graphs = self.prefill_graphs = None


def test_a_capturing_step_skips_the_decode_graphs() -> None:
    seen: list[str] = []
    graphs = StepGraphs(lambda m: _Graphs("decode", seen), lambda m: _Graphs("prefill", seen))
    model = _Model()
    assert graphs.run(model, None, None) is None and seen == ["decode", "prefill"]
    seen.clear()
    assert graphs.run(model, None, None, capture=True) is None and seen == ["prefill"]


def _model(mtp: bool = False, seed: int = 0):
    """The tiny V4 model on the nvidia ops with graphs allowed (``graphs_to_use``: its family's), with or without its
    MTP block."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    config = DeepseekV4Config.from_dict(TINY_V4 if mtp else {**TINY_V4, "num_nextn_predict_layers": 0})
    model = DeepseekV4Model(config, NvidiaOps(cuda_graphs=True))
    model.ops.cuda_graphs = model.ops.prefill_graphs = True
    model.load_state_dict(random_weights(config, seed=seed), strict=False)
    model = model.to(DEVICE, torch.float32)
    model.graphs_to_use = FAMILY.step_graphs()
    return model


def _verify(graphs: bool) -> tuple:
    model = _model()
    model.pooled_decode = False  # the ragged path
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 34, 9, 50)]
    drafts = [torch.randint(2, cfg.vocab_size, (3,), generator=g).tolist() for _ in prompts]
    cache = PagedKVCache(cfg, PAGES * len(prompts), PAGE, torch.float32, DEVICE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES, device=DEVICE) for i in range(len(prompts))]
    states = [SequenceState() for _ in prompts]
    with torch.no_grad():  # the prompts eagerly in both runs
        batch = ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)], prompts,
                                   device=DEVICE)  # fmt: skip
        h = model(batch, cache)
        last = [int(x) for x in model.logits(h)[[b - 1 for _, b in batch.offsets()]].argmax(-1).tolist()]
    model.step_graphs = model.graphs_to_use if graphs else None
    step = verify(model, cache, states, tables, last, drafts)
    logits = step.logits.clone()
    captured = {k: (v[0].clone(), v[1].clone()) for k, v in step.captured.items()}
    step.rollback([0, 1, 2, 3])
    torch.cuda.synchronize()
    return model, logits, captured, states, cache


def _prompts(model) -> tuple:
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 34, 9, 50)]
    cache = PagedKVCache(cfg, PAGES * len(prompts), PAGE, torch.float32, DEVICE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES, device=DEVICE) for i in range(len(prompts))]
    states = [SequenceState() for _ in prompts]
    with torch.no_grad():
        batch = ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)], prompts,
                                   device=DEVICE)  # fmt: skip
        h = model(batch, cache)
        last = [int(x) for x in model.logits(h)[[b - 1 for _, b in batch.offsets()]].argmax(-1).tolist()]
    return g, cache, tables, states, last


def _snapshot(model, states, cache) -> list[torch.Tensor]:
    out = []
    for st in states:
        out += [st.windows[k].clone() for k in sorted(st.windows)]
        out += [t.clone() for k in sorted(st.buffers) for t in (st.buffers[k].kv, st.buffers[k].score)]
    return out + [x.clone() for store in (cache.rows, cache.index_keys) for x in store.values()]


def _pooled(graphs: bool, fused: bool = False) -> tuple:
    model = _model()
    model.verify_fused = fused
    g, cache, tables, states, last = _prompts(model)
    model.step_graphs = model.graphs_to_use if graphs else None
    seen = []
    for accepted in ([0, 1, 1, 0], [3, 0, 1, 0]):
        drafts = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 2, 1, 0)]
        step = verify(model, cache, states, tables, last, drafts)
        seen.append(step.logits.clone())
        step.rollback(accepted)
        seen += _snapshot(model, states, cache)
        last = [int(x) for x in step.logits.argmax(-1).tolist()[:4]]  # any tokens: the same in both runs
    with torch.no_grad():
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        seen.append(model.logits(model(ForwardBatch.build(chunks, [[x] for x in last], device=DEVICE), cache)))
    torch.cuda.synchronize()
    return model, seen


@gpu_only
@pytest.mark.parametrize("fused", [False, True])
def test_verify_on_the_decode_path_replays_its_graphs_bit_for_bit(fused: bool) -> None:
    eager_model, eager = _pooled(False, fused)
    model, graphed = _pooled(True, fused)
    assert eager_model.verify_graphs is None
    assert model.verify_graphs is not None and model.verify_graphs.replays == 2 and model.verify_graphs.captures == 1
    assert model.verify_graphs.failures == {}
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), i


@gpu_only
def test_verify_replays_piecewise_graphs_bit_for_bit() -> None:
    eager_model, eager, eager_cap, eager_states, eager_cache = _verify(False)
    model, graphed, cap, states, cache = _verify(True)
    assert model.prefill_graphs is not None and model.prefill_graphs.replays > 0
    assert model.decode_graphs is None or model.decode_graphs.replays == 0
    assert eager_model.prefill_graphs is None
    assert torch.equal(eager, graphed)
    assert cap.keys() == eager_cap.keys() and cap
    for k in cap:  # the kept projections of every layer are that layer's (copies, not the pieces' buffers)
        assert torch.equal(cap[k][0], eager_cap[k][0]) and torch.equal(cap[k][1], eager_cap[k][1]), k
    for a, b in zip(eager_states, states):
        assert a.windows and a.buffers  # (per-sequence state: a verify step does not use the decode pool)
        assert a.num_tokens == b.num_tokens
        assert a.windows.keys() == b.windows.keys()
        assert all(torch.equal(a.windows[k], b.windows[k]) for k in a.windows)
        assert a.buffers.keys() == b.buffers.keys()
        for k in a.buffers:
            x, y = a.buffers[k], b.buffers[k]
            assert x.start == y.start and torch.equal(x.kv, y.kv) and torch.equal(x.score, y.score), k
    for store in ("rows", "index_keys"):
        mine, theirs = getattr(eager_cache, store), getattr(cache, store)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@gpu_only
def test_the_draft_loop_replays_its_graphs_bit_for_bit() -> None:
    """The MTP drafter's loop (``draft_graphs.DraftGraphs``) replayed against the same loop run eagerly: the same
    drafts, twice (a capture, then a replay), and the block's window left as it was; fewer drafts from a drafter
    padded to the full count replay the same graph and give the first drafts of the full run."""
    from deepinfer.models.deepseek_v4.mtp_drafter import MTPDrafter

    model = _model(mtp=True, seed=1)
    config = model.config
    g, _, tables, states, _ = _prompts(model)
    drafter = MTPDrafter(model)
    hs = []
    for st in states:  # the block consumes every prompt position (any streams will do)
        st.mtp_tokens = 0
        hs.append(torch.randn(st.num_tokens, config.hc_mult, config.hidden_size, generator=g).to(DEVICE))
    layer = config.num_hidden_layers
    heads = [drafter.observe(h, [(0, h.shape[0])], [[2] * h.shape[0]], [st], [t])[0]
             for h, st, t in zip(hs, states, tables)]  # fmt: skip
    before = [st.windows[layer].clone() for st in states]
    counts = [4, 3, 4, 1]
    eager = drafter.draft(heads, counts, states, tables)
    model.step_graphs = model.graphs_to_use
    first = drafter.draft(heads, counts, states, tables)
    again = drafter.draft(heads, counts, states, tables)
    torch.cuda.synchronize()
    assert model.draft_graphs is not None and model.draft_graphs.replays == 2 and model.draft_graphs.captures == 1
    assert eager == first == again and [len(d) for d in eager] == counts
    assert all(torch.equal(st.windows[layer], b) for st, b in zip(states, before))
    short = [2, 1, 2, 1]  # near max_tokens: a drafter padded to 4 replays the 4-draft graph, no capture of its own
    padded = MTPDrafter(model, pad=4).draft(heads, short, states, tables)
    torch.cuda.synchronize()
    assert model.draft_graphs.replays == 3 and model.draft_graphs.captures == 1
    assert padded == [d[:n] for d, n in zip(eager, short)]
    assert all(torch.equal(st.windows[layer], b) for st, b in zip(states, before))


@gpu_only
@pytest.mark.parametrize("fused", [False, True])
def test_the_observe_pass_replays_its_graphs_bit_for_bit(fused: bool) -> None:
    """The MTP drafter's observe pass on the decode path (``draft_graphs.ObserveGraphs``: 3, 1, 2 and 3 rows per
    sequence) replayed against the same pass run eagerly, from the same state: the same heads and block windows."""
    from deepinfer.models.deepseek_v4.mtp_drafter import MTPDrafter

    model = _model(mtp=True, seed=2)
    model.verify_fused = fused
    config = model.config
    g, _, tables, states, _ = _prompts(model)
    drafter, layer, counts = MTPDrafter(model), config.num_hidden_layers, [3, 1, 2, 3]
    h = torch.randn(sum(counts), config.hc_mult, config.hidden_size, generator=g).to(DEVICE)
    ids = torch.randint(2, config.vocab_size, (sum(counts),), generator=g).to(DEVICE)
    for st, n in zip(states, counts):
        st.mtp_tokens = st.num_tokens - n
    model.state_pool.adopt(states)
    ring0 = model.state_pool.rings[layer].clone()

    def observe() -> list:
        for st, n in zip(states, counts):
            st.mtp_tokens = st.num_tokens - n
        model.state_pool.rings[layer].copy_(ring0)
        heads = drafter.observe_rows(h, ids, counts, states, tables)
        # (the states' windows: the scratch slot, where dead rows write, is no state's)
        return [x for hd in heads for x in (hd.streams, hd.logits)] + [st.windows[layer].clone() for st in states]

    eager = observe()
    model.step_graphs = model.graphs_to_use
    first, again = observe(), observe()
    torch.cuda.synchronize()
    assert model.observe_graphs is not None and model.observe_graphs.replays == 2
    assert model.observe_graphs.captures == 1 and model.observe_graphs.failures == {}
    for i, (a, b, c) in enumerate(zip(eager, first, again)):
        assert torch.equal(b, c), (i, (b - c).abs().max())
        assert torch.equal(a, b), (i, (a - b).abs().max(), (a - b).abs().nonzero()[:8].tolist())


def _v41_verify(graphs: bool, pad: int, fused: bool = False) -> tuple:
    """DeepSeek-V4.1 (the tiny "mixed" model, DSpark stage and Engram, nvidia ops): four prompts, then two verify
    steps of 3, 2, 1 and 0 drafts on the decode path (``deepseek_v41.verify_step``), each rolled back, then a
    decode step; ``pad``: the drafts a graphed step pads to. Everything a step returns and leaves, in order."""
    from deepinfer.backends.nvidia import NvidiaOps
    from models.tiny_v41 import build_tokenizer, random_model

    model = random_model(build_tokenizer(), NvidiaOps(cuda_graphs=True), "mixed", dev=DEVICE)
    model.ops.cuda_graphs, model.piecewise_prefill = False, False
    model.verify_fused = fused
    g = torch.Generator().manual_seed(5)
    vocab = model.text.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (21, 34, 9, 50)]
    cache = PagedKVCache(model.config, PAGES * 4, PAGE, torch.float32, DEVICE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES, device=DEVICE) for i in range(4)]
    states = [SequenceState() for _ in prompts]
    seen = []
    with torch.no_grad():
        chunks = [SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)]
        model(ForwardBatch.build(chunks, prompts, device=DEVICE), cache)
        model.ops.cuda_graphs = graphs
        for accepted in ([0, 1, 1], [3, 0, 1]):
            ids = [torch.randint(5, vocab, (n + 1,), generator=g).tolist() for n in (3, 2, 1, 0)]
            chunks = [SeqChunk(s, s.num_tokens, len(x), t) for s, x, t in zip(states, ids, tables)]
            y, f, pending = model.verify_forward(ForwardBatch.build(chunks, ids, device=DEVICE), cache, [0, 1, 2],
                                                 pad, True)  # fmt: skip
            seen += [y.clone(), f.clone()]
            pending.rollback(accepted)
            seen += _snapshot(model, states, cache) + [torch.tensor([list(s.history) for s in states])]
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        seen.append(model(ForwardBatch.build(chunks, [[7]] * 4, device=DEVICE), cache).clone())
    torch.cuda.synchronize()
    return model, seen


@gpu_only
@pytest.mark.parametrize("fused", [False, True])
def test_v41_verify_on_the_decode_path_replays_its_graphs_bit_for_bit(fused: bool) -> None:
    """V4.1's verify graphs (``deepseek_v41.verify_graphs``): outputs, DSpark features, states, histories, cache and
    the next decode step bit for bit the eager path's; the second step replays the bucket the first captured."""
    _, eager = _v41_verify(False, 0, fused)
    model, graphed = _v41_verify(True, 0, fused)
    vg = model.verify_graphs
    assert vg is not None and not vg.failures and vg.replays == 2 and vg.captures == 1
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), i


def _dspark_after_prefill() -> tuple:
    """A tiny V4.1 model on the nvidia ops (graphs off) and its DSpark speculator after four prompts' prefill, which
    DSpark followed: ``(model, spec, cache, tables, states, rids)``."""
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.models.deepseek_v41.speculator import DSparkSpeculator
    from models.tiny_v41 import build_tokenizer, random_model

    model = random_model(build_tokenizer(), NvidiaOps(cuda_graphs=True), "sketch", dev=DEVICE)
    model.ops.cuda_graphs, model.piecewise_prefill = False, False
    spec = DSparkSpeculator(model, 3, varlen=False)
    g = torch.Generator().manual_seed(6)
    vocab = model.text.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (21, 34, 9, 50)]
    cache = PagedKVCache(model.config, PAGES * 4, PAGE, torch.float32, DEVICE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES, device=DEVICE) for i in range(4)]
    states, rids = [SequenceState() for _ in prompts], [f"r{i}" for i in range(4)]
    with torch.no_grad():
        batch = ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)], prompts,
                                   device=DEVICE)  # fmt: skip
        h, _ = spec.forward(batch, cache, [], [], [])
        spec.follow(batch, h, [0, 1, 2, 3], rids)
    return model, spec, cache, tables, states, rids


@gpu_only
def test_v41_draft_pass_replays_its_graph_bit_for_bit() -> None:
    """DSpark's draft pass (``deepseek_v41.dspark_graphs``) captured and replayed: the drafts and confidences of
    four sequences, from their context rings after a prefill, bit for bit the eager pass's."""
    model, spec, _, tables, states, rids = _dspark_after_prefill()
    with torch.no_grad():
        got = []
        for graphs in (False, True):
            model.ops.cuda_graphs = graphs
            got.append((spec.propose(rids, states, tables, [7, 8, 9, 10], [3] * 4),
                        [spec.last_confidence[r] for r in rids]))  # fmt: skip
    dg = model.draft_graphs
    assert dg is not None and not dg.failures and dg.captures == 1 and dg.replays == 1
    assert got[0] == got[1]


@gpu_only
def test_v41_keep_pass_replays_its_graph_bit_for_bit() -> None:
    """DSpark's keep pass (``dspark_graphs.KeepGraphs``) captured and replayed: a decode step's kept rows (four, a
    bucket's size) written to the context rings bit for bit as the eager pass writes them."""
    got = []
    for graphs in (False, True):
        model, spec, cache, tables, states, rids = _dspark_after_prefill()
        with torch.no_grad():
            step = ForwardBatch.build([SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)],
                                      [[5], [6], [7], [8]], device=DEVICE)  # fmt: skip
            h, _ = spec.forward(step, cache, [], [], [])
            model.ops.cuda_graphs = graphs  # (the keep pass only)
            spec.follow(step, h, [0, 1, 2, 3], rids)
        kg = getattr(model, "observe_graphs", None)  # (made on the first pass that may replay)
        assert (kg is not None and not kg.failures and kg.replays == 1) == graphs
        got.append((spec.rings.rows.clone(), spec.rings.pos.clone()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@gpu_only
def test_one_attention_call_attends_as_the_sub_steps_on_the_gpu() -> None:
    """``verify_attention`` on the nvidia ops (eager, V4 and V4.1): what the verify steps return and leave equals
    the sub-steps' within fp32 rounding."""
    for run in (lambda fused: _pooled(False, fused)[1], lambda fused: _v41_verify(False, 0, fused)[1]):
        subs, fused = run(False), run(True)
        assert len(subs) == len(fused)
        for i, (a, b) in enumerate(zip(subs, fused)):
            a, b = a.float(), b.float()
            assert a.shape == b.shape, i
            if a.numel():  # (a state part some layer kinds leave empty)
                assert (a - b).abs().max() <= 1e-4 * max(1.0, float(a.abs().max())), i
