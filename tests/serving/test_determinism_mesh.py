"""Batch invariance through the mesh (issue 4): worker, scheduler and balancer as real processes with
DEEPINFER_BATCH_INVARIANT=1 and a small step budget; a seeded request at temperature 1 streams the same
tokens and logprobs alone and amid concurrent traffic, and GetModelInfo reports the guarantee."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
VOCAB = 129280


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("det_model"), seed=3)
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_MAX_NUM_BATCHED_TOKENS": "48"}
    m = Mesh(model, tmp_path_factory.mktemp("det_logs"), extra_env=env).up(http=False)
    yield m
    m.down()


def request(ids: list[int], **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(**sampling)
    )


async def stream(s: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest) -> tuple:
    msgs = [m async for m in s.Generate(req, timeout=120)]
    tokens = tuple(t for m in msgs for t in m.token_ids)
    logprobs = tuple((lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for m in msgs
                     for lp in m.logprobs)  # fmt: skip
    prompt = tuple(tuple((e.token_id, e.logprob) for e in p.entries) for m in msgs for p in m.prompt_logprobs)
    return tokens, logprobs, prompt


def test_seeded_request_is_identical_amid_concurrent_traffic(mesh: Mesh, tmp_path: Path) -> None:
    rng = random.Random(9)
    target_ids = [rng.randrange(2, VOCAB) for _ in range(140)]
    target = request(target_ids, temperature=1.0, seed=77, max_tokens=10, logprobs=2, prompt_logprobs=1,
                     ignore_eos=True)  # fmt: skip

    async def run() -> tuple:
        s = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(mesh.address("balancer")))
        alone = await stream(s, target)
        crowds = []
        for round_ in range(2):
            others = [
                request([rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 70))],
                        temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(2, 25), ignore_eos=True)
                for _ in range(8)
            ]  # fmt: skip
            tasks = [asyncio.create_task(stream(s, r)) for r in others[: 3 + round_ * 3]]
            await asyncio.sleep(0.05 * round_)  # the target joins while the others are mid-flight
            got = await asyncio.gather(stream(s, target), *[stream(s, r) for r in others[3 + round_ * 3 :]], *tasks)
            crowds.append(got[0])
        info = await s.GetModelInfo(generation_pb2.GetModelInfoRequest())
        return alone, crowds, info

    alone, crowds, info = asyncio.run(run())
    assert len(alone[0]) == 10 and len(alone[1]) == 10 and len(alone[2]) == len(target_ids)
    for got in crowds:
        assert got == alone
    assert info.batch_invariant and info.determinism.batch_invariant and info.deterministic_sampling
    assert info.accelerator == "cpu" and info.dtype == "float32"
    assert info.determinism.requires["ops"].startswith("batch-invariant")
    assert any("position" in c for c in info.determinism.covers)
