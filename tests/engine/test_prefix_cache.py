"""The device prefix cache (issue 5): resume points addressed by a hash chain, exact resumption, page
accounting, eviction before preemption, salt isolation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.interfaces import SeqResult, StepResult, WorkerStepPlan
from deepinfer.engine.prefix_cache import PrefixCache, root_hash
from engine.test_scheduler import make_scheduler

VOCAB = 129280
PS = 16


# -- the index --------------------------------------------------------------------------------
def test_lookup_finds_the_longest_visible_prefix_within_the_limit():
    cache, root = PrefixCache(4, capacity=10), root_hash("m", None)
    toks = list(range(100, 120))
    a = cache.insert(toks[:8], root, [1, 2])  # page-aligned
    b = cache.insert(toks[:11], root, [1, 2])  # two pages + a 3-token tail
    c = cache.insert(toks[:6], root, [1])
    for rp in (a, b, c):
        rp.visible = True
    assert cache.lookup(toks, root, 19) is b
    assert cache.lookup(toks, root, 10) is a  # b is too long for the limit
    assert cache.lookup(toks[:10] + [7, 7], root, 11) is a  # b's tail differs
    assert cache.lookup([5] + toks[1:], root, 19) is None  # the first page differs
    assert cache.lookup(toks, root_hash("m", "tenant"), 19) is None  # another salt
    assert cache.lookup(toks, root_hash("other model", None), 19) is None
    assert cache.insert(toks[:11], root, [1, 2]) is None  # a duplicate: nothing new
    hidden = cache.insert(toks[:15], root, [1, 2, 3])
    assert not hidden.visible and cache.lookup(toks, root, 19) is b  # not yet snapshotted: invisible
    with pytest.raises(ValueError, match="full pages"):
        cache.insert(toks[:9], root, [1])


def test_every_miss_has_a_reason():
    cache = PrefixCache(4, capacity=10, remember_evicted=2)
    plain, salted = root_hash("m", None), root_hash("m", "alice")
    toks = list(range(100, 120))
    assert cache.miss_reason(toks, plain, plain, 19) == "no_resume_point"
    pending = cache.insert(toks[:9], plain, [1, 2], plain)
    assert cache.miss_reason(toks, plain, plain, 19) == "not_yet_stored"
    pending.visible = True
    assert cache.pop_lru() is pending
    assert cache.miss_reason(toks, plain, plain, 19) == "evicted"
    cache.insert(toks[:6], salted, [1], plain).visible = True
    assert cache.miss_reason(toks, root_hash("m", "bob"), plain, 19) == "salt_mismatch"  # alice's entry
    assert cache.lookup(toks, plain, 19) is None and cache.miss_reason(list(range(1, 20)), plain, plain, 19) == (
        "no_resume_point"
    )
    for i in range(3):  # the memory of evicted keys is bounded
        cache.insert([i] * 5, plain, [i], plain).visible = True
    while cache.pop_lru() is not None:
        pass
    assert cache.miss_reason(toks, plain, plain, 19) == "no_resume_point"  # forgotten: only 2 evictions kept


def test_lru_order_and_capacity():
    cache, root = PrefixCache(4, capacity=2), root_hash("m", None)
    rps = [cache.insert([i, i, i, i, i], root, [i]) for i in range(3)]
    for rp in rps:
        rp.visible = True
    assert cache.over_capacity()
    cache.lookup([0, 0, 0, 0, 0, 9], root, 5)  # touch the oldest
    assert cache.pop_lru() is rps[1] and cache.pop_lru() is rps[2] and cache.pop_lru() is rps[0]
    assert cache.pop_lru() is None and len(cache) == 0


# -- the scheduler's page accounting -----------------------------------------------------------
class SnapshotWorker:
    """The worker contract with snapshots: state positions only, no model."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.snapshots: dict[str, int] = {}

    def execute(self, plan: WorkerStepPlan) -> StepResult:
        for o in plan.snapshots:
            assert self.held.get(o.request_id) == o.position, (o, self.held.get(o.request_id))
            self.snapshots[o.snapshot_id] = o.position
        for rid in plan.released:
            self.held.pop(rid, None)
        out = StepResult(plan.step_id)
        for c in plan.chunks:
            if c.resume_from is not None:
                assert self.snapshots[c.resume_from] == c.start
                self.held[c.request_id] = c.start
            assert self.held.get(c.request_id, 0) == c.start
            self.held[c.request_id] = c.start + len(c.token_ids)
            out.results.append(SeqResult(c.request_id, token_id=7 if c.sample else None, logprob=0.0))
        for sid in plan.dropped_snapshots:
            del self.snapshots[sid]
        return out


