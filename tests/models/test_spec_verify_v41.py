"""Speculative decoding on DeepSeek-V4.1 (``models/deepseek_v41/speculator.py``: DSpark drafts, verify steps with
exact rollback), driven as the engine's runner drives it, against decoding without speculation.

For each tiny configuration (ratio-1 and ratio-2 compressed layers, Engram n-grams up to 4, 1 to 3 DSpark stages, a
window of 4 that verify rows overrun), a batch of sequences decodes greedily through steps that mix verify chunks
of every draft length (DSpark's drafts, some replaced by the right token or a random one) and plain decode rows.
The emitted tokens must be a plain run's; every sequence's state after the run (windows, the ratio-2 compressors'
pending pair, the Engram history, counters, the paged rows and index keys it can read) must equal, bit for bit, a
plain run's over the same tokens, and so must the next step's logits; the drafter's context (each stage's KV of
the last ``W`` positions, kept across verify steps and rejected rows) must give the drafts and confidences that the
same context computed from one forward over the whole sequence gives. Bit for bit needs ``BatchInvariantOps``; the
default op set (pooled decode steps) is checked for the same tokens. Mutations (the history or the buffers not
rolled back) must be caught.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.backends.reference import BatchInvariantOps
from deepinfer.models.deepseek_v4 import speculative, verify_rings
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41 import verify_step as v41_verify
from deepinfer.models.deepseek_v41.context_rings import ContextRings
from deepinfer.models.deepseek_v41.dspark import gather_window
from deepinfer.models.deepseek_v41.dspark_graphs import DSparkGraphs, KeepGraphs
from deepinfer.models.deepseek_v41.family import FAMILY
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.models.deepseek_v41.speculator import DSparkSpeculator, survival_lengths
from deepinfer.models.deepseek_v41.verify_graphs import VerifyGraphs
from deepinfer.runtime.step_graphs import StepGraphs
from eager_graphs import EagerCapture
from models.test_spec_verify import PlainRun, differences
from models.test_v41_decoder_replay import _model
from models.tiny_v41 import NAMES, build_tokenizer

PAGE, PAGES = 8, 12  # pages per sequence
NEW = 24  # tokens each sequence emits at least


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def model_of(tokenizer, name: str, invariant: bool = True) -> DeepseekV41Model:
    m = _model(tokenizer, name, seed=7)
    if invariant:
        m.ops = BatchInvariantOps()
    return m


class Plain(PlainRun):
    """One sequence decoded greedily without speculation, one token per step after its prompt."""

    def __init__(self, model: DeepseekV41Model, prompt: list[int]) -> None:
        self.model, self.state, self.tokens = model, SequenceState(), list(prompt)
        self.cache, self.table = PagedKVCache(model.config, PAGES, PAGE), torch.arange(PAGES)
        self.at: dict[int, PlainRun] = {}  # copies of this run by tokens consumed (``run_to``)
        self.step(len(prompt))

    def step(self, n: int) -> torch.Tensor:
        p = self.state.num_tokens
        batch = ForwardBatch.build([SeqChunk(self.state, p, n, self.table)], [self.tokens[p : p + n]])
        logits = self.model.logits(self.model(batch, self.cache))
        self.tokens.append(int(logits[-1].argmax()))
        return logits[-1]


def speculative_run(model: DeepseekV41Model, prompts: list[list[int]], oracle: list[list[int]], rng: random.Random,
                    skip: str | None = None) -> tuple:  # fmt: skip
    """The sequences through steps of verify chunks and plain rows, as ``engine.speculative.steps`` runs them;
    ``skip``: a part of the rollback left out (a mutation). Returns tokens, states, cache, tables, speculator, stats."""
    n_seq, vocab = len(prompts), model.text.vocab_size
    spec = DSparkSpeculator(model, min(model.text.dspark_block_size, model.text.sliding_window - 1), varlen=False)
    cache = PagedKVCache(model.config, PAGES * n_seq, PAGE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(n_seq)]
    states, toks, rids = [SequenceState() for _ in prompts], [list(x) for x in prompts], [f"s{i}" for i in range(n_seq)]
    batch = ForwardBatch.build([SeqChunk(s, 0, len(x), t) for s, x, t in zip(states, prompts, tables)], prompts)
    h, _ = spec.forward(batch, cache, [], [], [])
    logits = model.logits(h)
    for t, (_, b) in zip(toks, batch.offsets()):
        t.append(int(logits[b - 1].argmax()))
    spec.follow(batch, h, list(range(n_seq)), rids)
    stats = {"drafted": 0, "kept": 0, "verify_chunks": 0, "plain_rows": 0}
    while live := [b for b in range(n_seq) if len(toks[b]) - len(prompts[b]) < NEW]:
        counts = [rng.randint(0, spec.max_drafts) for _ in live]
        drafts = spec.propose([rids[b] for b in live], [states[b] for b in live], [tables[b] for b in live],
                              [toks[b][-1] for b in live], counts)  # fmt: skip
        for b, d in zip(live, drafts):  # some drafts replaced by the right token or a random one
            p = states[b].num_tokens
            for j in range(len(d)):
                u = rng.random()
                if u < 0.6 and p + 1 + j < len(oracle[b]):
                    d[j] = oracle[b][p + 1 + j]
                elif u < 0.75:
                    d[j] = rng.randrange(vocab)
        chunks = [SeqChunk(states[b], states[b].num_tokens, 1 + len(d), tables[b]) for b, d in zip(live, drafts)]
        batch = ForwardBatch.build(chunks, [[toks[b][-1], *d] for b, d in zip(live, drafts)])
        verified = [k for k, d in enumerate(drafts) if d]
        h, pending = spec.forward(batch, cache, verified, [rids[live[k]] for k in verified],
                                  [len(drafts[k]) for k in verified])  # fmt: skip
        logits = model.logits(h)
        emitted = []
        for k, (a, b) in enumerate(batch.offsets()):
            samples = logits[a:b].argmax(-1).tolist()
            kept = 0
            while kept < len(drafts[k]) and samples[kept] == drafts[k][kept]:
                kept += 1
            emitted.append(samples[: kept + 1])
        if pending is not None:  # (the decode path's step keeps the histories apart, and no buffers)
            step = pending.step
            hists = getattr(step, "histories", None) or [s.history for s in step.saves]
            saved = [(s.state, h, dict(getattr(s, "buffers", {}))) for s, h in zip(step.saves, hists)]
            spec.settle(pending, [len(emitted[k]) - 1 for k in verified], [emitted[k] for k in verified], h, batch)
            for st, hist, bufs in saved:  # a mutation: undo part of the rollback
                if skip == "history":  # the history before the step kept: the kept tokens not in it
                    st.history = hist
                elif skip == "buffers" and bufs:
                    for key in bufs:
                        st.buffers.pop(key, None)
        plain = [k for k, d in enumerate(drafts) if not d]
        spec.follow(batch, h, plain, [rids[live[k]] for k in plain])
        for k, b in enumerate(live):
            toks[b] += emitted[k]
        stats["drafted"] += sum(len(d) for d in drafts)
        stats["kept"] += sum(len(e) - 1 for e in emitted)
        stats["verify_chunks"] += len(verified)
        stats["plain_rows"] += len(plain)
    return toks, states, cache, tables, spec, rids, stats


def reference_draft(model: DeepseekV41Model, tokens: list[int], consumed: int) -> tuple[list[int], list[float]]:
    """DSpark's block after ``consumed`` tokens with its context from one forward over them (a fresh state)."""
    st, cache = SequenceState(), PagedKVCache(model.config, PAGES, PAGE)
    batch = ForwardBatch.build([SeqChunk(st, 0, consumed, torch.arange(PAGES))], [tokens[:consumed]])
    model(batch, cache, capture=True)
    d = model.dspark
    pos = torch.arange(consumed)
    kv = d.context_kv(d.project(model.dspark_features, model.ops), pos, model.ops)
    anchor = torch.tensor([consumed])
    ctx, mask = zip(*(gather_window(k, anchor, model.text.sliding_window) for k in kv))
    res = d.draft(torch.tensor([tokens[consumed]]), anchor, list(ctx), mask[0], model.embed.weight,
                  model.head.weight, model.ops)  # fmt: skip
    return res.tokens[0].tolist(), res.confidence[0].tolist()


