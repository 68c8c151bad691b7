"""What the service mesh costs: the same workload through the offline API and through the mesh.

    PYTHONPATH=libs:tests python bench/mesh_overhead.py [--requests 16] [--max-tokens 32] [--concurrency 8]

Starts a worker (cpu backend), a scheduler and a balancer as real processes on loopback (tests/serving/
mesh.py), runs greedy requests over gRPC ``Generate`` (streaming) and the same requests with
``LLM.generate`` in this process, and prints throughput of both, their ratio, and the inter-token
latency seen by the client (p50 / p99) against the offline engine's step time. The peer here is the
offline engine itself: the mesh adds two gRPC hops, protobuf and detokenization per token. Roofline: the
mesh cannot be faster than the offline engine running the same batches (ratio 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import grpc

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh


def prompts(n: int) -> list[list[int]]:
    return [[0] + [1000 + 37 * i + k for k in range(12 + i % 5)] for i in range(n)]


class BenchMesh(Mesh):
    def __init__(self, model: Path, tmp: Path, max_num_seqs: int) -> None:
        super().__init__(model, tmp)
        self.max_num_seqs = max_num_seqs

    def env(self) -> dict[str, str]:
        return super().env() | {"DEEPINFER_MAX_NUM_SEQS": str(self.max_num_seqs)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


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


def offline(llm: LLM, ps: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """All requests at once: the engine batches them continuously, as the mesh's scheduler does."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ps[:2]], params)  # warm-up
    sched = llm.engine.scheduler
    first = sched._step
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ps], params)
    wall = time.perf_counter() - t0
    return wall, wall / max(1, sched._step - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mesh-overhead-"))
    model = make_tiny_model(tmp / "model", seed=0)
    ps = prompts(args.requests)
    n_tokens = args.requests * args.max_tokens

    llm = LLM(model=model, dtype="float32", page_size=16, num_pages=512, max_num_seqs=args.concurrency)
    off_wall, off_step = offline(llm, ps, args.max_tokens)
    del llm

    mesh = BenchMesh(model, tmp, max_num_seqs=args.concurrency).up(num_pages=512)
    try:
        mesh_wall, gaps = asyncio.run(through_mesh(mesh.address("balancer"), ps, args.max_tokens, args.concurrency))
    finally:
        mesh.down()

    off_tps, mesh_tps = n_tokens / off_wall, n_tokens / mesh_wall
    p50, p99 = pct(gaps, 0.5) * 1e3, pct(gaps, 0.99) * 1e3
    print(f"workload: {args.requests} requests x {args.max_tokens} tokens, greedy, {args.concurrency} concurrent")
    print("| path | wall s | tokens/s | inter-token p50 ms | inter-token p99 ms |")
    print("|---|---:|---:|---:|---:|")
    print(f"| offline LLM.generate (peer) | {off_wall:.2f} | {off_tps:.0f} | {off_step * 1e3:.2f} (step) | — |")
    print(f"| mesh: balancer → scheduler → worker | {mesh_wall:.2f} | {mesh_tps:.0f} | {p50:.2f} | {p99:.2f} |")
    print(f"\nthroughput ratio mesh / offline: {mesh_tps / off_tps:.2f} (roofline 1.00)")
    print(f"added latency per token (mesh p50 − offline step): {p50 - off_step * 1e3:+.2f} ms")


if __name__ == "__main__":
    main()
