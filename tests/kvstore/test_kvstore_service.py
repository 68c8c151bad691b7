"""The kvstore as a real process on loopback, driven by the real client and raw gRPC streams."""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import grpc
import pytest

from deepinfer.kvstore.blob import Blob, BlobKey, Tier
from deepinfer.kvstore.client import KVStoreClient, KVStoreDataLoss, KVStoreRefused
from deepinfer.kvstore.keys import binding_meta, resume_key
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.healthcheck import SERVING, status
from deepinfer.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.disk import file_name

FP = "deepseek-v4-test-fp"
MiB = 1024 * 1024


def key(i: int) -> bytes:
    """The key of made-up resume point ``i``: the one its binding meta (:func:`meta`) derives."""
    return resume_key(FP, bytes([i]) * 16, bytes([255 - i]) * 16, 16 + i)


def meta(n: int, **extra: str) -> dict[str, str]:
    """The meta that binds a blob to :func:`key` ``(n)`` (chain, tail, position), plus ``extra``."""
    return binding_meta(bytes([n]) * 16, bytes([255 - n]) * 16, 16 + n) | extra


def run(coro_fn, address: str):
    async def main():
        async with KVStoreClient(address, timeout_s=30) as kv:
            return await coro_fn(kv)

    return asyncio.run(main())


def chunk(
    k: bytes, offset: int, data: bytes, total: int, crc: int = 0, fp: str = FP, meta: dict[str, str] | None = None
) -> kvstore_pb2.PageChunk:
    return kvstore_pb2.PageChunk(
        key=kvstore_pb2.PageKey(hash=k, resume_point=True),
        model_fingerprint=fp,
        layout="deepinfer-resume-v1",
        offset=offset,
        total_bytes=total,
        data=data,
        crc32=crc,
        meta=meta,
    )


async def raw_put(address: str, chunks: list[kvstore_pb2.PageChunk]) -> kvstore_pb2.PutResponse:
    async with open_channel(address) as ch:
        return await kvstore_pb2_grpc.KVStoreStub(ch).Put(iter(chunks), timeout=30)


