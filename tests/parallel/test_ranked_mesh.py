"""A worker of two ranks served (``DEEPINFER_EP=2`` on ``services.worker_nvidia``, the cpu backend; speculative
decoding with 2 MTP drafts, the MoE exchanges of small steps through fixed buffers): the worker, its follower rank,
the scheduler and the balancer as real processes on loopback, driven by grpcio and the ``openai`` client.

The scheduler learns the worker's ranks from ``WorkerInfo.world_size`` and plans each rank's step
(``engine.data_parallel``, on the wire ``StepPlan.ranks``). With the batch-invariant ops every request's tokens and
logprobs must equal the single-process engine's, with few pages a rank (preemptions), chunked prefill, steps that
mix prefill and decode, a prefix-cache hit, greedy and seeded sampling, concurrent requests. A plan that does not
name the worker's ranks is refused (INVALID_ARGUMENT), and the worker serves on; a dead follower rank ends the
worker instead of leaving it half alive."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import grpc
import openai
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.events import EventBus, NatsServer
from deepinfer.events.experts import ExpertLoadView
from deepinfer.rpc.channel import open_channel
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(600)
SHARED = list(range(40, 80))
BUDGET, PAGES = 24, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_ranked_mesh") / "m", seed=4)


@pytest.fixture(scope="module")
def nats():
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def mesh(model_dir, nats, tmp_path_factory: pytest.TempPathFactory):
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_MAX_NUM_BATCHED_TOKENS": str(BUDGET)}
    worker = {"DEEPINFER_EP": "2", "DEEPINFER_EPLB_INTERVAL_STEPS": "4", "DEEPINFER_EXPERT_LOAD_REPORT_PERIOD_S": "0.2",
              "DEEPINFER_USE_NEXTN_DECODE": "2", "DEEPINFER_EP_FIXED_BUFFER_TOKENS": "8"}  # fmt: skip
    m = Mesh(model_dir, tmp_path_factory.mktemp("ranked_logs"), nats_url=nats.url, extra_env=env,
             service_env={"worker": worker, "scheduler": {"DEEPINFER_SPEC_DECODE_EXPLORE_STEPS": "0"}})  # fmt: skip
    try:
        yield m.up(num_pages=PAGES)
    finally:
        m.down()


def requests() -> list[tuple[list[int], dict]]:
    out = []
    for i in range(6):
        ids = SHARED + list(range(5, 7 + i)) if i % 3 == 0 else [(13 * i + 5 * j) % 400 + 3 for j in range(6 + 6 * i)]
        sampling = (dict(temperature=0.0, max_tokens=8 + i, logprobs=2) if i % 2 == 0 else
                    dict(temperature=0.9, top_p=0.9, seed=50 + i, max_tokens=10, logprobs=1))  # fmt: skip
        out.append((ids, sampling))
    return out


def offline(model_dir) -> list[tuple]:
    llm = LLM(model=model_dir, page_size=16, num_pages=64, batch_invariant=True, max_num_batched_tokens=BUDGET)
    reqs = requests()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs],
                        [SamplingParams(ignore_eos=True, **s) for _, s in reqs])  # fmt: skip
    return [(tuple(o.outputs[0].token_ids), tuple(lp[t] for lp, t in zip(o.outputs[0].logprobs,
             o.outputs[0].token_ids))) for o in outs]  # fmt: skip


def counter(metrics: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name + "_total"))


async def generate(stub: generation_pb2_grpc.GenerationStub, ids: list[int], sampling: dict) -> tuple:
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids),
                                         sampling=common_pb2.SamplingParams(ignore_eos=True, **sampling))  # fmt: skip
    msgs = [m async for m in stub.Generate(req, timeout=300)]
    return tuple(t for m in msgs for t in m.token_ids), tuple(lp.logprob for m in msgs for lp in m.logprobs)


def test_two_ranks_serve_what_one_process_computes(mesh: Mesh, nats, model_dir) -> None:
    """EPLB runs every fourth step: the experts move between the ranks while the requests run, each rank's expert
    loads go out on NATS, and the outputs stay the single process's."""
    want = offline(model_dir)

    async def run() -> tuple:
        async with EventBus(name="eplb-view") as bus, grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            await bus.connect(nats.url)
            view = ExpertLoadView(bus, window_s=600.0)
            await view.start()
            stub = generation_pb2_grpc.GenerationStub(ch)
            reqs = requests()
            first = await generate(stub, *reqs[0])  # its prompt then is a resume point for requests 3 (a hit)
            rest = await asyncio.gather(*(generate(stub, *r) for r in reqs[1:]))
            loads = (await stub.GetLoads(generation_pb2.GetLoadsRequest())).replicas
            for _ in range(600):  # the ranks' reports (every 0.2 s) of the loads gathered so far
                if any(all(v.sum() > 0 for v in view.loads(r).values()) and view.loads(r) for r in view.replicas()):
                    break
                await asyncio.sleep(0.05)
            return [first, *rest], loads, view

    got, loads, view = asyncio.run(run())
    for (g_tok, g_lp), (w_tok, w_lp) in zip(got, want):
        assert g_tok == w_tok
        assert g_lp == pytest.approx(w_lp, abs=1e-5)
    assert loads[0].total_kv_pages == 2 * PAGES  # both ranks' pages
    scheduler, worker = (urllib.request.urlopen(mesh.metrics_url(n)).read().decode() for n in ("scheduler", "worker"))
    assert counter(scheduler, "vllm:prefix_cache_hits") > 0 and counter(scheduler, "vllm:num_preemptions") > 0
    assert counter(worker, "deepinfer_eplb_layers_moved") > 0
    assert counter(scheduler, "vllm:spec_decode_num_draft_tokens") > 0  # the MTP block's drafts, verified on the ranks
    (replica,) = view.replicas()  # the worker's reports, on deepinfer.experts.<its instance id>
    assert replica.startswith("worker-") and view.loads(replica)
    assert all(v.sum() > 0 for v in view.loads(replica).values())
    client = openai.OpenAI(base_url=mesh.http_url() + "/v1", api_key="x")
    ids, sampling = requests()[2]
    name = client.models.list().data[0].id
    out = client.completions.create(model=name, prompt=ids, max_tokens=sampling["max_tokens"], temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text and out.usage.completion_tokens == len(want[2][0])


def test_the_worker_reports_its_ranks_and_refuses_plans_of_other_ranks(mesh: Mesh) -> None:
    async def run() -> tuple:
        ch = open_channel(mesh.address("worker"))
        try:
            stub = worker_pb2_grpc.WorkerStub(ch)
            info = await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=30)
            plain = worker_pb2.StepPlan(step_id=1)
            plain.chunks.add(request_id="x", token_ids=[5, 6], start=0, block_table=[0], sample=True,
                             params=common_pb2.SamplingParams(max_tokens=1))  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Step(iter([plain]), timeout=60):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as load:
                await stub.LoadModel(worker_pb2.LoadModelRequest(model=info.model), timeout=30)
            return info, e.value, load.value
        finally:
            await ch.close()

    info, refused, load = asyncio.run(run())
    assert info.world_size == 2 and info.rank == 0
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "ranks" in refused.details()
    assert load.code() == grpc.StatusCode.FAILED_PRECONDITION and "stream" in load.details()  # the scheduler's
    assert mesh.procs["worker"].poll() is None  # it serves on


