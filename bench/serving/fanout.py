"""What a step's tokens cost between the scheduler and the balancer: a ``Submit`` call per request (the peer) against
one ``Session`` stream for all of them (ours).

    PYTHONPATH=libs:. python bench/serving/fanout.py --out bench/results/serving
    PYTHONPATH=libs:. python bench/serving/fanout.py --tiny --device cpu          # smoke mode

A server process (the scheduler's side: a gRPC server as every service starts it, with the internal token checked)
holds ``n`` requests and runs ``--steps`` steps, one every ``--interval-ms`` (a device step's time), each giving every
request one token event; the engine is left out, so what is timed is the delivery alone. On the session path the
events go through ``services.scheduler.session.SchedulerSession`` and come out of
``services.balancer.session_client.SessionClient``, as in the mesh; on the Submit path each request has its own call
(its events through an ``asyncio.Queue``, as ``SchedulerService.Submit`` reads them) read by the stub, as the balancer
did before. Per ``n`` and path: the CPU both processes spend per step (ms; at 1.0 ms a step the host time a 1 ms
device step leaves for planning is gone), and how long a step's last event takes to reach the client (p50 / p99, ms:
it grows without bound once delivery cannot keep up with the steps). The roofline: encoding and decoding one step's
events as one protobuf message in this process, the least any transport does. Each cell runs ``--repeats`` times
(3), the two paths alternating so that a noisy minute hits both; the tables give medians, the JSON every run.

A second table times the scheduler <-> worker step exchange's own conversions per step (``deepinfer.rpc.convert``:
the plan to and from the wire, the result to and from it) at ``n`` decode rows, beside the encoding and decoding of
both messages alone.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import command_line, git_commit, pct, write_json
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.healthcheck import free_port
from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

LENGTH = common_pb2.FINISH_REASON_LENGTH


def _cpu() -> float:
    return time.process_time()  # (all of the process's threads: gRPC's own included)


class _Server(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's side: requests admitted as they arrive; once ``n`` are open, the steps run."""

    def __init__(self, n: int, steps: int, interval_s: float) -> None:
        self.n, self.steps, self.interval_s = n, steps, interval_s
        self.sinks: dict[str, Any] = {}
        self.all_open = asyncio.Event()
        self.stamps: list[float] = []  # when each step's events were handed over (CLOCK_MONOTONIC, as the client's)
        self.cpu0 = 0.0

    # the ``Streams`` a session needs (SchedulerService's open / last / close, without an engine)
    async def open(self, request: scheduler_pb2.SubmitRequest, parent: object, sink: Any) -> tuple[None, None]:
        self.sinks[request.request_id] = sink
        if len(self.sinks) == self.n:
            self.all_open.set()
        return None, None

    def last(self, ev: Any, trace_: None) -> tuple[bool, str] | None:
        return (True, "finished") if isinstance(ev, BaseException) or ev.finish_reason else None

    def close(self, rid: str, *_: Any) -> None:
        self.sinks.pop(rid, None)

    async def Submit(self, request, context):  # noqa: N802
        q: asyncio.Queue = asyncio.Queue()
        await self.open(request, None, q)
        while True:
            ev = await q.get()
            yield ev
            if ev.finish_reason:
                return

    async def Session(self, requests, context):  # noqa: N802
        from services.scheduler.session import SchedulerSession

        session = SchedulerSession(self)
        reader = asyncio.ensure_future(session.read(requests))
        try:
            async for msg in session.batches():
                yield msg
        finally:
            reader.cancel()
            session.close()

    async def run_steps(self) -> None:
        await self.all_open.wait()
        sinks, loop = list(self.sinks.items()), asyncio.get_running_loop()
        cpu0, start = _cpu(), loop.time()
        for s in range(self.steps):
            await asyncio.sleep(max(0.0, start + s * self.interval_s - loop.time()))
            finish = LENGTH if s == self.steps - 1 else 0
            for rid, sink in sinks:
                sink.put_nowait(scheduler_pb2.TokenEvent(request_id=rid, token_ids=[s], finish_reason=finish))
            self.stamps.append(time.monotonic())
        self.cpu0 = cpu0


def _serve(port: int, n: int, steps: int, interval_s: float, conn: Any) -> None:
    from deepinfer.serving.server import Service, start_server
    from deepinfer.telemetry import configure_logging

    configure_logging()

    async def main() -> None:
        server = _Server(n, steps, interval_s)
        svc = Service("deepinfer.v1.Scheduler", server, scheduler_pb2_grpc.add_SchedulerServicer_to_server)
        running = await start_server([svc], "127.0.0.1", port)
        conn.send("ready")
        await server.run_steps()
        await asyncio.to_thread(conn.recv)  # the client has every event: the writes are over
        conn.send((server.stamps, _cpu() - server.cpu0))
        await running.server.stop(None)

    asyncio.run(main())


async def _client(port: int, n: int, path: str) -> tuple[list[float], float]:
    """Each step's arrival (its last event at the client) and the client's CPU seconds over the run."""
    from services.balancer.session_client import SessionClient

    channel = open_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    client = SessionClient(stub, f"127.0.0.1:{port}")
    arrived: dict[int, float] = {}
    cpu0 = _cpu()

    async def one(i: int) -> None:
        req = scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=[0, i])
        call = client.submit(req) if path == "session" else stub.Submit(req)
        async for ev in call:
            now = time.monotonic()
            for s in ev.token_ids:  # (a session's caller that fell behind takes what waits as one event)
                arrived[s] = now

    await asyncio.gather(*(one(i) for i in range(n)))
    cpu = _cpu() - cpu0
    await client.close()
    await channel.close()
    return [arrived[s] for s in sorted(arrived)], cpu


