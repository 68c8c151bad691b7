"""The services as real processes on loopback, driven by a real gRPC client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh, health_status

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mesh_model"), seed=5)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # info logs: the worker's start-up events (heap_frozen)
    m = Mesh(model_dir, tmp_path_factory.mktemp("mesh_logs"), extra_env={"DEEPINFER_LOG_LEVEL": "info"}).up()
    yield m
    m.down()


def stub(mesh: Mesh) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(mesh.address("balancer")))


def gen_request(ids: list[int], **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(**sampling)
    )


async def collect(s: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest, timeout=None):
    msgs = [m async for m in s.Generate(req, timeout=timeout)]
    return msgs, [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def test_generate_streams_the_offline_tokens(mesh: Mesh, model_dir: Path) -> None:
    prompts = [[0, 11, 22, 33], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 42]]
    llm = LLM(model=model_dir, dtype="float32", page_size=16, num_pages=64)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))

    async def run():
        s = stub(mesh)
        return await asyncio.gather(*[collect(s, gen_request(p, temperature=0, max_tokens=12)) for p in prompts])

    for (msgs, tokens, text), r in zip(asyncio.run(run()), ref):
        assert tokens == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert len(msgs) > 1  # streamed, not one reply
        f = msgs[-1].finished
        assert f.reason == common_pb2.FINISH_REASON_LENGTH
        assert (f.usage.prompt_tokens, f.usage.completion_tokens) == (len(r.prompt_token_ids), 12)


def test_text_and_chat_inputs_and_stop_strings(mesh: Mesh) -> None:
    async def run():
        s = stub(mesh)
        _, toks, text = await collect(
            s,
            generation_pb2.GenerateRequest(
                text="Hello there", sampling=common_pb2.SamplingParams(temperature=0, max_tokens=10)
            ),
        )
        stop = text[3:6]
        msgs, _, cut = await collect(
            s,
            generation_pb2.GenerateRequest(
                text="Hello there", sampling=common_pb2.SamplingParams(temperature=0, max_tokens=10, stop=[stop])
            ),
        )
        chat = generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(role="user", content="Hi")])
        tok = await s.Tokenize(generation_pb2.TokenizeRequest(chat=chat))
        cmsgs, _, _ = await collect(
            s, generation_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(max_tokens=3))
        )
        return text, stop, msgs, cut, tok, cmsgs

    text, stop, msgs, cut, tok, cmsgs = asyncio.run(run())
    assert cut == text[: text.index(stop)]
    assert msgs[-1].finished.reason == common_pb2.FINISH_REASON_STOP and msgs[-1].finished.stop_string == stop
    assert tok.prompt == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>" and tok.token_ids[-1] == 128822
    assert cmsgs[0].prompt_tokens == len(tok.token_ids)


@pytest.mark.parametrize(
    ("sampling", "ids", "field"),
    [
        ({"temperature": -1.0}, [0, 1, 2], "temperature"),
        ({"top_p": 2.0}, [0, 1, 2], "top_p"),
        ({"max_tokens": 0}, [0, 1, 2], "max_tokens"),
        ({}, [], "prompt"),
        ({}, [0, 129280], "prompt_token_ids"),
        ({}, [0] * 5000, "prompt"),
    ],
)
def test_bad_requests_are_invalid_argument_and_the_server_stays_healthy(mesh: Mesh, sampling, ids, field) -> None:
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub(mesh), gen_request(ids, **sampling))
        return e.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
    assert health_status(mesh.address("balancer")) == health_pb2.HealthCheckResponse.SERVING


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _sample(text: str, prefix: str) -> float:
    """The value of the one sample whose line starts with ``prefix`` in a Prometheus text body."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    assert len(values) == 1, (prefix, values)
    return values[0]


