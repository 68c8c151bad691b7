"""Speculative verify steps on DeepSeek-V4 with exact state rollback (``models/deepseek_v4/speculative.py``) and the
MTP drafter (``models/deepseek_v4/mtp_drafter.py``), against decoding without speculation.

Each configuration of ``models.tiny_configs`` (compress ratios 4, 8 and 16, so groups complete inside a verify step)
runs a batch of sequences (greedy and seeded sampling) through verify steps of random draft lengths (0 included):
the MTP drafter's drafts, some replaced by the right token (a plain run's) or a random one. The emitted tokens must
be a plain run's, token for token, and every sequence's state after the run (windows, compressor buffers, counters,
the MTP block's window, the paged rows and indexer keys it can read) must equal, bit for bit, the state of a plain
run that consumed the same tokens one decode step at a time (and of one that consumed them as one chunk); so must
the next decode step's logits (trunk and MTP).
Bit-for-bit needs a row's numbers not to depend on the step's shape: ``BatchInvariantOps`` (the reference backend's
batch-invariant op set, fp32 on the CPU). The default op set (batched attention, decode steps on the ``StatePool``)
is checked for the same tokens and a state equal within rounding. Mutations (a rollback skipped) must be caught.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from deepinfer.backends.reference import BatchInvariantOps, ReferenceOps
from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.speculative.verify import accept
from deepinfer.engine.worker import position_seed
from deepinfer.models.deepseek_v4 import mtp_drafter, speculative, verify_rings, verify_step
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.mtp_drafter import MTPDrafter
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.speculative import verify
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.sampling_params import SamplingParams
from models.tiny_configs import CONFIGS

PAGE, PAGES = 16, 8  # pages per sequence
NEW = 28  # tokens each sequence emits at least (ratio-16 groups complete inside verify steps)
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=1.2, top_p=0.9, seed=12345),
]
SAMPLER = Sampler(kernel=False)


def load(tiny_dirs: dict, name: str, ops) -> DeepseekV4Model:
    path = tiny_dirs[name]
    m = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"), ops)
    load_checkpoint(m, path, dtype=torch.float32, progress=False)
    return m


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest, tiny_dirs: dict) -> DeepseekV4Model:
    return load(tiny_dirs, request.param, BatchInvariantOps())


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    seeds = [None if p.greedy or p.seed is None else position_seed(p.seed, q) for p, q in zip(params, positions)]
    return SAMPLER(logits, params, seeds).token_ids.tolist()


class PlainRun:
    """A sequence decoded without speculation, one token a ``step(1)`` (the subclass's), its copies kept by tokens
    consumed (``at``) so that a reference run to any count is decoded once."""

    state: SequenceState
    cache: PagedKVCache
    tokens: list[int]
    at: dict[int, PlainRun]

    def step(self, n: int) -> object:
        raise NotImplementedError

    def run_to(self, consumed: int, keep_from: int | None = None) -> PlainRun:
        """Decode until ``consumed`` tokens are in; from ``keep_from`` consumed tokens on, a copy of the run after
        each step is kept in ``at`` (what a fresh run to that count holds: the same steps of the same model)."""
        while self.state.num_tokens < consumed:
            self.step(1)
            if keep_from is not None and self.state.num_tokens >= keep_from:
                self.at[self.state.num_tokens] = self.copy()
        return self

    def copy(self) -> PlainRun:
        """This run as it is now, its state, cache and tokens copied (the model shared)."""
        out = copy.copy(self)
        out.cache, out.state, out.tokens, out.at = copied(self.cache), self.state.clone(), list(self.tokens), {}
        return out


class Plain(PlainRun):
    """One sequence decoded without speculation: a prefill, then one token per step, the MTP block fed each
    consumed position once the next token is sampled."""

    def __init__(self, model: DeepseekV4Model, prompt: list[int], params: SamplingParams) -> None:
        self.model, self.params = model, params
        self.cache = PagedKVCache(model.config, PAGES, PAGE)
        self.table, self.state, self.tokens = torch.arange(PAGES), SequenceState(), list(prompt)
        self.at: dict[int, PlainRun] = {}  # copies of this run by tokens consumed (``run_to``)
        self.step(len(prompt))

    def step(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Consume ``n`` tokens (pending ones); returns the last row's trunk and MTP logits."""
        m, st, p = self.model, self.state, self.state.num_tokens
        batch = ForwardBatch.build([SeqChunk(st, p, n, self.table)], [self.tokens[p : p + n]])
        h = m(batch, self.cache)
        logits = m.logits(h)
        self.tokens += sample(logits[-1:], [self.params], [p + n])
        _, mtp = m.mtp_forward(h, torch.tensor(self.tokens[p + 1 : p + n + 1]), batch)
        return logits[-1], mtp[-1]


def copied(cache: PagedKVCache) -> PagedKVCache:
    """A copy of ``cache``: its rows and indexer keys cloned."""
    out = copy.copy(cache)
    out.rows = {k: v.clone() for k, v in cache.rows.items()}
    out.index_keys = {k: v.clone() for k, v in cache.index_keys.items()}
    return out


def speculative_run(model: DeepseekV4Model, prompts: list[list[int]], params: list[SamplingParams],
                    oracle: list[list[int]], rng: random.Random, right: float) -> tuple:  # fmt: skip
    """Every sequence in one batch of verify steps until it emitted ``NEW`` tokens; returns (tokens, state) per
    sequence, the cache, the block tables and the drafts proposed / kept."""
    cfg, n_seq = model.config, len(prompts)
    cache = PagedKVCache(cfg, PAGES * n_seq, PAGE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(n_seq)]
    states, toks = [SequenceState() for _ in prompts], [list(x) for x in prompts]
    drafter, n_max = MTPDrafter(model), min(7, cfg.sliding_window - 1)
    batch = ForwardBatch.build([SeqChunk(s, 0, len(x), t) for s, x, t in zip(states, prompts, tables)], prompts)
    h = model(batch, cache)
    last = [b - 1 for _, b in batch.offsets()]
    for t, x in zip(toks, sample(model.logits(h)[last], params, [len(x) for x in prompts])):
        t.append(x)
    heads = drafter.observe(h, batch.offsets(), [t[1:] for t in toks], states, tables)
    stats = [0, 0, 0]  # drafts proposed, kept, verify steps whose rejected rows completed a compressor group
    while True:
        live = [b for b in range(n_seq) if len(toks[b]) - len(prompts[b]) < NEW]
        if not live:
            break
        st, tb = [states[b] for b in live], [tables[b] for b in live]
        drafts = drafter.draft([heads[b] for b in live], [rng.randint(0, n_max) for _ in live], st, tb)
        for b, d in zip(live, drafts):  # some drafts replaced by the right token or a random one
            p = states[b].num_tokens
            for j in range(len(d)):
                u = rng.random()
                if u < right and p + 1 + j < len(oracle[b]):
                    d[j] = oracle[b][p + 1 + j]
                elif u < right + 0.15:
                    d[j] = rng.randrange(cfg.vocab_size)
        step = verify(model, cache, st, tb, [toks[b][-1] for b in live], drafts)
        verdict = accept(SAMPLER, step.logits, drafts, [params[b] for b in live], [sv.start for sv in step.saves])
        stats[0] += sum(len(d) for d in drafts)
        stats[1] += sum(verdict.counts)
        m = min(cfg.ratio(i) for i in cfg.compressed_layers)  # steps where a rejected row completed a group
        stats[2] += sum(
            (v.start + v.drafts + 1) // m > (v.start + a + 1) // m for v, a in zip(step.saves, verdict.counts)
        )
        step.rollback(verdict.counts)
        out = verdict.tokens
        for b, e in zip(live, out):
            toks[b] += e
        new_heads = drafter.observe(step.hidden, step.offsets, out, st, tb)
        for b, hd in zip(live, new_heads):
            heads[b] = hd
    return [(t, s) for t, s in zip(toks, states)], cache, tables, stats


def differences(spec: SequenceState, cache: PagedKVCache, table: torch.Tensor, plain: Plain, tol: float = 0.0
                ) -> list[str]:  # fmt: skip
    """Where a sequence's state differs from a plain run's (bit for bit when ``tol`` is 0)."""
    ref, out = plain.state, []

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape:
            return False
        return torch.equal(a, b) if tol == 0 else bool((a - b).abs().max() <= tol) if a.numel() else True

    for f in ("num_tokens", "mtp_tokens", "window_start", "replay_until"):
        if getattr(spec, f) != getattr(ref, f):
            out.append(f"{f}: {getattr(spec, f)} != {getattr(ref, f)}")
    if set(spec.windows) != set(ref.windows):
        out.append(f"window layers {sorted(spec.windows)} != {sorted(ref.windows)}")
    for layer in ref.windows:
        if layer in spec.windows and not same(spec.windows[layer], ref.windows[layer]):
            out.append(f"window of layer {layer}")
    if set(spec.buffers) != set(ref.buffers):
        out.append(f"buffers {sorted(spec.buffers)} != {sorted(ref.buffers)}")
    for key, b in ref.buffers.items():
        s = spec.buffers.get(key)
        if s is not None and (s.start != b.start or not same(s.kv, b.kv) or not same(s.score, b.score)):
            out.append(f"buffer {key}")
    n = ref.num_tokens
    for kind, layer in cache.stores():
        m = cache.ratios[layer]
        if not same(cache.read(kind, layer, table, n // m), plain.cache.read(kind, layer, plain.table, n // m)):
            out.append(f"{kind} of layer {layer}")
    return out


def next_logits(model: DeepseekV4Model, st: SequenceState, cache: PagedKVCache, table: torch.Tensor,
                token: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The trunk's and the MTP block's logits of one more decode step of ``token`` (advances the state)."""
    batch = ForwardBatch.build([SeqChunk(st, st.num_tokens, 1, table)], [[token]])
    h = model(batch, cache)
    logits = model.logits(h)[0]
    return logits, model.mtp_forward(h, logits.argmax().view(1), batch)[1][0]


def check(model: DeepseekV4Model, seed: int, right: float, tol: float = 0.0) -> list[str]:
    """One speculative batch against plain runs; returns the differences found (tokens, states, next logits)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    n_seq = rng.randint(1, 3)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))] for _ in range(n_seq)]
    params = [rng.choice(PARAMS) for _ in range(n_seq)]
    # the plain runs, kept as they were at each count of tokens a speculative run can end with (NEW - 1 emitted and
    # consumed, at least): each the plain run to compare that sequence's state with
    runs = [Plain(model, x, p).run_to(len(x) + NEW + 8, keep_from=len(x) + NEW - 1) for x, p in zip(prompts, params)]
    oracle = [r.tokens for r in runs]
    spec, cache, tables, _ = speculative_run(model, prompts, params, oracle, rng, right)
    bad = []
    for b, ((toks, st), x, p) in enumerate(zip(spec, prompts, params)):
        if toks != oracle[b][: len(toks)]:
            bad.append(f"seq {b}: emitted {toks[len(x) :]} != plain {oracle[b][len(x) : len(toks)]}")
            continue
        plain = runs[b].at.get(st.num_tokens) or Plain(model, x, p).run_to(st.num_tokens)
        assert plain.tokens == toks
        bad += [f"seq {b}: {d}" for d in differences(st, cache, tables[b], plain, tol)]
        if tol == 0:  # the batch-invariant ops: a plain run that consumed the same tokens as one chunk, too
            chunk = Plain(model, toks[: st.num_tokens], p)
            assert chunk.tokens == toks
            bad += [f"seq {b} (one chunk): {d}" for d in differences(st, cache, tables[b], chunk)]
        got = next_logits(model, st, cache, tables[b], toks[-1])
        want = next_logits(model, plain.state, plain.cache, plain.table, toks[-1])
        for name, g, w in zip(("trunk", "mtp"), got, want):
            if not (torch.equal(g, w) if tol == 0 else (g - w).abs().max() <= tol):
                bad.append(f"seq {b}: next {name} logits")
    return bad