def check(model: DeepseekV41Model, seed: int, skip: str | None = None, exact: bool = True, tol: float = 0.0
          ) -> list[str]:  # fmt: skip
    """Where a speculative run of ``seed`` differs from plain runs: tokens, and unless not ``exact`` the states
    (within ``tol``; 0: bit for bit), the Engram histories, the next drafts (bit for bit only) and logits."""
    rng = random.Random(seed)
    vocab = model.text.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(1, 11))] for _ in range(rng.randint(2, 3))]
    # the plain runs, kept as they were at each count of tokens a speculative run can end with (NEW - 1 emitted and
    # consumed, at least): each the plain run to compare that sequence's state with
    runs = [Plain(model, x).run_to(len(x) + NEW + 8, keep_from=len(x) + NEW - 1) for x in prompts]
    oracle = [r.tokens for r in runs]
    toks, states, cache, tables, spec, rids, stats = speculative_run(model, prompts, oracle, rng, skip)
    assert stats["kept"] > 0 and stats["verify_chunks"] > 0 and stats["plain_rows"] > 0, stats
    bad = [] if spec.early_used or not spec.draft_early else ["no step read the drafts queued as a verify step settled"]
    for b, (t, st) in enumerate(zip(toks, states)):
        if t != oracle[b][: len(t)]:
            bad.append(f"seq {b}: emitted {t[len(prompts[b]) :]} != plain {oracle[b][len(prompts[b]) : len(t)]}")
            continue
        if not exact:
            continue
        plain = runs[b].at.get(st.num_tokens) or Plain(model, prompts[b]).run_to(st.num_tokens)
        bad += [f"seq {b}: {d}" for d in differences(st, cache, tables[b], plain, tol)]
        if st.history != plain.state.history:
            bad.append(f"seq {b}: Engram history {st.history} != {plain.state.history}")
        nxt = t[st.num_tokens]
        if tol == 0:
            got = spec.propose([rids[b]], [st], [tables[b]], [nxt], [spec.max_drafts])[0]
            want, conf = reference_draft(model, t, st.num_tokens)
            if got != want[: spec.max_drafts] or spec.last_confidence[rids[b]] != conf:
                bad.append(f"seq {b}: drafts {got} / {spec.last_confidence[rids[b]]} != {want} / {conf}")
        a = model.logits(model(ForwardBatch.build([SeqChunk(st, st.num_tokens, 1, tables[b])], [[nxt]]), cache))[0]
        want_logits = plain.step(1)
        if not (torch.equal(a, want_logits) if tol == 0 else bool((a - want_logits).abs().max() <= 10 * tol)):
            bad.append(f"seq {b}: the next step's logits")
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_speculation_is_exact(tokenizer, name: str) -> None:
    model = model_of(tokenizer, name)
    assert check(model, NAMES.index(name)) == []


