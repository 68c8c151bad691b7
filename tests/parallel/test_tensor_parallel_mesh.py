"""A tensor-parallel worker served (``DEEPINFER_TP=2`` on ``services.worker_nvidia``, the cpu backend): the worker,
its follower rank (the other half of every layer's heads), the scheduler and the balancer as real processes on
loopback, driven by grpcio.

The worker has one data-parallel group, so its scheduler sees one rank (``WorkerInfo.world_size`` 1) and sends plain
plans, which both ranks run. Every request's tokens equal the single process's, its logprobs within fp32 rounding
(the heads' outputs are summed over the ranks); the worker refuses to load another model while serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.rpc.channel import open_channel
from deepinfer.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from parallel.test_ranked_mesh import BUDGET, generate, offline, requests
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tp_mesh") / "m", seed=4)


def test_a_tensor_parallel_worker_serves_what_one_process_computes(model_dir, tmp_path) -> None:
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_MAX_NUM_BATCHED_TOKENS": str(BUDGET)}
    mesh = Mesh(model_dir, tmp_path, extra_env=env, service_env={"worker": {"DEEPINFER_TP": "2"}}).up(num_pages=8)
    try:
        want = offline(model_dir)

        async def run() -> tuple:
            async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                got = await asyncio.gather(*(generate(stub, *r) for r in requests()[:3]))
            wch = open_channel(mesh.address("worker"))
            try:
                worker = worker_pb2_grpc.WorkerStub(wch)
                info = await worker.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as load:
                    await worker.LoadModel(worker_pb2.LoadModelRequest(model=info.model), timeout=30)
            finally:
                await wch.close()
            return got, info, load.value

        got, info, load = asyncio.run(run())
        assert len(got) == 3
        for (g_tok, g_lp), (w_tok, w_lp) in zip(got, want):
            assert g_tok == w_tok
            assert g_lp == pytest.approx(w_lp, abs=1e-4)
        assert info.world_size == 1 and info.determinism.requires["tensor_parallel_size"] == "2"
        assert load.code() == grpc.StatusCode.FAILED_PRECONDITION and "stream" in load.details()  # the scheduler's
    finally:
        mesh.down()
