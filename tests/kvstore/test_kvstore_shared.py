"""The kvstore's same-host path (``PutShared`` / ``GetShared`` through its shared directory): a real kvstore process
on loopback, the real client and raw gRPC calls, hostile files included; and the directory's own bookkeeping."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import grpc
import pytest

from deepinfer.kvstore import client as client_module
from deepinfer.kvstore.blob import Blob, BlobKey
from deepinfer.kvstore.client import KVStoreClient, KVStoreRefused
from deepinfer.kvstore.shared import PROBE, new_name, write_new
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.healthcheck import SERVING, status
from deepinfer.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvstore.test_kvstore_service import FP, MiB, key, meta
from services.kvstore import shared_dir as shared_dir_module
from services.kvstore.shared_dir import SharedDir, SharedFull

ROOT = Path(__file__).resolve().parents[2]


async def describe(address: str) -> kvstore_pb2.DescribeResponse:
    async with open_channel(address) as ch:
        return await kvstore_pb2_grpc.KVStoreStub(ch).Describe(kvstore_pb2.DescribeRequest(), timeout=10)


async def put_shared(address: str, n: int, name: str, size: int, crc: int, **extra: str) -> kvstore_pb2.PutResponse:
    header = kvstore_pb2.PageChunk(key=kvstore_pb2.PageKey(hash=key(n), resume_point=True), model_fingerprint=FP,
                                   layout="v1", total_bytes=size, crc32=crc, meta=meta(n) | extra)  # fmt: skip
    async with open_channel(address) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        return await stub.PutShared(kvstore_pb2.SharedBlob(header=header, file=name), timeout=10)


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def transfers(kv, op: str, path: str) -> float:
    return kv.metric("deepinfer_kvstore_transfers_total", op=op, path=path)


@pytest.mark.timeout(90)
def test_same_host_transfers_go_through_files_and_leave_none(kvstore_factory, monkeypatch):
    """(A get of ``MAP_MIN_BYTES`` or more maps its file: here 1 MiB, so the 3 MiB blob is mapped, the 1-byte one
    read.)"""
    monkeypatch.setattr(client_module, "MAP_MIN_BYTES", MiB)
    kv = kvstore_factory(DEEPINFER_KVSTORE_MAX_BLOB_BYTES=str(4 * MiB))
    blobs = [
        Blob.build(BlobKey(FP, key(40 + i), True), os.urandom(n), "v1", meta(40 + i))
        for i, n in enumerate([3 * MiB + 7, 5 * MiB, 1])
    ]  # fmt: skip (the middle one is too large)

    async def scenario():
        d = await describe(kv.address)
        assert d.shared_dir and stat.S_IMODE(os.stat(d.shared_dir).st_mode) == 0o700
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            assert await c.shared_dir() == d.shared_dir
            result = await c.put_many(blobs)
            assert result.stored == 2 and len(result.refused) == 1
            assert result.refused[0].startswith("blob 1 ") and "total_bytes" in result.refused[0]
            for b, kind in ((blobs[0], memoryview), (blobs[2], bytes)):
                got = await c.get(FP, b.key.hash)
                assert got == (b.data, b.meta) and type(got[0]) is kind
            assert await c.get(FP, key(49)) is None
            with pytest.raises(KVStoreRefused, match="crc32|total_bytes"):
                await c.put(FP, key(48), bytes(5 * MiB), meta(48))
        async with KVStoreClient(kv.address, timeout_s=30, same_host=False) as c:  # the stream, as across hosts
            assert await c.shared_dir() is None
            assert await c.get(FP, key(40)) == (blobs[0].data, blobs[0].meta)
        return d.shared_dir

    directory = asyncio.run(scenario())
    assert sorted(os.listdir(directory)) == [PROBE]  # every file taken or read and removed
    assert (transfers(kv, "put", "shared"), transfers(kv, "get", "shared")) == (2, 2)
    assert (transfers(kv, "put", "stream"), transfers(kv, "get", "stream")) == (0, 1)
    assert kv.metric("deepinfer_kvstore_refused_total", reason="too_large") == 2
    assert kv.stop() == 0
    assert not os.path.exists(directory)  # ``auto``: removed at exit


@pytest.mark.timeout(90)
def test_hostile_shared_files_are_refused_and_the_kvstore_stays_healthy(kvstore_factory, tmp_path):
    kv = kvstore_factory(DEEPINFER_KVSTORE_SHARED_DIR=str(tmp_path / "shared"))  # (the secret's file system: linkable)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the kvstore" * 100)
    size, crc = secret.stat().st_size, zlib.crc32(secret.read_bytes())

    async def scenario(d: str):
        cases = {}
        cases["path"] = ("../" * 8 + "etc/hostname", "file:")
        name = new_name("put")
        os.symlink(secret, os.path.join(d, name))
        cases["symlink"] = (name, "file:")
        name = new_name("put")
        os.link(secret, os.path.join(d, name))
        cases["hard link"] = (name, "file:")
        name = new_name("put")
        os.mkfifo(os.path.join(d, name))
        cases["fifo"] = (name, "file:")
        cases["missing"] = (new_name("put"), "file:")
        name = new_name("put")
        write_new(d, name, b"x" * (size + 1))
        cases["size"] = (name, "total_bytes:")
        cases["get file"] = (new_name("get"), "file:")
        for what, (name, field) in cases.items():
            err = await rpc_error(put_shared(kv.address, 50, name, size, crc))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert err.details().startswith(field), (what, err.details())
        name = new_name("put")
        write_new(d, name, b"y" * size)  # a checksum that does not match: refused, listed
        resp = await put_shared(kv.address, 51, name, size, crc)
        assert resp.stored == 0 and "crc32" in resp.refused[0]
        name = new_name("put")
        write_new(d, name, b"z" * size)  # a resume point put under another prompt's key
        header_meta = {"position": "999"}
        err = await rpc_error(put_shared(kv.address, 52, name, size, zlib.crc32(b"z" * size), **header_meta))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert sorted(os.listdir(d)) == [PROBE]  # each file taken or removed, whatever the answer
        async with KVStoreClient(kv.address, timeout_s=30) as c:  # still serving
            await c.put(FP, key(53), b"after", meta(53))
            assert await c.get(FP, key(53)) == (b"after", meta(53))

    d = asyncio.run(describe(kv.address)).shared_dir
    asyncio.run(scenario(d))
    assert secret.read_bytes() == b"not for the kvstore" * 100
    assert status(kv.address) == SERVING
    assert kv.metric("deepinfer_kvstore_refused_total", reason="crc_mismatch") == 1


@pytest.mark.timeout(90)
def test_without_a_shared_directory_or_its_probe_the_client_streams(kvstore_factory, tmp_path):
    off = kvstore_factory(DEEPINFER_KVSTORE_SHARED_DIR="off")
    named = kvstore_factory(DEEPINFER_KVSTORE_SHARED_DIR=str(tmp_path / "shared"))
    d = asyncio.run(describe(named.address))
    assert d.shared_dir == str(tmp_path / "shared") and (tmp_path / "shared" / PROBE).read_text() == d.probe
    (tmp_path / "shared" / PROBE).write_text("another host's directory of the same path")

    async def scenario(kv) -> None:
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            assert await c.shared_dir() is None
            await c.put(FP, key(60), b"streamed" * 1000, meta(60))
            assert await c.get(FP, key(60)) == (b"streamed" * 1000, meta(60))

    for kv in (off, named):
        asyncio.run(scenario(kv))
        assert (transfers(kv, "put", "stream"), transfers(kv, "get", "stream")) == (1, 1)
        assert transfers(kv, "put", "shared") == transfers(kv, "get", "shared") == 0
    assert asyncio.run(describe(off.address)).shared_dir == ""
    err = asyncio.run(rpc_error(put_shared(off.address, 61, new_name("put"), 1, 0)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert named.stop() == 0
    assert sorted(os.listdir(tmp_path / "shared")) == []  # a named directory stays, without the probe


@pytest.mark.timeout(90)
def test_files_not_read_are_capped_and_the_client_streams_past_the_cap(kvstore_factory):
    kv = kvstore_factory(DEEPINFER_KVSTORE_MAX_BLOB_BYTES=str(MiB))  # files waiting: at most 2 MiB
    data = os.urandom(MiB)

    async def scenario():
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            await c.put(FP, key(70), data, meta(70))
        request = kvstore_pb2.GetRequest(model_fingerprint=FP, key=kvstore_pb2.PageKey(hash=key(70), resume_point=True))
        async with open_channel(kv.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            for _ in range(2):  # a client that never reads them
                await stub.GetShared(request, timeout=10)
            err = await rpc_error(stub.GetShared(request, timeout=10))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            assert await c.get(FP, key(70)) == (data, meta(70))

    asyncio.run(scenario())
    assert transfers(kv, "get", "stream") == 1 and transfers(kv, "get", "shared") == 2
    assert kv.metric("deepinfer_kvstore_shared_waiting_bytes") == 2 * MiB


def test_the_directory_removes_what_nobody_took_and_what_dead_kvstores_left(tmp_path, monkeypatch):
    now = [1000.0]
    d = SharedDir(tmp_path, owned=False, cap_bytes=10, ttl_s=5, clock=lambda: now[0])
    first, second = d.give(b"abcd"), d.give(b"efgh")
    with pytest.raises(SharedFull):
        d.give(b"ijk")
    os.unlink(tmp_path / first)  # read and removed by its client
    stale, fresh = new_name("put"), new_name("put")
    write_new(tmp_path, stale, b"left by a client that died")
    write_new(tmp_path, fresh, b"about to be taken")
    os.utime(tmp_path / stale, (now[0] - 10, now[0] - 10))
    os.utime(tmp_path / fresh, (now[0], now[0]))
    assert d.sweep() == 1 and d.waiting_bytes == 4  # the stale .put; the read .get forgotten
    assert sorted(os.listdir(tmp_path)) == sorted([PROBE, second, fresh])
    now[0] += 6
    os.utime(tmp_path / fresh, (now[0], now[0]))
    assert d.sweep() == 1 and d.waiting_bytes == 0 and not (tmp_path / second).exists()
    d.close()
    assert sorted(os.listdir(tmp_path)) == [fresh]  # a named directory keeps what is not the kvstore's

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    parent = tmp_path / "shm"
    orphan, alive = parent / f"deepinfer-kvstore-{int(dead.stdout)}-x1", parent / f"deepinfer-kvstore-{os.getpid()}-x2"
    for p in (orphan, alive):
        p.mkdir(parents=True)
    monkeypatch.setattr(shared_dir_module, "AUTO_PARENT", parent)
    auto = SharedDir.open("auto", 10)
    assert auto is not None and auto.path.parent == parent and not orphan.exists() and alive.exists()
    auto.close()
    assert not auto.path.exists() and SharedDir.open("off", 10) is None
    named = SharedDir.open(str(tmp_path / "named"), 10)
    assert named is not None and stat.S_IMODE(os.stat(named.path).st_mode) == 0o700
    assert (named.path / PROBE).read_text() == named.probe


@pytest.mark.timeout(60)
def test_a_full_shared_directory_means_the_stream_for_a_while(kvstore_factory, monkeypatch):
    """A write that fails for space (the tmpfs is full) streams that blob and every blob for the back-off, without
    writing again; after it the client asks again and uses the directory."""
    from deepinfer.kvstore import client as client_module

    kv = kvstore_factory()
    attempts = []

    def full(directory, name, data):
        attempts.append(name)
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario():
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            monkeypatch.setattr(client_module, "write_new", full)
            for i in (80, 81):
                await c.put(FP, key(i), b"x" * 1000, meta(i))
            assert len(attempts) == 1 and await c.shared_dir() is None
            monkeypatch.undo()
            c._ask_again_at = 0.0  # (the back-off has passed)
            await c.put(FP, key(82), b"y" * 1000, meta(82))
            assert await c.get(FP, key(81)) == (b"x" * 1000, meta(81))

    asyncio.run(scenario())
    assert (transfers(kv, "put", "stream"), transfers(kv, "put", "shared")) == (2, 1)
    assert transfers(kv, "get", "shared") == 1


def test_a_shared_directory_that_cannot_be_made_stops_the_start_with_one_line(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
            "DEEPINFER_KVSTORE_SHARED_DIR": str(tmp_path / "a-file" / "shared")}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "services.kvstore", "--port", "0"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "cannot start" in out.stderr and "Traceback" not in out.stderr, out.stderr