def rounding_model(tokenizer, name: str) -> DeepseekV41Model:
    """The default op set without the cache formats' rounding (``set_quant_sim``): a verify step's GEMMs round
    otherwise than a plain step's (other row counts), and an FP8 / NVFP4 rounding step turns such a difference into a
    whole step of the format; without them the two runs differ within ``1e-4``."""
    model = model_of(tokenizer, name, invariant=False)
    model.set_quant_sim(False)
    return model


@pytest.mark.parametrize(("name", "fused"), [("mixed", True), ("heads8", True), ("mixed", False)])  # ("sketch": below)
def test_default_ops_verify_on_the_decode_path(tokenizer, name: str, fused: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The default op set: verify steps on the decode path (``deepseek_v41.verify_step``, taken: counted), the
    ratio-2 compressors' two-row rings rolled back from the sub-steps' projections; the attention in one call per
    layer (``fused``: ``deepseek_v4.verify_attention``) or sub-step after sub-step. Same tokens; states, histories
    and the next logits equal a plain run's within rounding."""
    model = rounding_model(tokenizer, name)
    model.verify_fused = fused
    taken = []
    real = v41_verify.pooled_forward
    monkeypatch.setattr(v41_verify, "pooled_forward", lambda *a: taken.append(1) or real(*a))
    assert check(model, 3, tol=1e-4) == []
    assert taken


@pytest.mark.parametrize("part", ["restore", "small rings", "history"])
def test_the_decode_paths_rollback_is_needed(tokenizer, part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_default_ops_verify_on_the_decode_path`` with the rings' restore, only the small rings', or the Engram
    history's left out: caught."""
    model = rounding_model(tokenizer, "sketch")
    if part != "history":
        monkeypatch.setattr(verify_rings, "restore" if part == "restore" else "_restore_small", lambda *a: None)
    found = []
    for seed in (3, 4, 5):
        try:
            found += check(model, seed, skip="history" if part == "history" else None, tol=1e-4)
        except (RuntimeError, IndexError, ValueError) as e:
            found.append(repr(e))
        if found:
            break
    assert found


@pytest.mark.parametrize("skip", ["history", "buffers"])
def test_a_missing_rollback_is_caught(tokenizer, skip: str) -> None:
    model = model_of(tokenizer, "sketch")
    assert check(model, 0, skip=skip)


def test_context_rings_and_survival() -> None:
    rings = ContextRings(2, 4, 3, torch.float32, torch.device("cpu"), capacity=1)
    kv = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    rings.write(["a", "b"], [4, 2], kv, torch.tensor([4, 5, 6, 7, 0, 1]))  # b's rows grow the rings (capacity 1)
    rows, mask = rings.windows(["a", "b"], torch.tensor([8, 2]))  # a: 4..7 all there, in order; b: -2..1
    assert mask.tolist() == [[True] * 4, [False, False, True, True]]
    assert torch.equal(rows[1, 0, :, 0], torch.tensor([18.0, 21, 24, 27])) and rows[0, 1, 2, 0] == 12
    rows, mask = rings.windows(["a"], torch.tensor([10]))  # 6..9: 8 and 9 were never written (a gap), 6 and 7 are
    assert mask.tolist() == [[True, True, False, False]]
    assert rings.windows(["a"], torch.tensor([3]))[1].tolist() == [[False] * 4]  # -1 .. 2: none (2's slot holds 6)
    rings.release("a")
    assert "a" not in rings and rings.windows(["c"], torch.tensor([8]))[1].tolist() == [[False] * 4]  # a's old slot
    conf = torch.tensor([[0.9, 0.9, 0.1], [0.2, 0.9, 0.9], [1.0, 1.0, 1.0]])
    assert survival_lengths(conf, [3, 3, 2], 0.5) == [2, 1, 2]  # at least one, at most the count


def test_verify_rollback_without_the_engine(tokenizer) -> None:
    """``speculative.verify`` + ``VerifyStep.rollback`` on V4.1 (the entry points the V4 tests use): a verify step
    with every draft rejected leaves the state a plain run's."""
    model = model_of(tokenizer, "mixed")
    prompt = list(range(5, 14))
    plain = Plain(model, prompt).run_to(12)
    st, cache, table = SequenceState(), PagedKVCache(model.config, PAGES, PAGE), torch.arange(PAGES)
    model(ForwardBatch.build([SeqChunk(st, 0, len(prompt), table)], [prompt]), cache)
    toks = plain.tokens
    while st.num_tokens < 12:
        p = st.num_tokens
        step = speculative.verify(model, cache, [st], [table], [toks[p]], [[(toks[p + 1] + 1) % 50, 3, 4]])
        step.rollback([0])
    assert differences(st, cache, table, plain) == [] and st.history == plain.state.history


def test_a_capturing_step_replays_decode_graphs_only(tokenizer) -> None:
    """The drafter's features: a step with ``capture`` may replay the decode graphs (which compute them:
    ``tests/kernels/test_graphs_v41.py``), never the piecewise prefill graphs (their attention runs eagerly, with no
    features); a step without may replay either."""
    seen = []

    class Graphs:
        def __init__(self, name: str) -> None:
            self.name, self.replays, self.features = name, 0, None

        def run(self, batch, cache):
            seen.append(self.name)
            return None  # "not a step these graphs take": eager

    model = model_of(tokenizer, "sketch", invariant=False)
    model.ops.cuda_graphs = model.ops.prefill_graphs = True
    model.step_graphs = StepGraphs(lambda m: Graphs("decode"), lambda m: Graphs("prefill"))
    st, cache = SequenceState(), PagedKVCache(model.config, PAGES, PAGE)
    model(ForwardBatch.build([SeqChunk(st, 0, 5, torch.arange(PAGES))], [[5, 6, 7, 8, 9]]), cache, capture=True)
    assert seen == ["decode"] and model.dspark_features.shape[0] == 5
    model(ForwardBatch.build([SeqChunk(st, 5, 1, torch.arange(PAGES))], [[10]]), cache)
    assert seen == ["decode", "decode", "prefill"]


class EagerVerifySegments(EagerCapture, VerifyGraphs):
    """``VerifyGraphs`` without CUDA: each "graph" (the step, the restore) runs its segment eagerly, on any device."""

    on_device = True

    def tables_on_device(self, device: torch.device) -> bool:
        return self.on_device


def graphed_model(tokenizer, name: str, tables: str = "device") -> DeepseekV41Model:
    """``rounding_model`` with its verify steps through ``EagerVerifySegments`` (the family's graphs otherwise)."""
    model = rounding_model(tokenizer, name)
    model.ops.cuda_graphs, model.piecewise_prefill = True, False
    model.step_graphs = FAMILY.step_graphs()
    model.verify_graphs = EagerVerifySegments(model, max_batch=8)
    model.verify_graphs.on_device = tables == "device"
    return model


def graphed_step(tokenizer, tables: str, graphs: bool) -> tuple:
    """Four prompts prefilled, then one verify step (3, 2, 1 and 0 drafts) rolled back, on a fresh model (the pool's
    scratch rows, which dead rows write, start alike): its output, features, states and cache."""
    model = graphed_model(tokenizer, "mixed", tables)
    rng = random.Random(1)
    vocab = model.text.vocab_size
    cache = PagedKVCache(model.config, PAGES * 4, PAGE)
    tabs = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(4)]
    states = [SequenceState() for _ in range(4)]
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (21, 26, 17, 23)]
    model(ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tabs)], prompts), cache)
    ids = [[rng.randrange(5, vocab) for _ in range(n + 1)] for n in (3, 2, 1, 0)]
    model.ops.cuda_graphs = graphs
    chunks = [SeqChunk(s, s.num_tokens, len(x), t) for s, x, t in zip(states, ids, tabs)]
    y, f, pending = model.verify_forward(ForwardBatch.build(chunks, ids), cache, [0, 1, 2], 0, True)
    pending.rollback([1, 0, 1])
    assert model.verify_graphs.replays == int(graphs)
    return y, f, [s.clone() for s in states], cache