def test_scheduler_worker_and_balancer_metrics_count_grpc_requests(mesh: Mesh) -> None:
    async def run():
        return await collect(stub(mesh), gen_request([0, 9, 8, 7], temperature=0, max_tokens=5))

    _, toks, _ = asyncio.run(run())
    assert len(toks) == 5
    model = f'model_name="{mesh.model}"'
    sched = http_get(mesh.metrics_url("scheduler"))
    assert _sample(sched, f'deepinfer_scheduler_requests_total{{{model},outcome="finished"}}') >= 1
    assert _sample(sched, "deepinfer_scheduler_step_seconds_count{") >= 5
    assert _sample(sched, "vllm:iteration_tokens_total_sum{") >= 4 + 4  # the prompt, then one token a step
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        _sample(sched, f"{gauge}{{{model}}}")
    _sample(sched, f"vllm:num_preemptions_total{{{model}}}")
    worker = http_get(mesh.metrics_url("worker"))
    assert _sample(worker, f"deepinfer_worker_tokens_total{{{model}}}") >= 8
    assert _sample(worker, "deepinfer_worker_step_seconds_count{") >= 5
    assert _sample(worker, f"deepinfer_worker_graph_captures_total{{{model}}}") == 0  # (a CPU has no CUDA graphs)
    balancer = http_get(f"{mesh.http_url()}/metrics")
    assert (
        _sample(
            balancer,
            "deepinfer_balancer_requests_total{"  # the balancer names the model by its served name
            + f'model_name="{mesh.model.name}",route="/deepinfer.v1.Generation/Generate",status="ok"}}',
        )
        >= 1
    )


def test_cancel_and_deadline_free_the_pages(mesh: Mesh) -> None:
    async def run():
        s = stub(mesh)
        call = s.Generate(gen_request([0, 7, 8, 9], temperature=0, max_tokens=4000, ignore_eos=True))
        async for _ in call:
            break
        mid = await s.GetLoads(generation_pb2.GetLoadsRequest())
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(s, gen_request([0, 7, 8, 9], temperature=0, max_tokens=4000, ignore_eos=True), timeout=1.0)
        deadline_code = e.value.code()
        for _ in range(50):
            load = (await s.GetLoads(generation_pb2.GetLoadsRequest())).replicas[0]
            if load.free_kv_pages == load.total_kv_pages and load.running_requests == 0:
                break
            await asyncio.sleep(0.1)
        return mid.replicas[0], load, deadline_code

    mid, after, code = asyncio.run(run())
    assert mid.free_kv_pages < mid.total_kv_pages
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after.free_kv_pages == after.total_kv_pages and after.running_requests == 0


def test_64_concurrent_streams_complete(mesh: Mesh) -> None:
    async def run():
        s = stub(mesh)
        reqs = [gen_request([0, 100 + i, 200 + i], temperature=0.9, seed=i, max_tokens=6) for i in range(64)]
        return await asyncio.gather(*[collect(s, r) for r in reqs])

    results = asyncio.run(run())
    assert all(len(toks) == 6 and msgs[-1].finished.usage.completion_tokens == 6 for msgs, toks, _ in results)