def check_refcounts(sched) -> None:
    holders = Counter(p for r in sched.requests.values() for p in r.pages)
    holders.update(p for rp in sched.prefix.entries() for p in rp.pages)
    for p in range(sched.pages.num_total):
        assert sched.pages.refcount(p) == holders.get(p, 0), p
    assert sched.pages.num_used == len(holders)
    assert len(sched.prefix) <= sched.prefix.capacity


def test_random_shared_prefix_traffic_keeps_page_accounting_exact():
    rng = random.Random(3)
    sched = make_scheduler(num_pages=24, budget=40, prefix_caching=True)
    sched.prefix.capacity = 6
    worker = SnapshotWorker()
    stems = [[rng.randrange(10, 90) for _ in range(rng.randint(1, 50))] for _ in range(4)]
    n, hits = 0, 0
    for _ in range(300):
        if rng.random() < 0.4 and len(sched.waiting) < 6:
            stem = rng.choice(stems)
            ids = stem[: rng.randint(1, len(stem))] + [rng.randrange(10, 90) for _ in range(rng.randint(0, 12))]
            sched.add(f"r{n}", ids, SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True))
            n += 1
        if rng.random() < 0.05 and sched.running:
            sched.abort([rng.choice(sched.running).request_id])
        for req in sched.update(worker.execute(sched.schedule())):
            hits += req.num_cached_tokens > 0
            sched.pop_finished(req.request_id)
        for rid in [r for r, q in sched.requests.items() if q.finished]:
            hits += sched.requests[rid].num_cached_tokens > 0
            sched.pop_finished(rid)
        check_refcounts(sched)
    assert hits > 3
    sched.reset_prefix_cache()
    while sched.has_unfinished():
        for req in sched.update(worker.execute(sched.schedule())):
            sched.pop_finished(req.request_id)
    sched.reset_prefix_cache()
    worker.execute(sched.schedule())
    assert sched.pages.num_used == 0 and not worker.snapshots


def test_resume_points_are_evicted_before_a_running_request_is_preempted():
    sched = make_scheduler(num_pages=10, budget=64, prefix_caching=True, page_size=8)
    worker = SnapshotWorker()
    sched.add("a", list(range(10, 46)), SamplingParams(max_tokens=1))  # 36 tokens
    while sched.has_unfinished():
        sched.update(worker.execute(sched.schedule()))
    # one resume point at 36 (the prompt's end is also the state's end): 4 full pages, the tail in the snapshot
    assert len(sched.prefix) == 1 and sched.pages.num_used == 4
    sched.add("b", list(range(60, 116)), SamplingParams(max_tokens=3, ignore_eos=True))  # 56 + 3 tokens: 8 pages
    while sched.has_unfinished():
        sched.update(worker.execute(sched.schedule()))
    assert sched.num_preemptions == 0 and sched.requests["b"].finish_reason == "length"
    assert [rp.position for rp in sched.prefix.entries()] == [56, 58]  # a's point made room for b's


# -- exactness through the engine ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_prefix") / "m", seed=2)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompt: list[int], **kw) -> tuple:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True, **kw)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    o = out.outputs[0]
    return out.num_cached_tokens, tuple(o.token_ids), [dict(d) for d in o.logprobs]


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "default"])
def test_a_hit_at_each_kind_of_resume_point_equals_a_cold_prefill(model_dir, monkeypatch, invariant):
    monkeypatch.setenv("DEEPINFER_RESUME_INTERVAL", str(2 * PS))
    kw = {"dtype": "float32", "num_pages": 96, "page_size": PS, "batch_invariant": invariant,
          "max_num_batched_tokens": PS}  # fmt: skip
    warm = LLM(model=model_dir, enable_prefix_caching=True, **kw)
    cold = LLM(model=model_dir, enable_prefix_caching=False, **kw)
    first = ids(45, 1)
    cached, a_out, _ = run(warm, first)  # leaves resume points at 32 (interval), 45 (prompt end), 50 (end)
    assert cached == 0
    cases = {
        "interval": first[:40] + ids(20, 2),  # shares 40 tokens: resumes at 32
        "prompt end": first + ids(9, 3),  # resumes at 45
        "sequence end": first + list(a_out[:5]) + ids(7, 4),  # the first request's whole state: 50
    }
    expect = {"interval": 32, "prompt end": 45, "sequence end": 50}
    for name, prompt in cases.items():
        w, c = run(warm, prompt), run(cold, prompt)
        assert w[0] == expect[name], name
        assert w[1] == c[1], name
        if invariant:
            assert w[2] == c[2], name  # bit-identical logprobs
        else:
            diff = max(abs(x[t] - y[t]) for x, y in zip(w[2], c[2]) for t in x)
            assert diff <= 1e-5, (name, diff)