@pytest.mark.parametrize("tables", ["device", "host"])
def test_a_graphed_verify_step_is_the_eager_one_on_cpu(tokenizer, tables: str) -> None:
    """The verify graphs' step and restore (``deepseek_v41.verify_graphs``; their segments run eagerly here): four
    sequences with 3, 2, 1 and 0 drafts at a bucket's size give the eager step's trunk output and DSpark features
    bit for bit, and after the rollback the same states and cache; Engram from row ids or from rows looked up
    before the replay."""
    (y0, f0, s0, c0), (y1, f1, s1, c1) = (graphed_step(tokenizer, tables, g) for g in (False, True))
    assert torch.equal(y0, y1) and f0 is not None and torch.equal(f0, f1)
    for a, b in zip(s0, s1):
        assert (a.num_tokens, a.history) == (b.num_tokens, b.history)
        assert a.windows.keys() == b.windows.keys() and all(torch.equal(a.windows[k], b.windows[k]) for k in a.windows)
        assert all(torch.equal(a.buffers[k].kv, b.buffers[k].kv) for k in a.buffers)
    for kind, layer in c0.stores():
        assert torch.equal(c0._store(kind, layer), c1._store(kind, layer)), (kind, layer)


def test_speculation_with_the_verify_graphs_on_cpu(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check`` with every verify step through the verify graphs (padded to the drafter's most drafts): the plain
    run's tokens, states within rounding; their restore left out: caught."""
    model = graphed_model(tokenizer, "sketch")
    assert check(model, 3, tol=1e-4) == []
    assert model.verify_graphs.replays > 0
    monkeypatch.setattr(VerifyGraphs, "restore", lambda *a: None)
    assert check(model, 3, tol=1e-4)


class EagerDraftSegments(EagerCapture, DSparkGraphs):
    """``DSparkGraphs`` without CUDA: the "graph" runs the draft pass eagerly from the bucket's static inputs."""


def test_the_draft_pass_graph_drafts_as_the_eager_pass_on_cpu(tokenizer) -> None:
    """DSpark's draft pass from its graph (``dspark_graphs``; the segment run eagerly here): from the bucket's
    static inputs (ring slots, anchors, positions) the same drafts and confidences as the eager pass at a bucket's
    size, and within rounding in a padded one; the rings' growth drops the buckets."""
    model = graphed_model(tokenizer, "sketch")
    model.draft_graphs = EagerDraftSegments(model, max_batch=8)
    spec = DSparkSpeculator(model, 3, varlen=False)
    rng = random.Random(2)
    vocab = model.text.vocab_size
    cache = PagedKVCache(model.config, PAGES * 4, PAGE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(4)]
    states, rids = [SequenceState() for _ in range(4)], [f"r{i}" for i in range(4)]
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (9, 14, 5, 11)]
    batch = ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)], prompts)
    h, _ = spec.forward(batch, cache, [], [], [])
    spec.follow(batch, h, [0, 1, 2, 3], rids)
    last = [7, 8, 9, 10]
    for n in (4, 3):
        got = []
        for graphs in (False, True):
            model.ops.cuda_graphs = graphs
            got.append((spec.propose(rids[:n], states[:n], tables[:n], last[:n], [3] * n),
                        [spec.last_confidence[r] for r in rids[:n]]))  # fmt: skip
        (d0, c0), (d1, c1) = got
        assert d0 == d1 and all(len(d) == 3 for d in d0)
        if n == 4:
            assert c0 == c1
        else:  # a padded bucket: other GEMM row counts, rounding apart
            assert torch.allclose(torch.tensor(c0), torch.tensor(c1), rtol=0, atol=1e-5)
    dg = model.draft_graphs
    assert dg.replays == 2 and len(dg.buckets) == 1
    before = next(iter(dg.buckets.values()))
    spec.rings.slots([f"more {i}" for i in range(8)])  # the rings grow: the buckets over the old tensors go
    model.ops.cuda_graphs = True
    spec.propose(rids, states, tables, last, [3] * 4)
    assert dg.replays == 3 and len(dg.buckets) == 1 and next(iter(dg.buckets.values())) is not before