# the two extreme acceptance regimes (drafts mostly rejected, mostly kept) on the base configuration; the mixed one
# (drafts kept and rejected in one run) on the other shapes: what a regime exercises, the rollback, is the same code
# for every shape
REGIMES = [("base", 0, 0.0), ("base", 0, 0.9)] + [(n, 1, 0.5) for n in CONFIGS if n != "base"]


@pytest.mark.parametrize(("model", "seed", "right"), REGIMES, indirect=["model"])
def test_verify_steps_emit_plain_tokens_and_leave_the_plain_state(model: DeepseekV4Model, seed: int,
                                                                  right: float) -> None:  # fmt: skip
    assert check(model, seed * 10 + int(right * 10), right) == []


@pytest.mark.parametrize("model", ["base"], indirect=True)
def test_drafts_are_kept_and_rejected(model: DeepseekV4Model) -> None:
    """The harness exercises both outcomes: right drafts are all kept (greedy), the MTP's random-weight drafts
    and random tokens mostly not (the harness is the same for every shape)."""
    x, p = [3, 4, 5], PARAMS[0]
    oracle = Plain(model, x, p).run_to(len(x) + NEW + 8).tokens
    spec, _, _, (proposed, kept, _) = speculative_run(model, [x], [p], [oracle], random.Random(5), 1.0)
    assert spec[0][0] == oracle[: len(spec[0][0])] and proposed > 10 and kept == proposed
    spec, _, _, (proposed, kept, completed) = speculative_run(model, [x], [p], [oracle], random.Random(5), 0.0)
    assert spec[0][0] == oracle[: len(spec[0][0])] and proposed > 10 and kept < proposed / 2 and completed > 0


