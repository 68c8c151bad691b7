"""Chaos: a steady load on ``deepinfer up``'s mesh while a random service is killed (SIGKILL) every N seconds.

    PYTHONPATH=libs:. python bench/serving/chaos.py [--duration-s 180] [--kill-every-s 15] [--concurrency 32]
    PYTHONPATH=libs:. python bench/serving/chaos.py --tiny --device cpu   # the smoke mode CI runs (about a minute)

The mesh is the launcher's (NATS, kvstore, grammar, two replicas, the balancer), supervised as ``deepinfer up``
supervises it: a killed service is restarted with backoff. The victims are the workers, the schedulers, the kvstore,
the grammar service and NATS; never the balancer, whose death ends the streams of the clients connected to it by
construction (run several behind a load balancer for that). The load: ``--concurrency`` client streams, each
request greedy or seeded from a fixed set of prompts, whose undisturbed outputs are measured first in the same run
(batch-invariant mode, so a request moved to another replica must reproduce them token for token).

Reported (and written as JSON with ``--out``): requests completed, failed, moved (the balancer's
``deepinfer_balancer_migrations_total``, by how the new replica rebuilt the state), token-exact against the
reference, the longest stall a client saw between two messages, and the kills. The reference figure: 0 failed and
every completed request token-exact, with the longest stall bounded by a restart (the peer: the same load with no
kills, whose longest stall the run also reports).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

import grpc

from bench.harness import ROOT, command_line, git_commit, write_json
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.launcher import Mesh
from deepinfer.serving.healthcheck import free_port
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def workload(n: int, max_tokens: int) -> list[generation_pb2.GenerateRequest]:
    reqs = []
    for i in range(n):
        seeded = i % 2 == 1
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if seeded else 0)
        if seeded:
            sampling.seed = 100 + i
        ids = [0] + [50 + 13 * i + k for k in range(6 + i % 7)]
        reqs.append(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling))
    return reqs


async def one(stub: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest) -> tuple[list, float]:
    """Token ids and the longest wait between two messages (or before the first)."""
    tokens, last, stall = [], time.monotonic(), 0.0
    async for msg in stub.Generate(req, timeout=600):
        now = time.monotonic()
        stall, last = max(stall, now - last), now
        tokens += msg.token_ids
    return tokens, stall


async def reference(address: str, reqs: list) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return [t for t, _ in await asyncio.gather(*(one(stub, r) for r in reqs))]


async def load(address: str, reqs: list, ref: list, concurrency: int, duration_s: float) -> dict:
    stats = {"completed": 0, "failed": 0, "exact": 0, "longest_stall_s": 0.0, "errors": {}}
    stop_at = time.monotonic() + duration_s
    rng = random.Random(0)

    async def client(stub: generation_pb2_grpc.GenerationStub) -> None:
        while time.monotonic() < stop_at:
            k = rng.randrange(len(reqs))
            try:
                tokens, stall = await one(stub, reqs[k])
            except grpc.aio.AioRpcError as e:
                stats["failed"] += 1
                name = e.code().name
                stats["errors"][name] = stats["errors"].get(name, 0) + 1
                continue
            stats["completed"] += 1
            stats["exact"] += tokens == ref[k]
            stats["longest_stall_s"] = max(stats["longest_stall_s"], stall)

    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
    return stats


async def killer(mesh: Mesh, every_s: float, duration_s: float, seed: int) -> list[dict]:
    rng, kills = random.Random(seed), []
    stop_at = time.monotonic() + duration_s
    while time.monotonic() + every_s < stop_at:
        await asyncio.sleep(every_s)
        victims = [n for n, p in mesh.procs if not n.startswith("balancer") and p.poll() is None]
        if mesh.nats is not None and mesh.nats.running:
            victims.append("nats")
        name = rng.choice(victims)
        pid = mesh.nats.pid if name == "nats" else dict(mesh.procs)[name].pid
        os.kill(pid, signal.SIGKILL)
        kills.append({"at_s": round(time.monotonic() - (stop_at - duration_s), 1), "service": name})
    return kills


def migrations(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    pattern = r'^deepinfer_balancer_migrations_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    model = make_tiny_model(tmp / "model", arch="deepseek_v41", seed=0)
    os.environ.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
        DEEPINFER_CACHE_DIR=str(tmp / "cache"),
        DEEPINFER_BATCH_INVARIANT="1",
        DEEPINFER_LOG_LEVEL="warning",
        DEEPINFER_RESTART_MAX_BACKOFF_S="2",
        DEEPINFER_REPLICA_PROBE_S="0.2",
    )
    mesh = Mesh(model, grpc_port=0, http_port=free_port(), replicas=2, log_dir=tmp, accelerator=args.device)
    try:
        mesh.start()
        mesh.start_supervisor()
        address, http = mesh.endpoints["grpc"], mesh.endpoints["http"].removesuffix("/v1")
        reqs = workload(args.prompts, args.max_tokens)
        ref = asyncio.run(reference(address, reqs))
        calm = asyncio.run(load(address, reqs, ref, args.concurrency, min(20.0, args.duration_s / 4)))

        async def chaos() -> tuple[dict, list]:
            return await asyncio.gather(
                load(address, reqs, ref, args.concurrency, args.duration_s),
                killer(mesh, args.kill_every_s, args.duration_s, args.seed),
            )

        stats, kills = asyncio.run(chaos())
        stats["moved"] = migrations(http)
        stats["restarts"] = {k: len(v) for k, v in mesh.restarts.items()}
    finally:
        mesh.stop(grace_s=30)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"config": config, "kills": kills, "chaos": stats, "calm": calm, "logs": str(tmp)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=None, help="default 180 (--tiny: 12)")
    p.add_argument("--kill-every-s", type=float, default=None, help="default 15 (--tiny: 5)")
    p.add_argument("--concurrency", type=int, default=None, help="default 32 (--tiny: 4)")
    p.add_argument("--prompts", type=int, default=None, help="default 16 (--tiny: 6)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 32 (--tiny: 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "nvidia"])
    p.add_argument("--tiny", action="store_true", help="smoke mode: 12 s, a kill every 5 s, 4 streams")
    p.add_argument("--out", type=Path, help="write the result as DIR/<date>-chaos-<device>.json")
    args = p.parse_args()
    defaults = (12.0, 5.0, 4, 6, 12) if args.tiny else (180.0, 15.0, 32, 16, 32)  # an option given wins
    for name, value in zip(("duration_s", "kill_every_s", "concurrency", "prompts", "max_tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    result = run(args)
    c = result["chaos"]
    print(f"chaos: {args.duration_s:.0f} s, {args.concurrency} streams, a SIGKILL every {args.kill_every_s:.0f} s "
          f"({', '.join(k['service'] for k in result['kills'])})")  # fmt: skip
    print(f"  completed {c['completed']}, failed {c['failed']} {c['errors'] or ''}, token-exact {c['exact']}/"
          f"{c['completed']}, moved {c['moved']}, longest stall {c['longest_stall_s']:.2f} s, "
          f"restarts {c['restarts']}")  # fmt: skip
    calm = result["calm"]
    print(f"  without kills (same run): completed {calm['completed']}, failed {calm['failed']}, "
          f"longest stall {calm['longest_stall_s']:.2f} s")  # fmt: skip
    if args.out:
        result.update(command=command_line(), git=git_commit())
        write_json(args.out / f"{date.today().isoformat()}-chaos-{args.device}.json", result)


if __name__ == "__main__":
    main()
