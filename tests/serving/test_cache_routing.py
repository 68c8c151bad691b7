"""Cache-aware routing (docs/routing.md): the balancer's index of the replicas' resume points
(``services/balancer/cache_index.py``) fed by their KV events, and the choice of a replica
(``services/balancer/replicas.py``).

Through the launcher's mesh (NATS, two replicas, the balancer, real processes; the ``openai`` client): every turn
of a conversation after the first goes to the replica that holds the previous turn's resume point and resumes
there; requests of one session with nothing cached go to one replica."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from deepinfer import SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.pages import PagePool
from deepinfer.engine.prefix_scheduling import event_fields
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from services.balancer.cache_index import CacheIndex
from services.balancer.replicas import Replica, ReplicaSet, RouteHint
from serving.launched import launched_mesh, metric

VOCAB = 129280


def replicas(*in_flight: int) -> ReplicaSet:
    pool = ReplicaSet()
    pool.replicas = [Replica(f"r{i}", None, in_flight=n) for i, n in enumerate(in_flight)]
    return pool


def test_the_choice_of_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ROUTER_LOAD_TOKENS", "100")
    pool = replicas(0, 3, 1)
    hint = RouteHint(1000, {"r1": 800})
    assert pool.pick(hint=hint).address == "r1" and hint.reason == "cache"  # 200 + 300 < 1000 + 0
    hint = RouteHint(1000, {"r1": 250})
    assert pool.pick(hint=hint).address == "r0" and hint.reason == "cache"  # 750 + 300 > 1000 + 0: the load wins
    hint = RouteHint(10)
    assert pool.pick(hint=hint).address == "r0" and hint.reason == "load"
    assert pool.pick("r2", RouteHint(10, {"r1": 9})).address == "r2"  # prefer
    sessions = [f"s{i}" for i in range(40)]
    first = {s: pool.pick(hint=RouteHint(10, session=s)).address for s in sessions}
    assert first == {s: pool.pick(hint=RouteHint(10, session=s)).address for s in sessions}  # stable
    assert len(set(first.values())) == 3  # spread over the replicas
    pool.replicas[1].healthy = False  # r1 leaves: only its sessions move
    moved = {s: pool.pick(hint=RouteHint(10, session=s)).address for s in sessions}
    assert all(moved[s] == a for s, a in first.items() if a != "r1") and "r1" not in moved.values()


def test_the_policies_to_measure_against(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = replicas(0, 3, 1)
    monkeypatch.setenv("DEEPINFER_ROUTER_POLICY", "load")  # the cache and the session are not looked at
    hint = RouteHint(1000, {"r1": 999}, session="s")
    assert pool.pick(hint=hint).address == "r0" and hint.reason == "load"
    monkeypatch.setenv("DEEPINFER_ROUTER_POLICY", "round_robin")
    picked = [pool.pick(hint=RouteHint(1000, {"r1": 999})).address for _ in range(6)]
    assert sorted(picked) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert pool.pick("r2", RouteHint(10)).address == "r2"  # the samples of one prompt still go together


def test_the_index_follows_a_replicas_resume_points() -> None:
    """A scheduler's own KV events (``kv_listeners``, as ``DeviceKVPublisher`` sends them) fill the index; a prompt
    that extends a resume point's tokens is a hit at its position, another prompt or salt is not, removal
    empties it; a restarted scheduler (another instance) starts afresh; bad messages are dropped and counted."""
    config = SchedulerConfig(page_size=16, max_model_len=512, eos_token_id=1, max_num_seqs=4,
                             max_num_batched_tokens=256, prefix_caching=True, fingerprint="fp")  # fmt: skip
    sched = Scheduler(config, PagePool(32))
    events: list[dict] = []
    sched.kv_listeners.append(
        lambda kind, rp, reason: events.append(
            {"type": kind, "tier": "device", "fingerprint": "fp", **event_fields(rp, "fp"), "resume_point": True}
        )
    )
    prompt = [random.Random(1).randrange(2, VOCAB) for _ in range(40)]
    sched.add("a", prompt, SamplingParams(max_tokens=4))
    sched.schedule()
    sched.schedule()  # the snapshot's order (and its KV event) goes with the next plan
    assert [e["type"] for e in events] == ["stored"] and events[0]["position"] == 40
    index, changes = CacheIndex(on_change=lambda a, n: changes.append((a, n))), []
    msg = {"instance": "s1", "address": "10.0.0.1:5", "page_size": 16, "events": events}
    index.apply(msg)
    assert index.cached(["10.0.0.1:5", "other"], prompt + [7, 8], None) == {"10.0.0.1:5": 40, "other": 0}
    assert index.cached(["10.0.0.1:5"], prompt + [7, 8], "tenant") == {"10.0.0.1:5": 0}  # another salt
    assert index.cached(["10.0.0.1:5"], prompt[:30] + [5] * 12, None) == {"10.0.0.1:5": 0}
    assert changes == [("10.0.0.1:5", 1)]
    index.apply({**msg, "events": [{**events[0], "type": "removed"}]})
    assert index.cached(["10.0.0.1:5"], prompt + [7], None) == {"10.0.0.1:5": 0}
    index.apply(msg)
    index.apply({**msg, "instance": "s2", "events": []})  # (no event: nothing to reset with)
    index.apply({**msg, "instance": "s2", "events": [{**events[0], "tag": "00" * 16}]})  # restarted: afresh
    assert index.entries("10.0.0.1:5") == 1 and index.cached(["10.0.0.1:5"], prompt + [7], None) == {"10.0.0.1:5": 0}
    for bad in ({"events": []}, {**msg, "page_size": 0}, {**msg, "events": [{"tier": "device", "resume_point": 1}]}):
        asyncio.run(index.on_message("deepinfer.kv.scheduler.x", bad))
    assert index.rejected == 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("routing")
    with launched_mesh(tmp, make_tiny_model(tmp / "model", seed=8), http=True, DEEPINFER_BATCH_INVARIANT="1") as m:
        yield m


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_each_turn_goes_where_the_conversation_is_cached(mesh) -> None:
    api = mesh.endpoints["http"]
    metrics = api.removesuffix("/v1") + "/metrics"
    client = openai.OpenAI(base_url=api, api_key="x")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are terse. " * 12}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: how many legs has a spider?"})
        entries = metric(metrics, "deepinfer_balancer_cache_index_entries")
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        cached.append(out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
        wait_for(lambda e=entries: metric(metrics, "deepinfer_balancer_cache_index_entries") > e)  # the KV events
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert metric(metrics, "deepinfer_balancer_routes_total", reason="cache") >= 3


@pytest.mark.timeout(300)
def test_a_session_stays_on_one_replica(mesh) -> None:
    api = mesh.endpoints["http"]
    client = openai.OpenAI(base_url=api, api_key="x")
    model = client.models.list().data[0].id
    done = [mesh.endpoints[f"scheduler-{r} metrics"] for r in range(2)]
    before = [metric(u, "deepinfer_scheduler_requests_total", outcome="finished") for u in done]
    rng = random.Random(3)
    for _ in range(4):  # nothing cached: each prompt new
        prompt = [rng.randrange(2, VOCAB) for _ in range(20)]
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_headers={"x-session-id": "conversation-7"})  # fmt: skip
    after = [metric(u, "deepinfer_scheduler_requests_total", outcome="finished") for u in done]
    assert sorted(a - b for a, b in zip(after, before)) == [0, 4]
    with pytest.raises(openai.BadRequestError, match="session_id"):
        client.completions.create(model=model, prompt=[5, 6], max_tokens=1, user="u" * 300)


def test_a_probing_round_that_fails_does_not_end_probing() -> None:
    """Whatever a round of health probes raises, the next rounds run (else a replica marked down never returns)."""
    rounds: list[int] = []

    def after_round() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the first round fails")

    async def run() -> None:
        pool = replicas(0)
        pool.on_probed.append(after_round)
        pool.start(period_s=0.01)
        try:
            for _ in range(500):
                if len(rounds) >= 3:
                    return
                await asyncio.sleep(0.01)
        finally:
            await pool.close()

    asyncio.run(run())
    assert len(rounds) >= 3