def test_worker_killed_mid_stream_ends_streams_with_unavailable(model_dir: Path, tmp_path: Path) -> None:
    """With migration off (and nothing restarting the worker) the stream ends with UNAVAILABLE at once; with it on,
    tests/serving/test_faults.py shows the stream going on elsewhere."""
    m = Mesh(model_dir, tmp_path, extra_env={"DEEPINFER_MIGRATION_LIMIT": "0"}).up()
    try:

        async def run():
            s = stub(m)
            call = s.Generate(gen_request([0, 3, 4], temperature=0, max_tokens=4000, ignore_eos=True))
            async for _ in call:
                break
            os.kill(m.procs["worker"].pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value.code(), time.monotonic() - t0

        code, waited = asyncio.run(run())
        assert code == grpc.StatusCode.UNAVAILABLE and waited < 2.0
        assert health_status(m.address("scheduler")) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        m.down()


def test_the_worker_freezes_its_start_up_heap(mesh: Mesh) -> None:
    """After its start-up the worker service moves the objects alive to the collector's permanent generation
    (``DEEPINFER_GC_FREEZE``, on by default; ``engine/heap.py``): torch's, the model's and the libraries' hundred
    thousand and more objects."""
    events = [json.loads(line) for line in mesh.log("worker").splitlines() if line.startswith("{")]
    frozen = [e for e in events if e.get("event") == "heap_frozen"]
    assert len(frozen) == 1 and frozen[0]["frozen"] > 100_000, frozen


def test_the_worker_builds_its_grammar_view_before_it_serves(mesh: Mesh) -> None:
    """The tokenizer's grammar view (about a second of Python) is ready before the worker listens: no step of the
    first requests shares the interpreter with it (``serving/grammar_view.py``)."""
    events = [json.loads(line)["event"] for line in mesh.log("worker").splitlines() if line.startswith("{")]
    assert "grammar_view_ready" in events and "listening" in events, events
    assert events.index("grammar_view_ready") < events.index("heap_frozen") < events.index("listening")


def test_the_balancer_and_the_scheduler_run_without_torch(mesh: Mesh) -> None:
    """Only the worker computes: the balancer and the scheduler, having served this module's requests, never loaded
    torch (a process start of about 2 s of CPU and 200 MB each, paid at every restart, for nothing)."""
    for name in ("balancer", "scheduler"):
        maps = Path(f"/proc/{mesh.procs[name].pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps, name
    assert "libtorch" in Path(f"/proc/{mesh.procs['worker'].pid}/maps").read_text()


def test_unknown_model_is_not_found(mesh: Mesh) -> None:
    async def run():
        req = gen_request([0, 1, 2], max_tokens=2)
        req.model = "deepseek-ai/not-this-one"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub(mesh), req)
        return e.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.NOT_FOUND and "model" in err.details()


def test_worker_replaces_its_model_only_while_no_scheduler_is_attached(tmp_path: Path) -> None:
    from deepinfer.v1 import worker_pb2, worker_pb2_grpc
    from serving.mesh import free_port, wait_serving

    first = make_tiny_model(tmp_path / "first", seed=1)
    second = make_tiny_model(tmp_path / "second", seed=2, overrides={"sliding_window": 16})
    m = Mesh(first, tmp_path, extra_env={"DEEPINFER_LOG_LEVEL": "info"})
    m.ports["worker"] = free_port()
    m.start("worker", ["services.worker_nvidia", "--model", str(first), "--port", str(m.ports["worker"]),
                       "--page-size", "16", "--num-pages", "32"])  # fmt: skip
    try:
        wait_serving(m.address("worker"))

        async def run():
            async with grpc.aio.insecure_channel(m.address("worker")) as ch:
                w = worker_pb2_grpc.WorkerStub(ch)
                before = await w.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
                step = w.Step()  # an attached scheduler blocks the swap
                await step.write(worker_pb2.StepPlan(step_id=1))
                await step.read()
                with pytest.raises(grpc.aio.AioRpcError) as busy:
                    await w.LoadModel(worker_pb2.LoadModelRequest(model=str(second)))
                await step.done_writing()
                while await step.read() != grpc.aio.EOF:
                    pass
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await w.LoadModel(worker_pb2.LoadModelRequest(model=str(tmp_path / "missing")))
                after = await w.LoadModel(worker_pb2.LoadModelRequest(model=str(second), num_pages=8))
                return before, busy.value, bad.value, after

        before, busy, bad, after = asyncio.run(run())
        assert before.model == str(first) and (before.num_pages, before.page_size) == (32, 16)
        assert busy.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in bad.details()
        assert after.model == str(second) and after.num_pages == 8
        # the heap thawed and frozen again around each load that ran (the failed one too), not the refused one
        events = [json.loads(line) for line in m.log("worker").splitlines() if line.startswith("{")]
        assert [e["event"] for e in events if e.get("event") == "heap_frozen"] == ["heap_frozen"] * 3
    finally:
        m.down()