def test_cache_salt_isolates_tenants(model_dir):
    llm = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)
    prompt = ids(30, 5)

    def cached(salt: str | None, extra: list[int]) -> int:
        p = {"prompt_token_ids": prompt + extra} | ({"cache_salt": salt} if salt is not None else {})
        return llm.generate(p, SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens

    assert cached("alice", []) == 0  # leaves a resume point at 30
    assert cached("bob", [6]) == 0 and cached(None, [7]) == 0  # other tenants do not see it
    assert cached("alice", [8]) == 30
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 3})


def test_chunks_end_at_resume_hints_and_leave_resume_points():
    sched = make_scheduler(num_pages=32, budget=64, prefix_caching=True)
    worker = SnapshotWorker()
    sched.add("a", list(range(10, 60)), SamplingParams(max_tokens=1), resume_hints=[21, 0, 99, 21])
    plan = sched.schedule()
    assert [(c.start, len(c.token_ids)) for c in plan.chunks] == [(0, 21)]  # cut at the hint
    sched.update(worker.execute(plan))
    plan = sched.schedule()
    assert [o.position for o in plan.snapshots] == [21] and plan.chunks[0].start == 21
    sched.update(worker.execute(plan))
    assert [rp.position for rp in sched.prefix.entries()] == [21, 50]


def test_thinking_chat_turns_resume_after_the_assistant_token(model_dir):
    from deepinfer.chat import turn_boundaries

    llm = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=5)
    turn1 = [{"role": "user", "content": "Name a colour."}]
    (first,) = llm.chat(turn1, params, thinking_mode="thinking")
    hints = turn_boundaries(first.prompt_token_ids, llm.tokenizer)
    assert hints and first.prompt_token_ids[hints[-1] :] == [llm.tokenizer.token_to_id("<think>")]
    turn2 = turn1 + [{"role": "assistant", "content": "Blue.", "reasoning_content": "Pick one."},
                     {"role": "user", "content": "Another?"}]  # fmt: skip
    (second,) = llm.chat(turn2, params, thinking_mode="thinking")
    # the history drops turn 1's reasoning, so turn 1's own end never matches; its hint does
    assert second.num_cached_tokens == hints[-1]
    cold = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True,
               enable_prefix_caching=False).chat(turn2, params, thinking_mode="thinking")[0]  # fmt: skip
    assert cold.outputs[0].token_ids == second.outputs[0].token_ids


def test_conversations_with_one_system_message_share_its_state(model_dir):
    llm = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)
    params = SamplingParams(temperature=0, max_tokens=3)
    system = {"role": "system", "content": "You answer in one word, politely and without any punctuation."}
    (a,) = llm.chat([system, {"role": "user", "content": "Name a colour."}], params)
    (b,) = llm.chat([system, {"role": "user", "content": "Name a fruit."}], params)
    end = a.prompt_token_ids.index(llm.tokenizer.token_to_id("<｜User｜>"))
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == end > 1  # another user: the system message's state


@pytest.mark.parametrize("replay", [20, 64])
def test_compact_mode_replays_the_last_tokens_and_its_drift_is_measured(model_dir, monkeypatch, replay, capsys):
    """DeepInfer's compact mode: resume points keep only pages, a hit replays ``replay`` tokens with a truncated
    window. The tiny model's receptive field is 6 layers × 7 + 1 = 43 tokens: a 64-token replay is exact up to
    rounding, a 20-token one (window + 12, DeepInfer's rule) is approximate; the drift is printed."""
    monkeypatch.setenv("DEEPINFER_COMPACT_REPLAY_TOKENS", str(replay))
    kw = {"dtype": "float32", "num_pages": 96, "page_size": PS, "batch_invariant": True}
    compact = LLM(model=model_dir, **kw)
    monkeypatch.delenv("DEEPINFER_COMPACT_REPLAY_TOKENS")
    cold = LLM(model=model_dir, enable_prefix_caching=False, **kw)
    first = ids(90, 11)
    run(compact, first)
    assert all(s.compact and not s.state.windows for s in compact.engine.runner.snapshots.values())
    follow = first + ids(9, 12)
    w, c = run(compact, follow), run(cold, follow)
    assert w[0] == 90 - replay  # the replayed tokens are computed again
    drift = max(abs(x[t] - y[t]) for x, y in zip(w[2], c[2]) for t in x.keys() & y.keys())
    with capsys.disabled():
        print(f"\ncompact replay {replay}: max |Δ logprob| vs a cold prefill {drift:.3g}, "
              f"greedy tokens {'equal' if w[1] == c[1] else 'differ'}")  # fmt: skip
    if replay >= 43:
        assert w[1] == c[1] and drift <= 1e-4
    else:
        assert 0 < drift < 10


def test_compact_replay_shorter_than_the_compressors_need_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("DEEPINFER_COMPACT_REPLAY_TOKENS", "3")
    with pytest.raises(ValueError, match="DEEPINFER_COMPACT_REPLAY_TOKENS=3 is too short"):
        LLM(model=model_dir, dtype="float32", num_pages=16, page_size=PS)
