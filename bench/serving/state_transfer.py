"""How fast a request's state moves between replicas: the kvstore's Put and Get over loopback gRPC and through its
shared directory, against the loopback's own bandwidth and a memory copy, in one run.

    PYTHONPATH=libs:. python bench/serving/state_transfer.py --out bench/results/serving        # ≈ 1 min
    PYTHONPATH=libs:. python bench/serving/state_transfer.py --tiny --device cpu               # smoke mode

A prefill replica's handoff exports the request's resume point (pages of compressed rows and index keys, the window,
the compressor buffers: docs/routing.md) to the kvstore; the decode replica fetches it. Both are the kvstore client's
``put`` and ``get`` of one blob, which this script times against a kvstore process of its own (``python -m
services.kvstore``, host tier; ``--disk`` adds the disk tier, which a put also writes) for each blob size
(``--sizes``, MiB), on random bytes, ``--repeats`` times (medians), both ways a client moves it:

* **stream**: 1 MiB chunks with their CRC-32 through the gRPC stream (``KVStoreClient(same_host=False)``), the path
  between hosts;
* **same host**: the bytes through a file of the kvstore's shared directory (``DEEPINFER_KVSTORE_SHARED_DIR``, here
  ``auto``: under /dev/shm), only the header over gRPC; the CRC-32 checked all the same. A get of
  ``MAP_MIN_BYTES`` (4 MiB) or more maps the file (no copy); the column **same-host get, read** times every get
  reading its file into ``bytes`` instead (the client's path for smaller blobs, and all of them before 2026-12-05).

Beside it, in the same run:

* **peer, the loopback itself**: the same bytes sent over a plain TCP connection on 127.0.0.1 (one socket, 1 MiB
  writes, the receiver in another process): what any transport over the loopback can at best move;
* **roofline, a memory copy** of the same size (into a buffer touched beforehand): the host's copy bandwidth, the
  bound of a transfer that copies the blob once.

Every figure is GB/s of blob bytes (decimal GB).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT, add_common_args, git_commit, result_header, write_result
from deepinfer.kvstore import client as kv_client
from deepinfer.kvstore.client import KVStoreClient
from deepinfer.serving.healthcheck import free_port, wait_serving

MIB = 1 << 20
MAP_MIN_BYTES = kv_client.MAP_MIN_BYTES


def loopback_gbps(data: bytes, repeats: int) -> float:
    """Median GB/s of ``data`` sent over one TCP connection on 127.0.0.1 to a receiving process."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    sink = subprocess.Popen(  # a process of its own, as the kvstore is: reads everything, answers one byte each time
        [sys.executable, "-c", _SINK, str(port), str(len(data)), str(repeats)], cwd=ROOT
    )
    conn, _ = srv.accept()
    times = []
    with conn:
        view = memoryview(data)
        for _ in range(repeats):
            t0 = time.perf_counter()
            for off in range(0, len(data), MIB):
                conn.sendall(view[off : off + MIB])
            conn.recv(1)  # the receiver has all of it
            times.append(time.perf_counter() - t0)
    sink.wait(30)
    srv.close()
    return len(data) / statistics.median(times) / 1e9


_SINK = """
import socket, sys
port, size, repeats = map(int, sys.argv[1:])
c = socket.create_connection(("127.0.0.1", port))
buf = bytearray(1 << 20)
for _ in range(repeats):
    got = 0
    while got < size:
        got += c.recv_into(buf)
    c.sendall(b"k")
"""


def copy_gbps(data: bytes, repeats: int) -> float:
    """Median GB/s of one copy of ``data`` into a buffer allocated and touched beforehand (memory bandwidth, not the
    page faults of a fresh allocation)."""
    dst, times = bytearray(len(data)), []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst[:] = data
        times.append(time.perf_counter() - t0)
    times = times[1:]
    return len(data) / statistics.median(times) / 1e9