def test_a_dead_follower_rank_ends_the_worker(mesh: Mesh) -> None:
    """(Last: it takes the worker down.) The follower killed, the next step fails on rank 0, and the worker exits
    (its supervisor, ``deepinfer up``, starts it afresh with all its ranks) instead of failing every step."""
    worker = mesh.procs["worker"]
    children = open(f"/proc/{worker.pid}/task/{worker.pid}/children").read().split()
    assert len(children) == 1  # the follower rank
    os.kill(int(children[0]), signal.SIGKILL)

    async def run() -> None:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.aio.AioRpcError):
                await generate(stub, [5, 6, 7], dict(temperature=0.0, max_tokens=4))

    asyncio.run(run())
    assert worker.wait(timeout=120) is not None
    assert "rank_group_broken" in mesh.log("worker")


def test_up_gives_each_replica_its_own_devices(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``deepinfer up --ep 2``'s workers: each of two ranks (the flag passed on), on devices of its own."""
    from deepinfer.launcher import Mesh as Launched

    args, dial = Launched(tmp_path, ranks=2).worker_args(1, 5000, tmp_path)
    assert args[args.index("--ep") + 1] == "2" and dial == f"unix:{tmp_path}/worker-1.sock"
    args, _ = Launched(tmp_path, ranks=4, tp=2).worker_args(0, 5000, None)
    assert args[args.index("--ep") + 1] == "4" and args[args.index("--tp") + 1] == "2"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    mesh = Launched(tmp_path, replicas=2, ranks=2, accelerator="nvidia")
    assert [mesh._devices(r) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # fewer devices than ranks: they share the one there is
    assert Launched(tmp_path, replicas=2, ranks=2, accelerator="nvidia")._devices(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1,2")
    ascend = Launched(tmp_path, replicas=3, ranks=1, accelerator="ascend")
    assert [ascend._devices(r) for r in range(3)] == [{"ASCEND_RT_VISIBLE_DEVICES": str(i)} for i in range(3)]
    assert Launched(tmp_path, replicas=2, ranks=2, accelerator="cpu")._devices(1) == {}