class EagerKeepSegments(EagerCapture, KeepGraphs):
    """``KeepGraphs`` without CUDA: the "graph" runs the keep pass eagerly from the bucket's static inputs."""


def test_the_keep_pass_graph_keeps_as_the_eager_pass_on_cpu(tokenizer) -> None:
    """DSpark's keep pass from its graph (``dspark_graphs.KeepGraphs``; the segment run eagerly here): after a
    prefill (a window's rows of each prompt: more than the graphs' rows, eager) and a verify step whose kept rows
    (2 + 1 + 3) fill no bucket (padding: the last row again), the rings equal the eager passes' within rounding,
    positions exactly; one graph replayed. The worker's warm-up captures every bucket a batch may keep."""
    got = []
    for graphs in (False, True):
        model = graphed_model(tokenizer, "sketch")
        model.observe_graphs = EagerKeepSegments(model, max_batch=2)  # (rows up to twice DSpark's block size: 10)
        model.ops.cuda_graphs = graphs
        spec = DSparkSpeculator(model, 3, varlen=False)
        rng = random.Random(4)
        vocab = model.text.vocab_size
        cache = PagedKVCache(model.config, PAGES * 3, PAGE)
        tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(3)]
        states, rids = [SequenceState() for _ in range(3)], [f"r{i}" for i in range(3)]
        prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (9, 14, 5)]
        batch = ForwardBatch.build([SeqChunk(s, 0, len(p), t) for s, p, t in zip(states, prompts, tables)], prompts)
        h, _ = spec.forward(batch, cache, [], [], [])
        spec.follow(batch, h, [0, 1, 2], rids)
        assert model.observe_graphs.replays == 0  # (a window's rows a prompt: beyond the bucket limit)
        ids = [[rng.randrange(5, vocab) for _ in range(4)] for _ in range(3)]
        chunks = [SeqChunk(s, s.num_tokens, 4, t) for s, t in zip(states, tables)]
        step = ForwardBatch.build(chunks, ids)
        h, pending = spec.forward(step, cache, [0, 1, 2], rids, [3, 3, 3])
        spec.settle(pending, [1, 0, 2], [ids[0][:2], ids[1][:1], ids[2][:3]], h, step)
        assert model.observe_graphs.replays == int(graphs)
        got.append((spec.rings.rows.clone(), spec.rings.pos.clone(), [spec.rings.slot[r] for r in rids]))
    (r0, p0, s0), (r1, p1, s1) = got
    assert s0 == s1 and torch.equal(p0, p1) and p0[s0].max(1).values.tolist() == [10, 14, 7]  # (kept: 2, 1, 3)
    assert torch.allclose(r0, r1, rtol=0, atol=1e-5) and r0.abs().sum() > 0
    # the warm-up captures a keep graph for every row count a step of two sequences may keep (2 .. 2 x 4)
    model.draft_graphs = EagerDraftSegments(model, max_batch=2)
    spec.warm_graphs(states[:2])
    assert sorted(size for size, *_ in model.observe_graphs.buckets) == [2, 4, 8]
    assert not any(r.startswith("warm-up") for r in spec.rings.slot)