async def kvstore_gbps(address: str, data: bytes, repeats: int, same_host: bool, read: bool = False
                       ) -> tuple[float, float]:  # fmt: skip
    """Median GB/s of ``put`` and of ``get`` of ``data`` (a fresh key per put, each got back and checked), through
    the kvstore's shared directory (``same_host``; ``read``: gets read the file, never map it) or its stream."""
    kv_client.MAP_MIN_BYTES = 1 << 62 if read else MAP_MIN_BYTES
    puts, gets = [], []
    async with KVStoreClient(address, timeout_s=300, same_host=same_host) as kv:
        if same_host and not await kv.shared_dir():
            raise RuntimeError("the kvstore offers no shared directory this process reads")
        for i in range(repeats):
            key = os.urandom(16)
            t0 = time.perf_counter()
            await kv.put("bench-fingerprint", key, data, {"i": i}, "bench", resume_point=False)
            t1 = time.perf_counter()
            got = await kv.get("bench-fingerprint", key, resume_point=False)
            t2 = time.perf_counter()
            if got is None or got[0] != data:
                raise RuntimeError("the kvstore returned other bytes than it was given")
            puts.append(t1 - t0)
            gets.append(t2 - t1)
            await kv.remove("bench-fingerprint", [key], resume_point=False)
    return len(data) / statistics.median(puts) / 1e9, len(data) / statistics.median(gets) / 1e9


def start_kvstore(tmp: Path, disk: bool, max_bytes: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = os.pathsep.join([str(ROOT / "libs"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "DEEPINFER_KVSTORE_MAX_BLOB_BYTES": str(max_bytes),
           "DEEPINFER_KVSTORE_SHARED_DIR": "auto",
           "DEEPINFER_LOG_LEVEL": "warning"}  # fmt: skip
    env.pop("DEEPINFER_NATS_URL", None)
    args = [sys.executable, "-m", "services.kvstore", "--host", "127.0.0.1", "--port", str(port)]
    if disk:
        args += ["--data-dir", str(tmp / "kv")]
    proc = subprocess.Popen(args, cwd=ROOT, env=env)
    address = f"127.0.0.1:{port}"
    wait_serving(address, 120, proc)
    return proc, address


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--sizes", default=None, help="blob sizes in MiB (default 1,16,64,256; tiny 1,4)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5; tiny 2")
    ap.add_argument("--disk", action="store_true", help="the kvstore also writes its disk tier")
    args = ap.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,4" if args.tiny else "1,16,64,256")).split(",")]
    repeats = args.repeats or (2 if args.tiny else 5)
    rows: list[dict] = []
    table = [
        "| blob MiB | stream put GB/s | stream get GB/s | same-host put GB/s | same-host get GB/s "
        "| same-host get, read GB/s | loopback TCP GB/s (peer) | memory copy GB/s (roof) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as d:
        proc, address = start_kvstore(Path(d), args.disk, 2 * max(sizes) * MIB)
        try:
            for size in sizes:
                data = os.urandom(size * MIB)
                put, get = asyncio.run(kvstore_gbps(address, data, repeats, same_host=False))
                shared_put, shared_get = asyncio.run(kvstore_gbps(address, data, repeats, same_host=True))
                _, read_get = asyncio.run(kvstore_gbps(address, data, repeats, same_host=True, read=True))
                row = {"mib": size, "put_gbps": put, "get_gbps": get, "shared_put_gbps": shared_put,
                       "shared_get_gbps": shared_get, "shared_get_read_gbps": read_get,
                       "loopback_gbps": loopback_gbps(data, repeats),
                       "copy_gbps": copy_gbps(data, repeats)}  # fmt: skip
                rows.append(row)
                table.append(f"| {size} | {put:.2f} | {get:.2f} | {shared_put:.2f} | {shared_get:.2f} | {read_get:.2f} "
                             f"| {row['loopback_gbps']:.2f} | {row['copy_gbps']:.2f} |")  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    res = {**result_header("cpu", args), "commit": git_commit(), "disk": args.disk, "repeats": repeats, "rows": rows}
    stem = f"{res['date']}-state-transfer{'-tiny' if args.tiny else ''}"
    write_result(args.out, stem, res, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
