"""The prefix cache through the mesh (issue 5): a multi-turn chat through the ``openai`` package reports
``cached_tokens`` for the stored history on every later turn, and its replies equal a cold server's
(prefix caching off), bit for bit in batch-invariant mode; tenants with different ``cache_salt`` share
nothing."""

from __future__ import annotations

import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.prefix_cache import MISS_REASONS
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
TURNS = ["Tell me about the sea.", "And the mountains?", "Which one is older?", "Thanks. One more word?"]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("pc_model"), seed=4)
    up = []
    for caching in ("1", "0"):
        env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_ENABLE_PREFIX_CACHING": caching}
        up.append(Mesh(model, tmp_path_factory.mktemp(f"pc_logs_{caching}"), extra_env=env).up())
    yield up
    for m in up:
        m.down()


def chat(client: openai.OpenAI, salt: str | None = None) -> list[tuple[str, int, int]]:
    """The conversation, turn by turn: (reply, prompt tokens, cached tokens)."""
    messages, out = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, max_tokens=12, temperature=0,
            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True} | ({"cache_salt": salt} if salt else {}),
        )  # fmt: skip
        reply = r.choices[0].message.content
        lps = [(t.token, t.logprob) for t in r.choices[0].logprobs.content]
        messages.append({"role": "assistant", "content": reply})
        details = r.usage.prompt_tokens_details
        cached = details.cached_tokens if details else 0
        if cached:
            assert details.model_extra["cached_tokens_by_tier"] == {"device": cached}
        out.append((reply, lps, r.usage.prompt_tokens, cached))
    return out


def test_multi_turn_chat_hits_the_cache_and_equals_a_cold_server(meshes) -> None:
    warm, cold = (openai.OpenAI(base_url=m.http_url() + "/v1", api_key="x", max_retries=0) for m in meshes)
    got, ref = chat(warm), chat(cold)
    assert [g[:2] for g in got] == [r[:2] for r in ref]  # same replies, bit-identical logprobs
    assert got[0][3] == 0 and all(r[3] == 0 for r in ref)
    for prev, cur in zip(got, got[1:]):
        assert cur[3] >= prev[2]  # at least the previous turn's whole prompt came from the cache
        assert cur[3] < cur[2]
    # another tenant's identical conversation starts cold, then hits its own entries
    other = chat(warm, salt="tenant-b")
    assert [o[:2] for o in other] == [g[:2] for g in got]
    assert other[0][3] == 0 and other[1][3] >= other[0][2]
    # a third tenant asks for the second turn straight away: the first turn's entries exist, under no salt
    second = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": got[0][0]},
              {"role": "user", "content": TURNS[1]}]  # fmt: skip
    r = warm.chat.completions.create(model=warm.models.list().data[0].id, messages=second, max_tokens=2,
                                     extra_body={"cache_salt": "tenant-c"})  # fmt: skip
    assert r.usage.prompt_tokens_details is None or not r.usage.prompt_tokens_details.cached_tokens
    text = urllib.request.urlopen(meshes[0].metrics_url("scheduler"), timeout=10).read().decode()
    samples = {
        (x.name, x.labels.get("reason")): x.value for f in text_string_to_metric_families(text) for x in f.samples
    }
    assert samples[("vllm:prefix_cache_hits_total", None)] >= sum(g[3] for g in got + other) > 0
    misses = {r: samples[("deepinfer_prefix_cache_misses_total", r)] for r in MISS_REASONS}
    # the first turn finds nothing (a prompt never resumes at its own end); tenant-b's first turn and tenant-c find
    # another tenant's entry (the first turn's resume point at its turn hint, right after <｜Assistant｜>)
    expected = {"no_resume_point": 1, "evicted": 0, "salt_mismatch": 2, "not_yet_stored": 0}
    assert misses == expected | {r: 0 for r in MISS_REASONS if r.startswith("kvstore_")}, misses
