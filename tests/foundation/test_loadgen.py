"""The load generator's parts without a server: length distributions and arrivals, the summary's arithmetic
(percentiles, TPOT, goodput), and the HTTP client against hostile and well-formed local servers."""

from __future__ import annotations

import asyncio
import random
import statistics

import numpy as np
import pytest

from deepinfer.loadgen import metrics, workload
from deepinfer.loadgen.http_client import OpenAIClient
from deepinfer.loadgen.outcome import Outcome


def test_lengths_follow_their_distribution_and_the_seed() -> None:
    rng = random.Random(0)
    assert workload.lengths("fixed", 3, 7, 0.0, rng) == [7, 7, 7]
    u = workload.lengths("uniform", 2000, 100, 0.5, random.Random(1))
    assert min(u) >= 50 and max(u) <= 150 and abs(statistics.fmean(u) - 100) < 3
    s = workload.lengths("sharegpt", 20000, 200, 0.0, random.Random(2))
    assert 4 <= min(s) and max(s) <= 1600 and abs(statistics.fmean(s) - 200) < 20  # clipping trims the mean a bit
    assert statistics.median(s) < statistics.fmean(s)  # a right tail, as chat traffic has
    a = workload.build(3, 10, 4, "uniform", 0.3, seed=9)
    assert a == workload.build(3, 10, 4, "uniform", 0.3, seed=9) != workload.build(3, 10, 4, "uniform", 0.3, seed=8)
    assert all(
        len(t.prompt_ids) == t.input_len and all(1000 <= i < 30000 for i in t.prompt_ids) for x in a for t in x.turns
    )
    with pytest.raises(ValueError, match="chat backend"):
        workload.build(2, 10, 4, turns=2)
    with pytest.raises(ValueError, match="unknown length distribution"):
        workload.lengths("zipf", 1, 1, 0.0, rng)


def test_arrivals_have_the_asked_rate() -> None:
    gaps = workload.arrival_gaps(20000, 50.0, 1.0, random.Random(3))
    assert abs(statistics.fmean(gaps) - 0.02) < 0.001
    bursty = workload.arrival_gaps(20000, 50.0, 0.25, random.Random(3))
    assert abs(statistics.fmean(bursty) - 0.02) < 0.002 and statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)
    assert workload.arrival_gaps(4, float("inf"), 1.0, random.Random(0)) == [0.0] * 4


def outcome(ttft: float, latency: float, tokens: int, gaps: list[float]) -> Outcome:
    o = Outcome(0, 0, ok=True, output_tokens=tokens, prompt_tokens=10, ttft=ttft, latency=latency)
    o.itl = gaps
    return o


def test_summary_arithmetic() -> None:
    values = [random.Random(4).random() for _ in range(101)]
    for p in (50, 90, 99, 99.9):
        assert metrics.percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    outs = [outcome(0.1, 0.5, 5, [0.1] * 4), outcome(0.3, 0.3, 1, []), Outcome(0, 1, error="HTTP 500")]
    assert outs[0].tpot == pytest.approx(0.1) and outs[1].tpot is None
    r = metrics.summarize(outs, 2.0, metrics.parse_slos("ttft:200"))
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["total_input_tokens"]) == (2, 1, 6, 20)
    assert r["request_goodput"] == 0.5 and r["output_throughput"] == 3.0  # only the first has TTFT <= 200 ms
    assert r["mean_ttft_ms"] == pytest.approx(200) and r["mean_tpot_ms"] == pytest.approx(100)
    assert r["mean_itl_ms"] == pytest.approx(100) and r["errors"] == ["HTTP 500"]
    for bad in ("ttft", "ttft:x", "ttft:-1", "speed:3"):
        with pytest.raises(ValueError, match="goodput"):
            metrics.parse_slos(bad)


async def serve_once(response: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def send(response: bytes, chat: bool = False) -> Outcome:
    async def go() -> Outcome:
        server, port = await serve_once(response)
        async with server:
            out = Outcome(0, 0)
            turn = workload.Turn(3, 2, prompt_ids=[1, 2, 3], text="hi")
            await OpenAIClient(f"http://127.0.0.1:{port}", "m", chat, timeout_s=10).send(out, turn, [], {})
            return out

    return asyncio.run(go())


def sse(*events: str) -> bytes:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def test_the_http_client_reads_chunked_sse_and_reports_bad_servers() -> None:
    ok = send(sse('{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}',
                  '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}', "[DONE]"))  # fmt: skip
    assert ok.ok and ok.text == "ab" and (ok.prompt_tokens, ok.output_tokens) == (3, 2) and len(ok.itl) == 1
    chat = send(sse('{"choices":[{"delta":{"reasoning_content":"r","content":"c"}}]}', "[DONE]"), chat=True)
    assert chat.ok and chat.text == "rc"
    refused = send(b'HTTP/1.1 400 Bad Request\r\nContent-Length: 24\r\n\r\n{"error":{"message":"n"}}')
    assert not refused.ok and refused.error.startswith("HTTP 400")
    garbage = send(b"SSH-2.0-OpenSSH\r\n\r\n")
    assert not garbage.ok and "not an HTTP response" in garbage.error
    empty = send(sse("[DONE]"))
    assert not empty.ok and empty.error == "no output"
