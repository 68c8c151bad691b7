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
from deepinfer.models.deepseek_v4 import speculative
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41.dspark import gather_window
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.models.deepseek_v41.speculator import ContextRing, DSparkSpeculator, survival_lengths
from models.test_spec_verify import differences
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


class Plain:
    """One sequence decoded greedily without speculation, one token per step after its prompt."""

    def __init__(self, model: DeepseekV41Model, prompt: list[int]) -> None:
        self.model, self.state, self.tokens = model, SequenceState(), list(prompt)
        self.cache, self.table = PagedKVCache(model.config, PAGES, PAGE), torch.arange(PAGES)
        self.step(len(prompt))

    def step(self, n: int) -> torch.Tensor:
        p = self.state.num_tokens
        batch = ForwardBatch.build([SeqChunk(self.state, p, n, self.table)], [self.tokens[p : p + n]])
        logits = self.model.logits(self.model(batch, self.cache))
        self.tokens.append(int(logits[-1].argmax()))
        return logits[-1]

    def run_to(self, consumed: int) -> Plain:
        while self.state.num_tokens < consumed:
            self.step(1)
        return self


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
        if pending is not None:
            saved = [(s.state, s.history, dict(s.buffers)) for s in pending.step.saves]
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


def check(model: DeepseekV41Model, seed: int, skip: str | None = None, exact: bool = True) -> list[str]:
    rng = random.Random(seed)
    vocab = model.text.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(1, 11))] for _ in range(rng.randint(2, 3))]
    oracle = [Plain(model, x).run_to(len(x) + NEW + 8).tokens for x in prompts]
    toks, states, cache, tables, spec, rids, stats = speculative_run(model, prompts, oracle, rng, skip)
    assert stats["kept"] > 0 and stats["verify_chunks"] > 0 and stats["plain_rows"] > 0, stats
    bad = []
    for b, (t, st) in enumerate(zip(toks, states)):
        if t != oracle[b][: len(t)]:
            bad.append(f"seq {b}: emitted {t[len(prompts[b]) :]} != plain {oracle[b][len(prompts[b]) : len(t)]}")
            continue
        if not exact:
            continue
        plain = Plain(model, prompts[b]).run_to(st.num_tokens)
        bad += [f"seq {b}: {d}" for d in differences(st, cache, tables[b], plain)]
        if st.history != plain.state.history:
            bad.append(f"seq {b}: Engram history {st.history} != {plain.state.history}")
        nxt = t[st.num_tokens]
        got = spec.propose([rids[b]], [st], [tables[b]], [nxt], [spec.max_drafts])[0]
        want, conf = reference_draft(model, t, st.num_tokens)
        if got != want[: spec.max_drafts] or spec.last_confidence[rids[b]] != conf:
            bad.append(f"seq {b}: drafts {got} / {spec.last_confidence[rids[b]]} != {want} / {conf}")
        a = model.logits(model(ForwardBatch.build([SeqChunk(st, st.num_tokens, 1, tables[b])], [[nxt]]), cache))[0]
        if not torch.equal(a, plain.step(1)):
            bad.append(f"seq {b}: the next step's logits")
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_speculation_is_exact(tokenizer, name: str) -> None:
    model = model_of(tokenizer, name)
    assert check(model, NAMES.index(name)) == []


def test_default_ops_give_the_same_tokens(tokenizer) -> None:
    """The default op set: verify rows through the batched attention, plain rows on pooled decode steps."""
    model = model_of(tokenizer, "sketch", invariant=False)
    assert check(model, 3, exact=False) == []


@pytest.mark.parametrize("skip", ["history", "buffers"])
def test_a_missing_rollback_is_caught(tokenizer, skip: str) -> None:
    model = model_of(tokenizer, "sketch")
    assert check(model, 0, skip=skip)


def test_context_ring_and_survival() -> None:
    ring = ContextRing(2, 4, 3, torch.float32, torch.device("cpu"))
    ring.write(torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3), torch.arange(2, 8))
    rows, mask = ring.window(8)  # positions 4..7 all present, in order
    assert mask.all() and torch.equal(rows[1, :, 0], torch.tensor([24.0, 27, 30, 33]))
    rows, mask = ring.window(10)  # 6..9: 8 and 9 were never written (a gap), 6 and 7 are
    assert mask.tolist() == [True, True, False, False]
    assert ring.window(3)[1].tolist() == [False] * 4  # positions -1 .. 2: none (2's slot holds 6 now)
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


def test_a_capturing_step_runs_eagerly(tokenizer) -> None:
    """The drafter's features come from an eager forward: a step with ``capture`` never goes to the step graphs
    (they return no features; the H200 run of 2026-12-04 failed there), a step without may."""

    class Graphs:
        calls = 0

        def run(self, model, batch, cache, capture: bool = False):
            Graphs.calls += 1
            return None  # "not a step these graphs take": eager

    model = model_of(tokenizer, "sketch", invariant=False)
    model.step_graphs = Graphs()
    st, cache = SequenceState(), PagedKVCache(model.config, PAGES, PAGE)
    model(ForwardBatch.build([SeqChunk(st, 0, 5, torch.arange(PAGES))], [[5, 6, 7, 8, 9]]), cache, capture=True)
    assert Graphs.calls == 0 and model.dspark_features.shape[0] == 5
    model(ForwardBatch.build([SeqChunk(st, 5, 1, torch.arange(PAGES))], [[10]]), cache)
    assert Graphs.calls == 1
