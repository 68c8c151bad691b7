"""``n`` > 1 through the real mesh (worker + scheduler + balancer processes on loopback, the ``openai`` client):
n choices with indices 0..n-1, usage with the prompt counted once, seeded samples distinct and reproducible (sample
``i`` of seed ``s`` is the seed ``s + i`` request), streamed samples interleaved with one final usage, and the
samples after the first resuming from the first one's prefix-cache entry; and the same over the gRPC Generation API
(a real ``grpcio`` client): messages indexed by sample, seeded samples as the ``seed + i`` requests, the resume,
``n`` out of range refused with INVALID_ARGUMENT naming it, Abort of the request's id ending every sample."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "user", "content": "Write a short poem about rivers and stones."}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("n_model"), seed=3)
    m = Mesh(model, tmp_path_factory.mktemp("n_logs")).up(http=True)
    yield m
    m.down()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def prefix_hits(mesh: Mesh) -> float:
    text = urllib.request.urlopen(mesh.metrics_url("scheduler"), timeout=10).read().decode()
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples]
    names = [s.name for f in text_string_to_metric_families(text) for s in f.samples]
    return found[names.index("vllm:prefix_cache_hits_total")]


def test_chat_n_choices_seeded_distinct_and_reproducible(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    one = client.chat.completions.create(**kw)
    res = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in res.choices] == [0, 1, 2]
    texts = [c.message.content for c in res.choices]
    assert len(set(texts)) == 3, texts  # independent samples
    assert all(c.finish_reason == "length" for c in res.choices)
    assert res.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert res.usage.completion_tokens == 3 * 8 and res.usage.total_tokens == res.usage.prompt_tokens + 24
    again = client.chat.completions.create(n=3, seed=11, **kw)
    assert [c.message.content for c in again.choices] == texts
    # sample i of seed s is the seed s + i sample
    alone = [client.chat.completions.create(seed=11 + i, **kw).choices[0].message.content for i in range(3)]
    assert alone == texts


def test_completions_n_unseeded_and_best_of(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0}
    res = client.completions.create(n=4, best_of=4, logprobs=1, extra_body={"ignore_eos": True}, **kw)
    assert [c.index for c in res.choices] == [0, 1, 2, 3] and len({c.text for c in res.choices}) > 1
    assert all(len(c.logprobs.tokens) == 6 for c in res.choices)
    assert res.usage.completion_tokens == 24
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=2, best_of=3, **kw)
    assert e.value.status_code == 400 and e.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=1000, **kw)
    assert e.value.status_code == 400 and e.value.param == "n"


def test_streamed_n_interleaves_with_one_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    order, text, finish, usages = [], {0: "", 1: ""}, {}, []
    for ev in stream:
        if ev.usage is not None:
            usages.append(ev.usage)
        for c in ev.choices:
            order.append(c.index)
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(order) == {0, 1} and finish == {0: "length", 1: "length"}
    assert order != sorted(order), order  # the samples' chunks come interleaved, not one sample after the other
    assert len(usages) == 1 and usages[0].completion_tokens == 48
    seeded = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.message.content for c in seeded.choices] == [text[0], text[1]]  # streamed or not, the same samples
    assert usages[0].prompt_tokens == seeded.usage.prompt_tokens


def test_samples_resume_from_the_first_ones_prompt(mesh: Mesh, client: openai.OpenAI, model: str) -> None:
    before = prefix_hits(mesh)
    messages = [{"role": "user", "content": "A prompt seen nowhere else in this module, about owls at night."}]
    res = client.chat.completions.create(model=model, messages=messages, max_tokens=2, n=3)
    prompt = res.usage.prompt_tokens
    assert prefix_hits(mesh) - before >= 2 * (prompt - 1)  # samples 1 and 2 computed only the last prompt token


# -- the gRPC Generation API: the same samples, each message naming its index --------------------------------------
def grpc_samples(mesh: Mesh, requests: list[generation_pb2.GenerateRequest]) -> list[list]:
    """Each request's messages, in the order they came, over a real grpcio client."""

    async def run() -> list[list]:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return [[m async for m in stub.Generate(r, timeout=120)] for r in requests]

    return asyncio.run(run())


def texts_by_index(msgs: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out


def grpc_request(
    n: int = 0, seed: int | None = None, max_tokens: int = 8, rid: str = ""
) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(request_id=rid, text="Once upon a time", sampling=sampling, n=n)


def test_grpc_n_samples_indexed_seeded_and_reproducible(mesh: Mesh) -> None:
    singles = [grpc_request(seed=21 + i) for i in range(3)]
    many, again, *alone = grpc_samples(mesh, [grpc_request(3, seed=21, rid="g-n3"), grpc_request(3, seed=21), *singles])
    assert {m.request_id for m in many} == {"g-n3"} and len({m.request_id for m in again}) == 1
    got = texts_by_index(many)
    assert sorted(got) == [0, 1, 2] and all(len(t) == 8 for t in got.values())
    assert len({tuple(t) for t in got.values()}) == 3  # independent samples
    finished = {m.index: m.finished for m in many if m.HasField("finished")}
    assert sorted(finished) == [0, 1, 2] and all(f.usage.completion_tokens == 8 for f in finished.values())
    assert texts_by_index(again) == got  # the same request repeats its samples
    assert [texts_by_index(a)[0] for a in alone] == [got[0], got[1], got[2]]  # sample i is the seed s + i request
    firsts = [m for m in many if m.prompt_tokens]
    assert sorted(m.index for m in firsts) == [0, 1, 2]
    assert all(m.index == 0 for a in alone for m in a)


def test_grpc_n_resumes_from_the_first_sample(mesh: Mesh) -> None:
    before = prefix_hits(mesh)
    req = grpc_request(3, max_tokens=2)
    req.text = "A gRPC prompt seen nowhere else in this module, about herons at dawn."
    (msgs,) = grpc_samples(mesh, [req])
    prompt = next(m.prompt_tokens for m in msgs if m.index == 0 and m.prompt_tokens)
    assert prefix_hits(mesh) - before >= 2 * (prompt - 1)  # samples 1 and 2 computed only the last prompt token


@pytest.mark.parametrize("n", [17, -1])
def test_grpc_n_out_of_range_is_invalid_argument(mesh: Mesh, n: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        grpc_samples(mesh, [grpc_request(n)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n: "), e.value


def test_grpc_abort_ends_every_sample(mesh: Mesh) -> None:
    async def run() -> tuple[list[str], list]:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            call = stub.Generate(grpc_request(2, max_tokens=2000, rid="g-abort"), timeout=120)
            msgs = [await call.read()]
            while len({m.index for m in msgs}) < 2:  # both samples running
                msgs.append(await call.read())
            res = await stub.Abort(generation_pb2.AbortRequest(request_ids=["g-abort"]), timeout=30)
            while (m := await call.read()) is not grpc.aio.EOF:
                msgs.append(m)
            return list(res.aborted), msgs

    aborted, msgs = asyncio.run(run())
    assert aborted == ["g-abort"]
    reasons = {m.index: m.finished.reason for m in msgs if m.HasField("finished")}
    assert reasons == {0: common_pb2.FINISH_REASON_ABORT, 1: common_pb2.FINISH_REASON_ABORT}