def test_a_chunk_not_verified_keeps_all_its_tokens(tokenizer) -> None:
    """V4.1's decode-path step with a prompt's next three tokens beside a verified chunk: that chunk's state (windows,
    the ratio-2 rings, history, pages) is a plain prefill's after the rollback."""
    model = rounding_model(tokenizer, "mixed")
    prompts = [list(range(5, 11)), list(range(20, 28))]
    cache, tables = PagedKVCache(model.config, 2 * PAGES, PAGE), [torch.arange(PAGES), torch.arange(PAGES, 2 * PAGES)]
    states = [SequenceState(), SequenceState()]
    model(ForwardBatch.build([SeqChunk(states[0], 0, 6, tables[0]), SeqChunk(states[1], 0, 5, tables[1])],
                             [prompts[0], prompts[1][:5]]), cache)  # fmt: skip
    chunks = [SeqChunk(states[0], 6, 3, tables[0]), SeqChunk(states[1], 5, 3, tables[1])]
    got = model.verify_forward(ForwardBatch.build(chunks, [[9, 40, 41], prompts[1][5:]]), cache, [0])
    assert got is not None  # the decode path
    got[2].rollback([0])
    plain = Plain(model, prompts[1])
    assert states[1].num_tokens == 8 and states[1].history == plain.state.history
    # (a pooled state lists its ratio-2 rings' pending pair even when empty; the prefill's state drops it)
    assert all(b.kv.shape[0] == 0 for k, b in states[1].buffers.items() if k not in plain.state.buffers)
    assert [d for d in differences(states[1], cache, tables[1], plain, 1e-4) if not d.startswith("buffers [")] == []