def test_the_mtp_block_computes_only_each_chunks_last_logits(model: DeepseekV4Model) -> None:
    """``mtp_forward`` over a prefill returns one row of logits per chunk, its last row's (those of the head over
    every row, there): a prefill chunk of T tokens would otherwise hold T x vocab fp32 logits (31 GiB at 64 prompts
    of 1024 tokens), where a drafter reads only the last."""
    cfg, prompts = model.config, [[3, 4, 5, 6, 7], [8, 9]]
    cache = PagedKVCache(cfg, PAGES * 2, PAGE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(2)]
    states = [SequenceState() for _ in prompts]
    batch = ForwardBatch.build([SeqChunk(s, 0, len(x), t) for s, x, t in zip(states, prompts, tables)], prompts)
    h = model(batch, cache)
    nxt = torch.tensor([t for x in prompts for t in [*x[1:], 2]])
    x, logits = model.mtp_forward(h, nxt, batch)
    last = [b - 1 for _, b in batch.offsets()]
    blk = model.mtp[0]
    assert logits.shape == (2, cfg.vocab_size) and x.shape[0] == sum(map(len, prompts))
    assert torch.equal(logits, model._head(x, blk, blk.norm)[last])


@pytest.mark.parametrize(
    "mutation",
    ["no window restore", "buffers without the saved rows", "no rollback but the counter", "no MTP window restore"],
)
def test_a_skipped_rollback_is_caught(tiny_dirs: dict, mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part of the rollback left out is caught (on one configuration: the rollback code is the same for all)."""
    model = load(tiny_dirs, "base", BatchInvariantOps())
    if mutation == "no window restore":
        monkeypatch.setattr(speculative, "restore_windows", lambda *a, **k: None)
    elif mutation == "buffers without the saved rows":  # the kept buffer cut from the step's rows alone
        real = speculative.kept_buffer
        monkeypatch.setattr(speculative, "kept_buffer", lambda old, *a: real(None, *a))
    elif mutation == "no MTP window restore":
        monkeypatch.setattr(mtp_drafter, "restore_windows", lambda *a, **k: None)
    else:

        def counter_only(self, accepted: list[int]) -> None:
            for save, a in zip(self.saves, accepted):
                save.state.num_tokens = save.start + a + 1

        monkeypatch.setattr(speculative.VerifyStep, "rollback", counter_only)
    found = []
    for seed in range(3):  # until a run shows it
        try:
            found += check(model, 100 + seed, 0.5)
        except (RuntimeError, IndexError, ValueError) as e:  # a broken state may also fail loudly
            found.append(repr(e))
        if found:
            break
    assert found, f"{mutation}: not caught"


@pytest.mark.parametrize(("name", "fused"), [("base", False), ("odd", True)])
def test_default_ops_with_pooled_decode_match_within_rounding(tiny_dirs: dict, name: str, fused: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The default op set: verify steps on the decode path (``verify_step``: decode sub-steps on the ``StatePool``,
    taken: counted; their attention in one call per layer where ``fused``, ``verify_attention``), the drafter on the
    pool too. Same tokens; the state equal within rounding. Compression ratios 4, 8 and 16 complete groups inside
    verify steps."""
    model = load(tiny_dirs, name, ReferenceOps())
    model.verify_fused = fused
    taken = []
    real = verify_step.pooled_forward
    monkeypatch.setattr(verify_step, "pooled_forward", lambda *a: taken.append(1) or real(*a))
    for seed in (3, 4):
        assert check(model, seed, 0.6, tol=1e-4) == []
    assert taken


def test_the_decode_paths_ring_restore_is_needed(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step on the decode path (``test_default_ops_with_pooled_decode_match_within_rounding``) with its ring
    restore left out: a run differs from the plain one."""
    model = load(tiny_dirs, "odd", ReferenceOps())
    monkeypatch.setattr(verify_rings, "restore", lambda *a: None)
    found = []
    for seed in (5, 6, 7):
        try:
            found += check(model, seed, 0.5, tol=1e-4)
        except (RuntimeError, IndexError, ValueError) as e:
            found.append(repr(e))
        if found:
            break
    assert found


@pytest.mark.parametrize("mutation", [None, "no window restore"])
def test_the_device_draft_loop_drafts_as_the_host_loop(tiny_dirs: dict, mutation: str | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``draft_graphs.draft_loop`` (the MTP drafter on the ``StatePool``, one host read) drafts the host loop's
    tokens, sequence by sequence with different counts, and leaves the block's window as it was (left out, the rows
    differ)."""
    from deepinfer.models.deepseek_v4 import draft_graphs

    model = load(tiny_dirs, "base", ReferenceOps())
    prompts = [[3, 4, 5, 6, 7], list(range(10, 30)), [9]]
    cache = PagedKVCache(model.config, PAGES * 3, PAGE)
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(3)]
    states = [SequenceState() for _ in prompts]
    batch = ForwardBatch.build([SeqChunk(s, 0, len(x), t) for s, x, t in zip(states, prompts, tables)], prompts)
    h = model(batch, cache)
    nxt = model.logits(h)[[b - 1 for _, b in batch.offsets()]].argmax(-1).tolist()
    drafter = MTPDrafter(model)
    heads = drafter.observe(h, batch.offsets(), [x[1:] + [n] for x, n in zip(prompts, nxt)], states, tables)
    layer = model.config.num_hidden_layers
    before = [st.windows[layer].clone() for st in states]
    counts = [4, 0, 2]
    want = drafter._draft_on_host(heads, counts, states, tables)
    if mutation:
        monkeypatch.setattr(draft_graphs, "put_back", lambda *a: None)
    got = drafter._draft_on_device(heads, counts, states)
    assert got == want and [len(d) for d in got] == counts
    same = all(torch.equal(st.windows[layer], b) for st, b in zip(states, before))
    assert same == (mutation is None)


def test_a_chunk_not_verified_keeps_all_its_tokens(tiny_dirs: dict) -> None:
    """A decode-path step whose other chunk is a prompt's next three tokens (no drafts: not verified): the rollback
    of the verified chunk leaves that chunk's state a plain prefill's (within rounding). Restoring its rows as if it
    had kept one token is caught."""
    model = load(tiny_dirs, "odd", ReferenceOps())
    prompts = [list(range(3, 9)), list(range(20, 28))]
    cache, tables = PagedKVCache(model.config, 2 * PAGES, PAGE), [torch.arange(PAGES), torch.arange(PAGES, 2 * PAGES)]
    states = [SequenceState(), SequenceState()]
    model(ForwardBatch.build([SeqChunk(states[0], 0, 6, tables[0]), SeqChunk(states[1], 0, 5, tables[1])],
                             [prompts[0], prompts[1][:5]]), cache)  # fmt: skip
    chunks = [SeqChunk(states[0], 6, 3, tables[0]), SeqChunk(states[1], 5, 3, tables[1])]
    got = model.verify_forward(ForwardBatch.build(chunks, [[9, 40, 41], prompts[1][5:]]), cache, [0])
    assert got is not None  # the decode path
    got[2].rollback([0])
    plain = Plain(model, prompts[1], PARAMS[0])
    mtp = ("mtp_tokens",) + tuple(f"window of layer {i}" for i in model.config.mtp_layer_ids)  # (not fed here)
    bad = [d for d in differences(states[1], cache, tables[1], plain, 1e-4) if not d.startswith(mtp)]
    assert states[1].num_tokens == 8 and bad == []


@pytest.mark.parametrize("name", ["base", "odd"])
def test_a_step_mixing_a_prompt_with_verify_rows_runs_in_two_parts(
    tiny_dirs: dict, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a verify chunk, a plain decode row and a prompt chunk longer than any ring (``verify_split``):
    the prompt runs as a plain step, the rest on the decode path (taken: counted); the streams are the ragged path's
    within rounding, row for row in the step's order, and after the rollback every sequence's state is a plain
    run's. With the split turned off the same step takes the ragged path (the reference)."""
    from deepinfer.models.deepseek_v4 import verify_split
    from deepinfer.models.deepseek_v4.speculator import MTPSpeculator

    model = load(tiny_dirs, name, ReferenceOps())
    long = 3 * max(model.config.sliding_window, verify_rings.ring_rows(model)) + 5
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (6, 5, long)]

    def step(split: bool) -> tuple[torch.Tensor, list[SequenceState], PagedKVCache, list[torch.Tensor]]:
        cache = PagedKVCache(model.config, 3 * PAGES, PAGE)
        tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(3)]
        states = [SequenceState() for _ in range(3)]
        model(ForwardBatch.build([SeqChunk(states[i], 0, len(prompts[i]), tables[i]) for i in range(2)],
                                 prompts[:2]), cache)  # fmt: skip
        chunks = [SeqChunk(states[2], 0, long, tables[2]), SeqChunk(states[0], 6, 3, tables[0]),
                  SeqChunk(states[1], 5, 1, tables[1])]  # fmt: skip
        batch = ForwardBatch.build(chunks, [prompts[2], [9, 40, 41], [33]])
        with monkeypatch.context() as mp:
            if not split:
                mp.setattr(verify_split, "split", lambda *a: None)
            spec = MTPSpeculator(model, 3, proposer=object())
            h, pending = spec.forward(batch, cache, [1], ["a"], [2])
        assert isinstance(pending.step, verify_step.PooledVerify) == split
        assert pending.step.offsets == [(long, long + 3)]  # the step's rows
        pending.step.rollback([1])
        return h, states, cache, tables

    taken = []
    real = verify_step.pooled_forward
    monkeypatch.setattr(verify_step, "pooled_forward", lambda *a: taken.append(len(a[1].chunks)) or real(*a))
    h, states, cache, tables = step(True)
    assert taken == [2]  # the verify chunk and the decode row; the prompt ran as a plain step
    ragged, *_ = step(False)
    assert h.shape == ragged.shape and (h - ragged).abs().max() <= 1e-4
    consumed = [prompts[0] + [9, 40], prompts[1] + [33], prompts[2]]
    mtp = ("mtp_tokens",) + tuple(f"window of layer {i}" for i in model.config.mtp_layer_ids)  # (not fed here)
    for b in range(3):
        plain = Plain(model, consumed[b], PARAMS[0])
        for i in model.config.mtp_layer_ids:  # (the MTP block's window: not fed here)
            plain.state.windows.pop(i, None), states[b].windows.pop(i, None)
        bad = [d for d in differences(states[b], cache, tables[b], plain, 1e-4) if not d.startswith(mtp)]
        assert states[b].num_tokens == len(consumed[b]) and bad == [], (b, bad)


def test_the_forwards_a_step_may_run(tiny_dirs: dict) -> None:
    """``verify_split.forwards``, what rank 0 of a rank group decides from each rank's plan (tokens, most drafts of
    each chunk): two exactly where ``split`` may take the step (drafts beside a chunk longer than the rings, on the
    decode path); one for a step without drafts, with short chunks only (the decode path takes it whole), or with
    the batch-invariant ops (the ragged path)."""
    from deepinfer.models.deepseek_v4 import verify_split

    model = load(tiny_dirs, "base", ReferenceOps())
    ring = verify_rings.ring_rows(model)
    assert verify_split.forwards(model, [(1, 3), (ring + 1, 0)]) == 2
    assert verify_split.forwards(model, [(1, 3), (1, 0), (ring, 0)]) == 1
    assert verify_split.forwards(model, [(ring + 1, 0), (1, 0)]) == 1
    assert verify_split.forwards(model, [(1, 3), (1, 2)]) == 1
    model.pooled_decode = False
    assert verify_split.forwards(model, [(1, 3), (ring + 1, 0)]) == 1
    assert verify_split.forwards(load(tiny_dirs, "base", BatchInvariantOps()), [(1, 3), (ring + 1, 0)]) == 1
