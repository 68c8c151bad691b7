"""Admission under a burst: how soon a full balancer refuses each of N simultaneous requests, HTTP and gRPC apart.

    PYTHONPATH=libs:. python bench/serving/admission.py [--burst 2000] [--clients 4] [--out result.json]
    # the smoke mode CI runs (a 200-request burst)
    PYTHONPATH=libs:. python bench/serving/admission.py --tiny --device cpu

A real balancer process (``python -m services.balancer``) stands in front of one replica whose every place is taken
(a held scheduler in this process: it reports ``max_running=1, max_queued=0`` and keeps the one admitted request
open, computing nothing, so the machine's cores go to the balancer and the clients, as in a deployment where the
model runs on accelerators). Then ``--burst`` requests arrive at once, spread over ``--clients`` client processes
that start together: HTTP as bare HTTP/1.1 connections (one request each), gRPC as calls multiplexed over one
channel per client process. Each must be refused with 429 + ``Retry-After`` / RESOURCE_EXHAUSTED.

Measured, per front end:

* the refusal latency: from the moment a request was written to the socket (it has arrived: the kernel holds it for
  the server) until its refusal came back, seen by the client (p50 / p99 / max);
* the balancer's CPU time per refusal (its ``/proc`` user + system time over the burst, divided by the requests),
  and the floor it sets: N refusals on one event loop cannot all be answered before N x that CPU time;
* the peer, measured in the same run with the same clients: the bare stack (a uvicorn app whose only route returns
  429, a ``grpc.aio`` server whose only method aborts with RESOURCE_EXHAUSTED), the least any Python server on
  these libraries can spend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from datetime import date
from pathlib import Path

import grpc

from bench.harness import ROOT, command_line, git_commit, write_json

CHANNEL_OPTIONS = [("grpc.max_concurrent_streams", 1 << 20)]


# -- the servers ----------------------------------------------------------------------------------------
class HeldScheduler:
    """A replica with one place, taken by the first request, which it holds (computing nothing) until its caller
    goes; it answers health and load as a scheduler does."""

    def __init__(self) -> None:
        from deepinfer.v1 import scheduler_pb2_grpc

        self.submits = 0
        self.servicer = type(
            "Held",
            (scheduler_pb2_grpc.SchedulerServicer,),
            {"GetLoad": self._get_load, "Submit": self._submit},
        )()

    def _get_load(self, request, context):
        from deepinfer.v1 import common_pb2

        return common_pb2.ReplicaLoad(max_running=1, max_queued=0, running_requests=min(self.submits, 1))

    def _submit(self, request, context):
        self.submits += 1
        while context.is_active():
            time.sleep(0.05)
        yield from ()

    def serve(self) -> tuple[grpc.Server, int]:
        from grpc_health.v1 import health, health_pb2_grpc

        from deepinfer.v1 import scheduler_pb2_grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, port


def bare_servers(http_port: int, grpc_port: int) -> None:
    """The peer: the same two stacks with nothing in them but the refusal (run as its own process)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from deepinfer.v1 import generation_pb2_grpc

    async def refuse(request):
        return JSONResponse({"error": {"message": "full", "type": "rate_limit_error"}}, 429, {"Retry-After": "1"})

    class Refuser(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request, context):  # noqa: N802
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
            yield  # pragma: no cover - a streaming method

    async def main() -> None:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(Refuser(), server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        app = Starlette(routes=[Route("/v1/completions", refuse, methods=["POST"])])
        config = uvicorn.Config(app, "127.0.0.1", http_port, log_level="warning", access_log=False, lifespan="off")
        await uvicorn.Server(config).serve()

    asyncio.run(main())


# -- the clients ----------------------------------------------------------------------------------------
async def http_one(port: int, body: bytes) -> tuple[int, float, bool]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    sent = time.monotonic()
    status_line = await reader.readline()
    took = time.monotonic() - sent
    rest = (await reader.read()).lower()
    writer.close()
    return int(status_line.split()[1]), took, b"\r\nretry-after: 1\r\n" in b"\r\n" + rest


async def grpc_burst(address: str, n: int) -> list[tuple[int, float, bool]]:
    from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    req = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[0, 5, 6]), sampling=common_pb2.SamplingParams(max_tokens=8)
    )
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one() -> tuple[int, float, bool]:
            sent = time.monotonic()
            try:
                async for _ in stub.Generate(req, timeout=120):
                    pass
                return 0, time.monotonic() - sent, False
            except grpc.aio.AioRpcError as e:
                refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return e.code().value[0], time.monotonic() - sent, refused

        return await asyncio.gather(*(one() for _ in range(n)))


def client(kind: str, target: str, n: int, start_at: float, out: mp.Queue) -> None:
    """One client process: waits for the common start, then sends its ``n`` requests at once."""

    async def run() -> list[tuple[int, float, bool]]:
        if kind == "grpc":
            burst = grpc_burst(target, n)  # the channel connects before the start
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await burst
        await asyncio.sleep(max(0.0, start_at - time.time()))
        body = json.dumps({"prompt": "Hello there", "max_tokens": 8}).encode()
        return await asyncio.gather(*(http_one(int(target), body) for _ in range(n)))

    out.put(asyncio.run(run()))