def measure(n: int, path: str, steps: int, interval_s: float) -> dict[str, float]:
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(port, n, steps, interval_s, child), daemon=True)
    proc.start()
    try:
        assert parent.recv() == "ready"
        arrived, client_cpu = asyncio.run(_client(port, n, path))
        parent.send("done")
        stamps, server_cpu = parent.recv()
    finally:
        proc.join(timeout=10)
        proc.kill()
    if len(arrived) != steps or len(stamps) != steps:
        raise RuntimeError(f"{path}, {n} requests: {len(arrived)} of {steps} steps arrived")
    lag = [(a - s) * 1e3 for a, s in zip(arrived, stamps)]
    return {"server_cpu_ms_per_step": 1e3 * server_cpu / steps, "client_cpu_ms_per_step": 1e3 * client_cpu / steps,
            "lag_p50_ms": pct(lag, 0.5), "lag_p99_ms": pct(lag, 0.99)}  # fmt: skip


def roofline_ms(n: int, repeats: int = 200) -> float:
    """Encode and decode one step's ``n`` events as one message (ms)."""
    msg = scheduler_pb2.SessionEvents(items=[
        scheduler_pb2.SessionItem(event=scheduler_pb2.TokenEvent(request_id=f"r{i}", token_ids=[7])) for i in range(n)
    ])  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(repeats):
        scheduler_pb2.SessionEvents.FromString(msg.SerializeToString())
    return (time.perf_counter() - t0) / repeats * 1e3


def conversions_us(n: int, repeats: int = 300) -> dict[str, float]:
    """The step exchange's own per-step conversions at ``n`` decode rows (µs): the scheduler's plan to the wire and
    result from it, the worker's plan from the wire and result to it; ``wire``: encoding and decoding both messages
    (protobuf's C code alone: the floor of any conversion)."""
    from deepinfer.engine.interfaces import ChunkPlan, SeqResult, StepResult, WorkerStepPlan
    from deepinfer.rpc.convert import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.v1 import worker_pb2

    p = SamplingParams(temperature=0)
    plan = WorkerStepPlan(1, [ChunkPlan(f"req-{i:032x}", [-1], 600 + i, list(range(5 * i, 5 * i + 5)), True, p)
                              for i in range(n)])  # fmt: skip
    sent, known = {c.request_id for c in plan.chunks}, {c.request_id: p for c in plan.chunks}
    result = StepResult(1, [SeqResult(c.request_id, 1234, -0.5) for c in plan.chunks])
    plan_msg, result_msg = plan_to_proto(plan, sent), result_to_proto(result)

    def wire() -> None:
        worker_pb2.StepPlan.FromString(plan_msg.SerializeToString())
        worker_pb2.StepResult.FromString(result_msg.SerializeToString())

    fns = {"plan_to_proto": lambda: plan_to_proto(plan, sent),
           "plan_from_proto": lambda: plan_from_proto(plan_msg, known),
           "result_to_proto": lambda: result_to_proto(result),
           "result_from_proto": lambda: result_from_proto(result_msg), "wire": wire}  # fmt: skip
    out = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 1 and 8 requests, 20 steps")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(host work only: the device is unused)")
    ap.add_argument("--requests", default="1,16,64,256", help="comma-separated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--interval-ms", type=float, default=5.0, help="one step every this many ms")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each cell, paths alternating; medians reported")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.tiny:
        args.requests, args.steps, args.repeats = "1,8", 20, 1
    os.environ.setdefault("DEEPINFER_INTERNAL_TOKEN", secrets.token_hex(16))  # both ends: as in the mesh
    os.environ.setdefault("DEEPINFER_LOG_LEVEL", "warning")
    rows = []
    for n in [int(x) for x in args.requests.split(",")]:
        row: dict[str, Any] = {"n": n, "roofline_ms": roofline_ms(n)}
        runs: dict[str, list[dict[str, float]]] = {"submit": [], "session": []}
        convs = []
        for _ in range(args.repeats):  # the two paths alternate, so that a noisy minute hits both
            for path in runs:
                runs[path].append(measure(n, path, args.steps, args.interval_ms / 1e3))
            convs.append(conversions_us(n))
        for path, rs in runs.items():
            row[path] = {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"runs": rs}
        row["conversions_us"] = {k: statistics.median(c[k] for c in convs) for k in convs[0]}
        rows.append(row)
    print(
        f"one step every {args.interval_ms} ms, {args.steps} steps, medians of {args.repeats} runs; CPU ms per step "
        "(scheduler side + balancer side); lag: a step's last event from handed over to received"
    )
    print("| requests | roofline ms | Submit calls: CPU ms | lag p50 / p99 ms | Session: CPU ms | lag p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        a, b = r["submit"], r["session"]
        cells = [f"{r['n']}", f"{r['roofline_ms']:.3f}"]
        for m in (a, b):
            cells += [f"{m['server_cpu_ms_per_step']:.2f} + {m['client_cpu_ms_per_step']:.2f}",
                      f"{m['lag_p50_ms']:.2f} / {m['lag_p99_ms']:.2f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print("\nThe scheduler <-> worker step exchange's conversions per step (µs; wire: encoding and decoding both)")
    print("| rows | plan_to_proto | plan_from_proto | result_to_proto | result_from_proto | wire |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["conversions_us"]
        print(f"| {r['n']} | " + " | ".join(f"{c[k]:.0f}" for k in c) + " |")
    if args.out:
        res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(),
               "host_cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "out"},
               "rows": rows}  # fmt: skip
        write_json(args.out / f"{res['date']}-fanout.json", res)


if __name__ == "__main__":
    main()
