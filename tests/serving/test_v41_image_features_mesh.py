"""Encoded image features on the worker, through the mesh (DeepSeek-V4.1): worker, scheduler and balancer as real
processes on the tiny V4.1 checkpoint, a real ``grpcio`` client.

* the worker caches an image's features by the digest of its bytes: the same image sent again skips the vision
  tower (the worker's ``deepinfer_worker_image_encodes`` counter stays, ``..._image_cache_hits`` counts it) and
  gives the same tokens; another image is encoded;
* the features that requests in flight hold count against ``DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES``: with one image
  request running on a budget that fits one, another is refused with RESOURCE_EXHAUSTED naming the setting (a text
  request is not), and once the first ends the next one is served; features alone larger than the budget are
  INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(600)


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


IMAGE_C, IMAGE_D, BIG = png(70, 50, 11), png(70, 50, 12), png(300, 200, 13)
# a 70 x 50 image in the prompt below holds 1232 bytes on the tiny model (features 4 x 64 fp32, and 16 bytes per
# position of the 13 expanded ones); the 300 x 200 one over 10 kB: the budget fits one small image
BUDGET = 2000


@pytest.fixture(scope="module")
def mesh(tiny_v41_dir, tmp_path_factory: pytest.TempPathFactory):
    env = {"DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES": str(BUDGET)}
    m = Mesh(tiny_v41_dir, tmp_path_factory.mktemp("v41_features_logs"), extra_env=env).up(num_pages=64, http=False)
    yield m
    m.down()


@pytest.fixture(scope="module")
def image_token_id(tiny_v41_dir) -> int:
    return json.loads((tiny_v41_dir / "config.json").read_text())["image_token_id"]


def worker_metric(mesh: Mesh, name: str) -> float:
    text = urllib.request.urlopen(mesh.metrics_url("worker"), timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def request(image_token_id: int, images: list[bytes], max_tokens: int = 4) -> generation_pb2.GenerateRequest:
    ids = [0, 17, 4242, image_token_id, 99, 5] if images else [0, 17, 4242, 99, 5]
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), images=images, sampling=sampling)


def generate(mesh: Mesh, req: generation_pb2.GenerateRequest) -> list[int]:
    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            msgs = [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120)]
            return [t for m in msgs for t in m.token_ids]

    return asyncio.run(run())


def test_the_same_image_skips_the_vision_tower(mesh: Mesh, image_token_id: int) -> None:
    encodes, hits = "deepinfer_worker_image_encodes_total", "deepinfer_worker_image_cache_hits_total"
    e0, h0 = worker_metric(mesh, encodes), worker_metric(mesh, hits)
    first = generate(mesh, request(image_token_id, [IMAGE_C]))
    assert (worker_metric(mesh, encodes), worker_metric(mesh, hits)) == (e0 + 1, h0)
    again = generate(mesh, request(image_token_id, [IMAGE_C]))
    assert (worker_metric(mesh, encodes), worker_metric(mesh, hits)) == (e0 + 1, h0 + 1)  # no tower run
    assert again == first and len(first) == 4
    other = generate(mesh, request(image_token_id, [IMAGE_D]))
    assert (worker_metric(mesh, encodes), worker_metric(mesh, hits)) == (e0 + 2, h0 + 1)
    assert other != first  # the other image's features, not the cached ones
    assert worker_metric(mesh, "deepinfer_worker_image_cache_bytes") > 0


def test_features_in_flight_count_against_the_budget(mesh: Mesh, image_token_id: int) -> None:
    async def run() -> tuple[grpc.aio.AioRpcError, list[int], list[int], float]:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            held = stub.Generate(request(image_token_id, [IMAGE_C], max_tokens=2000), timeout=120)
            await held.read()  # running: its features are held on the worker
            held_bytes = worker_metric(mesh, "deepinfer_worker_image_features_held_bytes")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [m async for m in stub.Generate(request(image_token_id, [IMAGE_D]), timeout=60)]
            text = [t for m in [m async for m in stub.Generate(request(image_token_id, []), timeout=60)]
                    for t in m.token_ids]  # fmt: skip
            held.cancel()  # the request ends: the worker drops its features (with an empty step when idle)
            deadline = time.monotonic() + 30
            while True:
                try:
                    msgs = [m async for m in stub.Generate(request(image_token_id, [IMAGE_D]), timeout=60)]
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
            return refused.value, text, [t for m in msgs for t in m.token_ids], held_bytes

    refused, text, served, held_bytes = asyncio.run(run())
    assert 0 < held_bytes <= BUDGET
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES" in refused.details()
    assert len(text) == 4 and len(served) == 4  # text is not held back; the image is served once there is room
    deadline = time.monotonic() + 10
    while worker_metric(mesh, "deepinfer_worker_image_features_held_bytes") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_metric(mesh, "deepinfer_worker_image_features_held_bytes") == 0  # idle: nothing held


def test_features_larger_than_the_budget_are_invalid(mesh: Mesh, image_token_id: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(mesh, request(image_token_id, [BIG]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("images: ") and "DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES" in e.value.details()