def burst(kind: str, target: str, total: int, clients: int, pid: int) -> dict:
    """``total`` requests from ``clients`` processes at once; the latencies and the server's CPU per request."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0 + 0.3 * clients  # spawned interpreters import first
    shares = [total // clients + (i < total % clients) for i in range(clients)]
    procs = [ctx.Process(target=client, args=(kind, target, n, start_at, out)) for n in shares if n]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at - time.time() - 0.2))
    cpu0 = cpu_seconds(pid)
    results = [r for _ in procs for r in out.get(timeout=600)]
    cpu = cpu_seconds(pid) - cpu0
    for p in procs:
        p.join(timeout=30)
    refused = sorted(t for code, t, ok in results if ok)
    other: dict[str, int] = {}
    for code, _, ok in results:
        if not ok:
            other[str(code)] = other.get(str(code), 0) + 1
    return {
        "requests": total,
        "refused": len(refused),
        "not_refused": other,
        "p50_ms": 1e3 * statistics.median(refused) if refused else None,
        "p99_ms": 1e3 * refused[int(0.99 * (len(refused) - 1))] if refused else None,
        "max_ms": 1e3 * refused[-1] if refused else None,
        "within_50ms": sum(t <= 0.05 for t in refused),
        "server_cpu_us_per_request": 1e6 * cpu / total,
        "one_core_floor_ms": 1e3 * cpu,
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# -- the run --------------------------------------------------------------------------------------------
def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    import socket

    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} never listened on {port}")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    e.update(PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]), DEEPINFER_LOG_LEVEL="warning")
    e["DEEPINFER_MIGRATION_LIMIT"] = "0"
    return e


async def hold_the_place(address: str, held: HeldScheduler) -> grpc.aio.Channel:
    """The one request that takes the replica's place (kept open until the channel closes)."""
    from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    req = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[0, 1, 2]), sampling=common_pb2.SamplingParams(max_tokens=8)
    )
    for _ in range(300):  # until the balancer has learned the replica's capacity and admitted exactly this one
        call = stub.Generate(req)
        task = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.2)
        if held.submits >= 1 and not task.done():
            channel._held = (call, task)  # noqa: SLF001 - kept alive with the channel
            return channel
        call.cancel()
    raise RuntimeError("the balancer never admitted the holding request")


async def probe_full(address: str) -> bool:
    """Whether the balancer's gate is closed (a fresh call is refused with RESOURCE_EXHAUSTED)."""
    res = await grpc_burst(address, 1)
    return res[0][2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    from deepinfer.checkpoint.tiny import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_admission_"))
    model = make_tiny_model(tmp / "model", seed=0)
    held = HeldScheduler()
    sched, sched_port = held.serve()
    ports = {k: free_port() for k in ("grpc", "http", "bare_grpc", "bare_http")}
    log = open(tmp / "balancer.log", "w")  # noqa: SIM115 - open for the run
    balancer = subprocess.Popen(
        [sys.executable, "-m", "services.balancer", "--model", str(model), "--scheduler", f"127.0.0.1:{sched_port}",
         "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"])],
        cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    bare = ctx.Process(target=bare_servers, args=(ports["bare_http"], ports["bare_grpc"]), daemon=True)
    bare.start()
    result: dict = {"date": date.today().isoformat(), "burst": args.burst, "clients": args.clients,
                    "cpus": os.cpu_count(), "ours": {}, "bare": {}}  # fmt: skip
    try:
        wait_port(ports["http"], balancer, "the balancer")
        wait_port(ports["bare_http"], balancer, "the bare servers")
        address = f"127.0.0.1:{ports['grpc']}"

        async def hold():
            channel = await hold_the_place(address, held)
            if not await probe_full(address):
                raise RuntimeError("the gate is open with its one place taken")
            return channel

        loop = asyncio.new_event_loop()
        channel = loop.run_until_complete(hold())
        for kind, target in (("http", str(ports["http"])), ("grpc", address)):
            result["ours"][kind] = burst(kind, target, args.burst, args.clients, balancer.pid)
        for kind, target in (("http", str(ports["bare_http"])), ("grpc", f"127.0.0.1:{ports['bare_grpc']}")):
            result["bare"][kind] = burst(kind, target, args.burst, args.clients, bare.pid)
        result["replica_submits"] = held.submits  # 1: every refusal stayed in the balancer
        loop.run_until_complete(channel.close())
    finally:
        balancer.send_signal(signal.SIGTERM)
        bare.kill()
        try:
            balancer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            balancer.kill()
        sched.stop(0)
    return result


def report(result: dict) -> str:
    lines = [
        f"Admission burst, {result['date']}: {result['burst']} simultaneous requests from {result['clients']} client "
        f"processes on {result['cpus']} CPUs; the replica's one place taken; {result['replica_submits']} reached it.",
        "",
        "| front end | server | refused | p50 ms | p99 ms | max ms | within 50 ms | server CPU us/req "
        "| one-core floor ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("http", "grpc"):
        for who in ("ours", "bare"):
            r = result[who][kind]
            name = "deepinfer balancer" if who == "ours" else "bare stack (peer)"
            lines.append(
                f"| {kind} | {name} | {r['refused']}/{r['requests']} {r['not_refused'] or ''} | {r['p50_ms']:.0f} | "
                f"{r['p99_ms']:.0f} | {r['max_ms']:.0f} | {r['within_50ms']} | "
                f"{r['server_cpu_us_per_request']:.0f} | {r['one_core_floor_ms']:.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--burst", type=int, default=2000)
    p.add_argument("--clients", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--tiny", action="store_true", help="the smoke mode: a 200-request burst from 2 clients")
    p.add_argument("--device", default="cpu", help="only cpu: admission runs on the host")
    p.add_argument("--out", type=Path, help="write the result as DIR/<date>-admission-cpu.json")
    args = p.parse_args()
    if args.tiny:
        args.burst, args.clients = 200, 2
    result = run(args)
    print(report(result))
    if args.out:
        result.update(command=command_line(), git=git_commit())
        write_json(args.out / f"{result['date']}-admission-cpu.json", result)
    ok = all(result[w][k]["refused"] == result[w][k]["requests"] for w in ("ours", "bare") for k in ("http", "grpc"))
    return 0 if ok and result["replica_submits"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
