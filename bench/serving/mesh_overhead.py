"""What the service mesh costs: the same workload through the offline API and through the mesh.

    PYTHONPATH=libs:. python bench/serving/mesh_overhead.py [--requests 16] [--max-tokens 32] [--concurrency 8]
    PYTHONPATH=libs:. python bench/serving/mesh_overhead.py --tiny --device cpu   # smoke mode

Starts ``deepinfer up``'s mesh on loopback (``deepinfer.launcher.Mesh``: NATS, the kvstore, the grammar service, a
worker on the cpu backend, a scheduler and the balancer, each its own process), runs greedy requests over gRPC
``Generate`` (streaming) and the same requests with ``LLM.generate`` in this process, and prints throughput of both,
their ratio, and the inter-token latency seen by the client (p50 / p99) against the offline engine's step time. The
peer here is the offline engine itself: the mesh adds two gRPC hops, protobuf and detokenization per token. Roofline:
the mesh cannot be faster than the offline engine running the same batches (ratio 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.harness import ROOT, command_line, git_commit, pct, write_json
from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.launcher import Mesh
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def prompts(n: int) -> list[list[int]]:
    return [[0] + [1000 + 37 * i + k for k in range(12 + i % 5)] for i in range(n)]


async def through_mesh(
    address: str, ps: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[float, list[float]]:
    gaps: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(stub: generation_pb2_grpc.GenerationStub, p: list[int]) -> None:
        req = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=p),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
        async with sem:
            last = None
            async for msg in stub.Generate(req, timeout=600):
                now = time.perf_counter()
                if last is not None and msg.token_ids:
                    gaps.extend([(now - last) / len(msg.token_ids)] * len(msg.token_ids))
                last = now

    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        await asyncio.gather(*[one(stub, p) for p in ps[:2]])  # warm-up
        t0 = time.perf_counter()
        gaps.clear()
        await asyncio.gather(*[one(stub, p) for p in ps])
        return time.perf_counter() - t0, gaps


def offline(llm: LLM, ps: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
    """All requests at once (the engine batches them continuously, as the mesh's scheduler does); returns the
    wall time and every step's duration (a step gives each running request its next token)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ps[:2]], params)  # warm-up
    engine, steps = llm.engine, []
    for p in ps:
        engine.add_request(engine.new_request_id(), p, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 4 requests x 4 tokens, one run")
    ap.add_argument("--device", choices=["cpu"], default="cpu", help="only cpu: the mesh's worker on the cpu backend")
    ap.add_argument("--out", type=Path, default=None, help="write DIR/<date>-mesh-overhead-cpu.json")
    args = ap.parse_args()
    if args.tiny:
        args.requests, args.max_tokens, args.concurrency, args.repeats = 4, 4, 2, 1
    tmp = Path(tempfile.mkdtemp(prefix="mesh-overhead-"))
    model = make_tiny_model(tmp / "model", seed=0)
    ps = prompts(args.requests)
    n_tokens = args.requests * args.max_tokens

    # the same compute threads as the mesh's worker, so that the difference is what the mesh adds
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="float32", page_size=16, num_pages=512, max_num_seqs=args.concurrency)
    os.environ["DEEPINFER_KVSTORE_DIR"] = str(tmp / "kvstore")  # the mesh's kvstore starts empty
    services = {  # the offline engine's cache and batch; the launcher gives the cpu worker cores - 1 threads
        "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
        "DEEPINFER_LOG_LEVEL": "warning",
        "DEEPINFER_PAGE_SIZE": "16",
        "DEEPINFER_NUM_PAGES": "512",
        "DEEPINFER_MAX_NUM_SEQS": str(args.concurrency),
    }
    mesh = Mesh(model, grpc_port=0, http_port=0, log_dir=tmp, extra_env=services)
    runs: list[dict[str, float]] = []
    try:
        mesh.start()
        for _ in range(args.repeats):  # alternate the two paths so that a noisy minute hits both
            off_wall, off_steps = offline(llm, ps, args.max_tokens)
            mesh_wall, gaps = asyncio.run(through_mesh(mesh.endpoints["grpc"], ps, args.max_tokens, args.concurrency))
            runs.append(
                {
                    "off_tps": n_tokens / off_wall,
                    "off_p50": statistics.median(off_steps) * 1e3,
                    "off_p99": pct(off_steps, 0.99) * 1e3,
                    "mesh_tps": n_tokens / mesh_wall,
                    "mesh_p50": pct(gaps, 0.5) * 1e3,
                    "mesh_p99": pct(gaps, 0.99) * 1e3,
                }
            )
    finally:
        mesh.stop()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    added = [r["mesh_p50"] - r["off_p50"] for r in runs]
    print(
        f"workload: {args.requests} requests x {args.max_tokens} tokens, greedy, {args.concurrency} concurrent; "
        f"{args.repeats} alternating runs, medians; torch threads {threads} (offline engine and mesh worker)"
    )
    print("| path | tokens/s | inter-token p50 ms | inter-token p99 ms |")
    print("|---|---:|---:|---:|")
    print(f"| offline engine (peer) | {med['off_tps']:.0f} | {med['off_p50']:.2f} | {med['off_p99']:.2f} |")
    mesh_row = f"{med['mesh_tps']:.0f} | {med['mesh_p50']:.2f} | {med['mesh_p99']:.2f}"
    print(f"| mesh: balancer → scheduler → worker | {mesh_row} |")
    print(f"\nthroughput ratio mesh / offline: {med['mesh_tps'] / med['off_tps']:.2f} (roofline 1.00)")
    print(
        f"added latency per token, mesh p50 − offline step p50, per run: {', '.join(f'{a:+.1f}' for a in added)} ms; "
        f"median {statistics.median(added):+.2f} ms"
    )
    if args.out:
        res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(), "args": vars(args),
               "medians": med, "added_ms": added, "runs": runs}  # fmt: skip
        write_json(args.out / f"{res['date']}-mesh-overhead-cpu.json", res)


if __name__ == "__main__":
    main()
