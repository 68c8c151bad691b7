"""The worker service's pipelined Step stream, through a real gRPC server on loopback and a grpcio client.

Plans that arrive while a step is still running are launched before that step's tokens are collected (the
placeholders of step N+1 read step N's samples on the device); results come back in order and carry the tokens of
the synchronous engine. A bad plan behind launched steps still lets those steps report before the stream ends
with INVALID_ARGUMENT. An accelerator is simulated on the CPU by a slower ``InFlight.wait`` and the platform saying
a launch queues the step; on the host itself, whose launch runs the step, a step is collected before the next
launch.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import grpc
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.factory import build_worker
from deepinfer.engine.interfaces import PLACEHOLDER, ChunkPlan, WorkerStepPlan
from deepinfer.engine.worker import InFlight
from deepinfer.rpc.convert import plan_to_proto, result_from_proto
from deepinfer.runtime.platform import Platform
from deepinfer.serving.server import Service, start_server
from deepinfer.serving.step_profiler import StepProfiler
from deepinfer.serving.worker import MAX_IN_FLIGHT, WorkerService
from deepinfer.v1 import worker_pb2_grpc

PROMPTS = [[0, 17, 4242, 99, 5, 6, 7], [3, 1000, 25, 7, 9]]
STEPS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_wp") / "m", seed=0)


def plans(bad_at: int | None = None) -> list[WorkerStepPlan]:
    out = [WorkerStepPlan(1, chunks=[ChunkPlan(f"r{i}", p, 0, [i], True, GREEDY) for i, p in enumerate(PROMPTS)])]
    for k in range(1, STEPS):
        rids = [f"r{i}" for i in range(len(PROMPTS))] + (["ghost"] if k == bad_at else [])
        out.append(WorkerStepPlan(k + 1, chunks=[
            ChunkPlan(rid, [PLACEHOLDER], len(PROMPTS[i]) + k - 1 if i < len(PROMPTS) else 0, [i], True, GREEDY)
            for i, rid in enumerate(rids)
        ]))  # fmt: skip
    return out


async def stream(
    parts, steps: list[WorkerStepPlan], service: WorkerService | None = None,
    hold: tuple[int, threading.Event] | None = None,
) -> tuple[list, grpc.StatusCode | None, str]:  # fmt: skip
    service = service if service is not None else WorkerService(parts, "w")
    running = await start_server(
        [Service("deepinfer.v1.Worker", service, worker_pb2_grpc.add_WorkerServicer_to_server)],
        "127.0.0.1",
        0,
    )
    results, code, details = [], None, ""
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            sent: set[str] = set()
            done = asyncio.Event()

            async def send():
                for k, p in enumerate(steps):  # all at once, as fast as the client can: the worker decides how far
                    if hold is not None and k == hold[0]:  # it runs ahead (``hold``: the rest once the event is set)
                        while not hold[1].is_set():
                            await asyncio.sleep(0.01)
                    yield plan_to_proto(p, sent)
                await done.wait()

            call = worker_pb2_grpc.WorkerStub(ch).Step(send())
            try:
                async for msg in call:
                    results.append(result_from_proto(msg))
                    if len(results) == len(steps):
                        break
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            done.set()
            call.cancel()
    finally:
        await running.server.stop(None)
    return results, code, details


def traced(parts, monkeypatch, busy: bool = True) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    runner = parts.runner
    launch, finish, wait = runner.launch, runner.finish, InFlight.wait

    def slow_wait(self):  # a device step takes a while: plans queued behind it must be launched meanwhile
        time.sleep(0.15)
        return wait(self)

    monkeypatch.setattr(runner, "launch", lambda plan: calls.append(("launch", plan.step_id)) or launch(plan))
    monkeypatch.setattr(runner, "finish", lambda s: calls.append(("finish", s.result.step_id)) or finish(s))
    if busy:  # an accelerator's: a launch queues the step (else the host's: the launch runs it)
        monkeypatch.setattr(InFlight, "wait", slow_wait)
        monkeypatch.setattr(Platform, "queues_steps", True)
    return calls


def test_steps_are_launched_ahead_and_give_the_engines_tokens(model_dir, monkeypatch) -> None:
    llm = LLM(model=model_dir, dtype="float32", num_pages=16, page_size=16, batch_invariant=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16, batch_invariant=True)
    calls = traced(parts, monkeypatch)
    results, code, _ = asyncio.run(stream(parts, plans()))
    assert code is None and [r.step_id for r in results] == list(range(1, STEPS + 1))
    got = [[r.results[i].token_id for r in results] for i in range(len(PROMPTS))]
    assert got == expected
    assert calls[:3] == [("launch", 1), ("launch", 2), ("launch", 3)]  # three in flight before the first collection
    assert sorted(calls) == sorted([(k, s) for s in range(1, STEPS + 1) for k in ("launch", "finish")])
    in_flight = [sum(+1 if k == "launch" else -1 for k, _ in calls[: i + 1]) for i in range(len(calls))]
    assert max(in_flight) == MAX_IN_FLIGHT  # plan 4 waits for room although it arrived at once


def test_a_ready_step_is_collected_before_the_next_launch_while_the_device_is_busy(model_dir, monkeypatch) -> None:
    """Step 1's tokens arrive and plans 3 and 4 come in while step 2's launch runs (a slow one); with step 2 still on
    the device, step 1 goes out first and the plans launch after it, instead of the tokens waiting behind them."""
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16, batch_invariant=True)
    calls = traced(parts, monkeypatch)
    traced_launch, launching_2 = parts.runner.launch, threading.Event()

    def launch(plan):
        if plan.step_id == 2:
            launching_2.set()
            time.sleep(1.0)  # meanwhile step 1's wait (0.15 s) ends and plans 3 and 4 arrive
        return traced_launch(plan)

    monkeypatch.setattr(parts.runner, "launch", launch)
    results, code, _ = asyncio.run(stream(parts, plans(), hold=(2, launching_2)))
    assert code is None and [r.step_id for r in results] == list(range(1, STEPS + 1))
    assert calls[:4] == [("launch", 1), ("launch", 2), ("finish", 1), ("launch", 3)], calls


def test_a_step_done_at_its_launch_is_collected_before_the_next_launch(model_dir, monkeypatch) -> None:
    """On the CPU a launch runs the step: its tokens are collected before the next step (a long prefill, say) takes
    the runner, instead of waiting behind it."""
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16)
    calls = traced(parts, monkeypatch, busy=False)
    results, code, _ = asyncio.run(stream(parts, plans()))
    assert code is None and [r.step_id for r in results] == list(range(1, STEPS + 1))
    assert calls == [(k, s) for s in range(1, STEPS + 1) for k in ("launch", "finish")]


def test_a_bad_plan_behind_launched_steps_ends_the_stream_after_their_results(model_dir, monkeypatch) -> None:
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16)
    traced(parts, monkeypatch)
    results, code, details = asyncio.run(stream(parts, plans(bad_at=2)))
    assert [r.step_id for r in results] == [1, 2]  # the steps launched before the bad plan still report
    assert all(s.token_id is not None for r in results for s in r.results)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "chunks.token_ids: request 'ghost'" in details
    assert parts.runner.states == {}  # the stream's requests were dropped


@pytest.mark.parametrize("where", ["finish", "wait"])
def test_a_failed_collection_ends_the_stream_and_no_later_step_is_collected(model_dir, monkeypatch, where) -> None:
    """Collecting step 2 fails (its result, or the wait for its tokens): step 1 reports, the stream ends with
    INTERNAL at once, steps 3 and 4 (launched behind it) are never collected, and the runner is left free."""
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16)
    calls = traced(parts, monkeypatch)
    if where == "finish":
        finish = parts.runner.finish

        def failing(step):
            if step.result.step_id == 2:
                raise RuntimeError("collection failed")
            return finish(step)

        monkeypatch.setattr(parts.runner, "finish", failing)
    else:
        wait = InFlight.wait

        def failing_wait(self):
            if self.result.step_id == 2:
                raise RuntimeError("collection failed")
            return wait(self)

        monkeypatch.setattr(InFlight, "wait", failing_wait)
    results, code, details = asyncio.run(stream(parts, plans()))
    assert [r.step_id for r in results] == [1]
    assert code == grpc.StatusCode.INTERNAL
    assert ("launch", 3) in calls and not any(k == "finish" and s > 2 for k, s in calls)
    assert parts.runner.states == {}  # the stream's requests were dropped: the runner was free again


def test_a_fault_of_the_step_loop_ends_the_stream_instead_of_hanging(model_dir, monkeypatch) -> None:
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16)
    traced(parts, monkeypatch)

    def broken(plan):
        raise RuntimeError("loop fault")

    monkeypatch.setattr(parts.runner, "waits_for_tokens", broken)
    results, code, _ = asyncio.run(asyncio.wait_for(stream(parts, plans()), 60))
    assert code == grpc.StatusCode.INTERNAL and len(results) <= 1


def test_the_worker_records_the_steps_asked_for(model_dir, tmp_path, monkeypatch) -> None:
    """``DEEPINFER_TORCH_PROFILER_DIR``: steps 1 and 2 of a stream of 4 recorded (``torch.profiler``), then written
    as a Chrome trace and a table of the operators; the steps' tokens are those of a stream without it, and a second
    stream records nothing more (once in a worker's life)."""
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16, batch_invariant=True)
    plain, _, _ = asyncio.run(stream(parts, plans()))
    monkeypatch.setenv("DEEPINFER_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("DEEPINFER_PROFILE_SKIP_STEPS", "1")
    monkeypatch.setenv("DEEPINFER_PROFILE_STEPS", "2")
    parts = build_worker(model_dir, "float32", "cpu", None, 16, 16, batch_invariant=True)
    service = WorkerService(parts, "w/0")
    results, code, _ = asyncio.run(stream(parts, plans(), service))
    assert code is None and [[s.token_id for s in r.results] for r in results] == [
        [s.token_id for s in r.results] for r in plain
    ]
    files = sorted(p.name for p in (tmp_path / "prof").iterdir())
    stem = f"w_0-{os.getpid()}-steps-1-2"  # (steps counted from 0, both ends)
    assert files == [f"{stem}.json", f"{stem}.txt"], files
    trace = json.loads((tmp_path / "prof" / f"{stem}.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert "aten::" in (tmp_path / "prof" / f"{stem}.txt").read_text()
    asyncio.run(stream(parts, plans(), service))
    assert len(list((tmp_path / "prof").iterdir())) == 2


def test_a_record_that_cannot_be_written_leaves_the_steps_alone(tmp_path) -> None:
    """The directory cannot be made (a file stands in its way): the record is given up and logged, the step
    thread gets no exception, and nothing more is recorded."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    prof = StepProfiler(blocker / "prof", 0, 1, "w")
    prof.before(3)
    torch.ones(4).sum()
    prof.after(3)  # the record ends here and cannot be written
    assert prof.done and prof.prof is None and prof.written == []
    prof.before(3)
    assert prof.prof is None