@pytest.mark.timeout(60)
def test_round_trip_multi_chunk_and_several_blobs_in_one_put(shared_kvstore):
    big = os.urandom(3 * MiB + MiB // 2)
    blobs = [Blob.build(BlobKey(FP, key(10 + i), True), os.urandom(n), "v1", meta(10 + i, i=str(i)))
             for i, n in enumerate([1, MiB, 2 * MiB + 5])]  # fmt: skip

    async def scenario(kv: KVStoreClient):
        await kv.put(FP, key(1), big, meta(1, note="7"), "deepinfer-resume-v1")
        data, got = await kv.get(FP, key(1))
        assert data == big and got == meta(1, note="7")
        full = await kv.get_blob(FP, key(1))
        assert full.layout == "deepinfer-resume-v1" and full.crc32 == zlib.crc32(big)
        result = await kv.put_many(blobs)
        assert result.stored == 3 and result.refused == []
        for b in blobs:
            assert await kv.get(FP, b.key.hash) == (b.data, b.meta)
        assert await kv.lookup(FP, [key(1), key(10), key(99)]) == [Tier.HOST, Tier.HOST, None]
        # the key includes the fingerprint and the resume-point flag
        assert await kv.get("another-model", key(1)) is None
        assert await kv.get(FP, key(1), resume_point=False) is None
        assert await kv.lookup("another-model", [key(1)]) == [None]
        assert await kv.remove(FP, [key(10), key(98)]) == 1
        assert await kv.get(FP, key(10)) is None

    run(scenario, shared_kvstore.address)
    assert shared_kvstore.metric("deepinfer_kvstore_hits_total", op="get", tier="host") >= 5
    assert shared_kvstore.metric("deepinfer_kvstore_misses_total", op="get") >= 3
    assert shared_kvstore.metric("deepinfer_kvstore_stored_total", tier="disk", reason="put") >= 4
    # write-through: one file per blob in the data dir, named from hex digests only
    names = set(os.listdir(shared_kvstore.data_dir))
    assert file_name(BlobKey(FP, key(1), True)) in names and file_name(BlobKey(FP, key(10), True)) not in names


@pytest.mark.timeout(60)
def test_bad_inputs_are_refused_or_invalid_and_the_service_stays_healthy(shared_kvstore):
    address = shared_kvstore.address
    payload = os.urandom(MiB + 100)
    good_crc = zlib.crc32(payload)
    half = MiB

    async def scenario():
        # a bad checksum, an empty key and an oversized blob are refused; the good blob between them is stored
        resp = await raw_put(address, [
            chunk(key(20), 0, payload[:half], len(payload), good_crc ^ 1), chunk(key(20), half, payload[half:], 0),
            chunk(b"", 0, b"abc", 3, zlib.crc32(b"abc")),
            chunk(key(21), 0, payload, len(payload), good_crc, meta=meta(21)),
            chunk(key(22), 0, bytes(9 * MiB), 9 * MiB, zlib.crc32(bytes(9 * MiB))),
            chunk(key(23), 0, b"xyz", 3, zlib.crc32(b"xyz"), fp=""),
        ])  # fmt: skip
        assert resp.stored == 1 and len(resp.refused) == 4, resp
        assert "blob 0" in resp.refused[0] and "crc32" in resp.refused[0]
        assert "blob 1" in resp.refused[1] and "key.hash" in resp.refused[1]
        assert "blob 3" in resp.refused[2] and "total_bytes" in resp.refused[2]
        assert "blob 4" in resp.refused[3] and "model_fingerprint" in resp.refused[3]
        # malformed streams: INVALID_ARGUMENT naming the field
        cases = {
            "offset": [chunk(key(24), 0, b"ab", 4, 0), chunk(key(24), 3, b"cd", 4)],  # a gap
            "key": [chunk(key(25), 0, b"ab", 4, 0), chunk(key(26), 2, b"cd", 4)],  # interleaved keys
            "total_bytes": [chunk(key(27), 0, b"ab", 4, 0)],  # ended mid-blob
            "data": [chunk(key(28), 0, b"abcdef", 4, 0)],  # past total_bytes
        }
        for field, chunks in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw_put(address, chunks)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(field + ":"), err.value.details()
        async with KVStoreClient(address) as kv:
            with pytest.raises(KVStoreRefused, match="crc32|total_bytes"):
                await kv.put(FP, key(29), bytes(9 * MiB))
            for bad in [("", key(1)), (FP, b""), (FP, bytes(65))]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await kv.get(*bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # still serving: the good blob of the mixed stream and a new one
            assert await kv.get(FP, key(21)) == (payload, meta(21))
            await kv.put(FP, key(30), b"after", meta(30))
            assert await kv.get(FP, key(30)) == (b"after", meta(30))

    asyncio.run(scenario())
    assert status(address) == SERVING
    m = shared_kvstore.metric
    assert m("deepinfer_kvstore_refused_total", reason="crc_mismatch") == 1
    assert m("deepinfer_kvstore_refused_total", reason="bad_key") == 1
    assert m("deepinfer_kvstore_refused_total", reason="too_large") == 2
    assert m("deepinfer_kvstore_refused_total", reason="bad_fingerprint") == 1


@pytest.mark.timeout(60)
def test_restart_serves_from_disk_and_a_flipped_byte_is_data_loss(kvstore_factory, tmp_path):
    data_dir = tmp_path / "data"
    kv = kvstore_factory(data_dir)
    blobs = {i: os.urandom(MiB + 1000 * i) for i in range(3)}

    async def fill(c: KVStoreClient):
        for i, data in blobs.items():
            await c.put(FP, key(i), data, meta(i, i=str(i)))

    run(fill, kv.address)
    assert kv.stop() == 0  # SIGTERM drains and exits cleanly
    kv.start()
    assert '"blobs": 3' in kv.log()
    assert kv.metric("deepinfer_kvstore_entries", tier="disk") == 3
    assert kv.metric("deepinfer_kvstore_entries", tier="host") == 0

    async def after_restart(c: KVStoreClient):
        assert await c.lookup(FP, [key(0), key(1), key(2)]) == [Tier.DISK] * 3
        assert await c.get(FP, key(0)) == (blobs[0], meta(0, i="0"))
        assert await c.lookup(FP, [key(0)]) == [Tier.HOST]  # promoted by the verified read

    run(after_restart, kv.address)
    assert kv.metric("deepinfer_kvstore_hits_total", op="get", tier="disk") == 1
    # flip one payload byte of a blob that is only on disk
    path = data_dir / file_name(BlobKey(FP, key(1), True))
    raw = bytearray(path.read_bytes())
    raw[-500] ^= 0x40
    path.write_bytes(bytes(raw))

    async def corrupt(c: KVStoreClient):
        with pytest.raises(KVStoreDataLoss, match="checksum"):
            await c.get(FP, key(1))
        assert await c.lookup(FP, [key(1)]) == [None]
        assert await c.get(FP, key(1)) is None  # gone: never served
        assert await c.get(FP, key(2)) == (blobs[2], meta(2, i="2"))

    run(corrupt, kv.address)
    assert not path.exists()
    assert kv.metric("deepinfer_kvstore_corrupt_total", tier="disk") == 1
    assert status(kv.address) == SERVING


@pytest.mark.timeout(60)
def test_retention_expires_unused_blobs_lazily_and_by_sweep(kvstore_factory, tmp_path):
    data_dir = tmp_path / "data"
    kv = kvstore_factory(data_dir, DEEPINFER_KVSTORE_RETENTION_S="1")

    async def scenario(c: KVStoreClient):
        for i in range(3):
            await c.put(FP, key(i), b"x" * 100, meta(i))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.8:  # keep blob 2 alive by reading it
            assert await c.get(FP, key(2)) is not None
            await asyncio.sleep(0.3)
        assert await c.lookup(FP, [key(0), key(1), key(2)]) == [None, None, Tier.HOST]

    run(scenario, kv.address)
    assert os.listdir(data_dir) == [file_name(BlobKey(FP, key(2), True))]
    assert kv.metric("deepinfer_kvstore_expired_total", tier="disk") == 2
    assert kv.metric("deepinfer_kvstore_expired_total", tier="host") == 2


@pytest.mark.timeout(60)
def test_capacity_eviction_in_both_tiers(kvstore_factory, tmp_path):
    data_dir = tmp_path / "data"
    kv = kvstore_factory(
        data_dir, DEEPINFER_KVSTORE_HOST_BYTES=str(2 * MiB + MiB // 2), DEEPINFER_KVSTORE_DISK_BYTES=str(3 * MiB + 4096)
    )
    blobs = {name: os.urandom(MiB) for name in "ABCD"}
    k = {name: key(ord(name)) for name in blobs}

    async def scenario(c: KVStoreClient):
        for name in "ABC":
            await c.put(FP, k[name], blobs[name], meta(ord(name)))
        # host holds 2 of the 1 MiB blobs: A (least recently used) left memory but is still on disk
        assert await c.lookup(FP, [k["A"], k["B"], k["C"]]) == [Tier.DISK, Tier.HOST, Tier.HOST]
        assert await c.get(FP, k["A"]) == (blobs["A"], meta(ord("A")))  # served from disk, promoted: B leaves memory
        assert await c.lookup(FP, [k["A"], k["B"], k["C"]]) == [Tier.HOST, Tier.DISK, Tier.HOST]
        # disk holds 3 files: D pushes out the least recently used file (B), which was in no other tier
        await c.put(FP, k["D"], blobs["D"], meta(ord("D")))
        assert await c.lookup(FP, [k["A"], k["B"], k["C"], k["D"]]) == [Tier.HOST, None, Tier.DISK, Tier.HOST]
        assert await c.get(FP, k["B"]) is None
        assert await c.get(FP, k["C"]) == (blobs["C"], meta(ord("C")))

    run(scenario, kv.address)
    assert kv.metric("deepinfer_kvstore_evicted_total", tier="host") >= 3
    assert kv.metric("deepinfer_kvstore_evicted_total", tier="disk") == 1
    assert kv.metric("deepinfer_kvstore_bytes", tier="host") <= 2 * MiB + MiB // 2
    assert kv.metric("deepinfer_kvstore_entries", tier="disk") == 3
    assert len(os.listdir(data_dir)) == 3