def test_a_step_mixing_a_prompt_with_verify_rows_runs_in_two_parts(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """V4.1's step with a prompt chunk longer than any ring before a verified chunk (``deepseek_v4.verify_split``):
    the prompt runs as a plain step, the verified chunk on the decode path; the trunk output and DSpark's features are
    the ragged path's within rounding, row for row, the rollback's offsets the step's, and after it both sequences'
    states (Engram history too) are a plain run's."""
    from deepinfer.models.deepseek_v4 import verify_split
    from deepinfer.models.deepseek_v4.verify_step import PooledVerify

    model = rounding_model(tokenizer, "mixed")
    long = 3 * max(model.text.sliding_window, verify_rings.ring_rows(model)) + 5
    prompts = [list(range(5, 11)), [(7 * j) % (model.text.vocab_size - 5) + 5 for j in range(long)]]

    def step(split: bool) -> tuple:
        cache = PagedKVCache(model.config, 2 * PAGES, PAGE)
        tables, states = [torch.arange(PAGES), torch.arange(PAGES, 2 * PAGES)], [SequenceState(), SequenceState()]
        model(ForwardBatch.build([SeqChunk(states[0], 0, 6, tables[0])], [prompts[0]]), cache)
        chunks = [SeqChunk(states[1], 0, long, tables[1]), SeqChunk(states[0], 6, 3, tables[0])]
        batch = ForwardBatch.build(chunks, [prompts[1], [9, 40, 41]])
        with monkeypatch.context() as mp:
            if not split:
                mp.setattr(verify_split, "split", lambda *a: None)
            spec = DSparkSpeculator(model, 3)
            h, pending = spec.forward(batch, cache, [1], ["a"], [2])
        assert isinstance(pending.step, PooledVerify) == split and pending.step.offsets == [(long, long + 3)]
        pending.step.rollback([1])
        return h, spec.features, states, cache, tables

    h, feats, states, cache, tables = step(True)
    ragged, ragged_feats, *_ = step(False)
    assert (h - ragged).abs().max() <= 1e-4 and (feats - ragged_feats).abs().max() <= 1e-4
    for b, consumed in enumerate([prompts[0] + [9, 40], prompts[1]]):
        plain = Plain(model, consumed)
        assert states[b].num_tokens == len(consumed) and states[b].history == plain.state.history
        assert all(x.kv.shape[0] == 0 for k, x in states[b].buffers.items() if k not in plain.state.buffers)
        bad = [d for d in differences(states[b], cache, tables[b], plain, 1e-4) if not d.startswith("buffers [")]
        assert bad == [], (b, bad)
