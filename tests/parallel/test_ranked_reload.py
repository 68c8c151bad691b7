"""A worker of several ranks loads another model (``Worker.LoadModel``: ``parallel.launch.RankedWorker``): its ranks
stop and start afresh with the new model, rank 0's old model freed before the new one loads; a model that cannot
be found leaves the ranks running; one that fails to load brings the old model back, and the call fails with
INVALID_ARGUMENT. The worker (two ranks, the cpu backend, batch-invariant ops) runs as a real process driven over
gRPC, and each model's first token and logprob must be the single-process engine's."""

from __future__ import annotations

import asyncio
import shutil
import weakref
from pathlib import Path

import grpc
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.parallel import launch
from deepinfer.parallel.layout import Layout
from deepinfer.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving.mesh import Mesh, free_port, wait_serving

pytestmark = pytest.mark.timeout(600)
PROMPT = [(11 * j) % 300 + 4 for j in range(21)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ranked_reload")
    return make_tiny_model(root / "first", seed=1), make_tiny_model(root / "second", seed=2)


def offline(model: Path) -> tuple[int, float]:
    """The model's greedy first token after ``PROMPT`` and its logprob, one process."""
    with LLM(model=model, page_size=16, num_pages=16, batch_invariant=True) as llm:
        (out,) = llm.generate([{"prompt_token_ids": PROMPT}], [SamplingParams(temperature=0, max_tokens=1, logprobs=1)])
    c = out.outputs[0]
    return c.token_ids[0], c.logprobs[0][c.token_ids[0]]


async def first_token(worker: worker_pb2_grpc.WorkerStub, step: int) -> tuple[int, float]:
    """``PROMPT`` prefilled on rank 0 (rank 1 idle) in one step of a Step stream: its sample and logprob."""
    plan = worker_pb2.StepPlan(step_id=step)
    plan.ranks.add(step_id=step).chunks.add(
        request_id=f"r{step}", token_ids=PROMPT, start=0, block_table=[0, 1], sample=True,
        params=common_pb2.SamplingParams(temperature=0, max_tokens=1, logprobs=1),
    )  # fmt: skip
    plan.ranks.add(step_id=step)
    call = worker.Step()
    await call.write(plan)
    got = await call.read()
    await call.done_writing()
    while await call.read() != grpc.aio.EOF:
        pass
    (r,) = got.results
    return r.token_id, r.logprob.logprob


def test_a_worker_of_two_ranks_loads_another_model(models: tuple[Path, Path], tmp_path: Path) -> None:
    first, second = models
    broken = tmp_path / "broken"  # a config and no weights: found, then fails to load
    broken.mkdir()
    shutil.copy(second / "config.json", broken / "config.json")
    want_first, want_second = offline(first), offline(second)
    assert want_first[1] != want_second[1]  # (the models tell apart)
    m = Mesh(first, tmp_path, extra_env={"DEEPINFER_EP": "2", "DEEPINFER_BATCH_INVARIANT": "1"})
    m.ports["worker"] = free_port()
    m.start("worker", ["services.worker_nvidia", "--model", str(first), "--port", str(m.ports["worker"]),
                       "--page-size", "16", "--num-pages", "16"])  # fmt: skip
    try:
        wait_serving(m.address("worker"), proc=m.procs["worker"])

        async def run() -> tuple:
            async with grpc.aio.insecure_channel(m.address("worker")) as ch:
                w = worker_pb2_grpc.WorkerStub(ch)
                before = await first_token(w, 1)
                errors = []
                for bad in (tmp_path / "missing", broken):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await w.LoadModel(worker_pb2.LoadModelRequest(model=str(bad)), timeout=300)
                    info = await w.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
                    errors.append((e.value, info.model, await first_token(w, 2 + len(errors))))
                after = await w.LoadModel(worker_pb2.LoadModelRequest(model=str(second), num_pages=8), timeout=300)
                return before, errors, after, await first_token(w, 9)

        before, errors, after, token = asyncio.run(run())
    finally:
        m.down()
    assert before == pytest.approx(want_first, abs=1e-6)
    for err, model, again in errors:  # the old model serves on: kept (missing), started again (broken)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in err.details()
        assert model == str(first) and again == pytest.approx(want_first, abs=1e-6)
    assert (after.model, after.num_pages, after.world_size) == (str(second), 8, 2)
    assert token == pytest.approx(want_second, abs=1e-6)


def test_rank_zeros_model_is_freed_before_the_next_one_loads(models: tuple[Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    first, second = models
    build = dict(model=str(first), dtype="float32", page_size=16, num_pages=16)
    parts, procs = launch.start_worker(Layout(2), "cpu", **build)
    ranked = launch.RankedWorker(Layout(2), "cpu", build, procs)
    held, old = [parts], weakref.ref(parts.model)
    del parts
    freed, start = [], launch.start_worker

    def start_after(*a, **k):  # noqa: ANN202 - start_worker's
        freed.append(old() is None)
        return start(*a, **k)

    monkeypatch.setattr(launch, "start_worker", start_after)
    try:
        new, failed = ranked.reload(lambda: held.pop().runner, {**build, "model": str(second)})
    except BaseException:
        ranked.procs.close(held[0].runner if held else None)
        raise
    try:
        assert failed is None and freed == [True]
        assert new.path == second and ranked.build["model"] == str(second)
    finally:
        ranked.procs.close(new.runner)
