"""``deepinfer bench serve``: the load generator's command line (flags named as ``vllm bench serve``'s where they
mean the same)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BACKENDS = ("openai", "openai-chat", "grpc", "grpc-chat")


def add_parser(sub: Any) -> None:
    """Register ``deepinfer bench serve`` on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks against a running deployment")
    s = bench.add_subparsers(dest="bench_command", required=True).add_parser(
        "serve", help="open-loop load against the OpenAI HTTP or the gRPC API: TTFT, TPOT, ITL, E2EL, throughput"
    )
    s.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai: /v1/completions; openai-chat: chat completions; grpc(-chat): Generate")  # fmt: skip
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the OpenAI endpoint (openai backends)")
    s.add_argument("--grpc-address", default="127.0.0.1:50051", help="the balancer's gRPC address (grpc backends)")
    s.add_argument("--model", default="", help="the served model's name (default: the endpoint's only model)")
    s.add_argument("--api-key", default=None, help="sent as a bearer token (default: OPENAI_API_KEY if set)")
    s.add_argument("--num-prompts", type=int, default=100, help="sessions to run (single-turn: requests)")
    s.add_argument("--dataset", choices=("fixed", "uniform", "sharegpt"), default="fixed",
                   help="lengths: fixed, uniform (±range-ratio) or a synthetic ShareGPT-like distribution")  # fmt: skip
    s.add_argument("--input-len", type=int, default=1024, help="prompt tokens (mean for uniform / sharegpt)")
    s.add_argument("--output-len", type=int, default=128, help="output tokens (mean for uniform / sharegpt)")
    s.add_argument("--range-ratio", type=float, default=0.0, help="uniform lengths: len·(1 ± ratio)")
    s.add_argument("--turns", type=int, default=1, help="turns per session (chat backends), each after the last")
    s.add_argument("--system-prompt-len", type=int, default=0,
                   help="words of a system message every session shares (chat backends; 0: none)")  # fmt: skip
    s.add_argument(
        "--session-ids",
        action="store_true",
        help="each request names its session (OpenAI user, gRPC session_id), for session-affine routing",
    )
    s.add_argument("--request-rate", type=float, default=float("inf"), help="sessions per second (inf: at once)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    s.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0, help="lengths, prompts and arrivals")
    s.add_argument("--goodput", default=None, help='SLOs in ms, e.g. "ttft:200 tpot:50 e2el:2000"')
    s.add_argument("--percentiles", default="50,90,99", help="percentiles reported for each latency")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    s.add_argument("--result-file", type=Path, default=None, help="the JSON result (default: none)")
    s.add_argument("--plot", type=Path, default=None, help="an SVG of the latency distributions")
    s.add_argument("--save-detailed", action="store_true", help="every request's figures in the JSON")
    s.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from deepinfer.loadgen import metrics, report, workload

    chat = args.backend.endswith("chat")
    slos = metrics.parse_slos(args.goodput)
    try:
        percentiles = [float(p) for p in args.percentiles.split(",") if p]
    except ValueError:
        raise ValueError(f"percentiles: {args.percentiles!r} is not a comma-separated list of numbers") from None
    sessions = workload.build(args.num_prompts, args.input_len, args.output_len, args.dataset, args.range_ratio,
                              args.turns, chat, seed=args.seed, system_len=args.system_prompt_len)  # fmt: skip
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    params: dict[str, Any] = {"temperature": args.temperature}
    t0 = time.time()
    outcomes, duration = asyncio.run(_run(args, chat, key, sessions, params))
    summary = metrics.summarize(outcomes, duration, slos, percentiles)
    settings = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "backend": args.backend,
                "endpoint": args.grpc_address if args.backend.startswith("grpc") else args.base_url,
                "model": args.model, "num_prompts": args.num_prompts, "dataset": args.dataset,
                "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                "turns": args.turns, "system_prompt_len": args.system_prompt_len, "session_ids": args.session_ids,
                "request_rate": args.request_rate, "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency, "temperature": args.temperature, "seed": args.seed,
                "goodput": slos, "command": " ".join(["deepinfer", *sys.argv[1:]])}  # fmt: skip
    print(report.table(summary))
    if args.result_file is not None:
        report.write_json(report.result(settings, summary, outcomes, args.save_detailed), args.result_file)
    if args.plot is not None:
        report.plot(outcomes, args.plot, f"{args.backend}, rate {args.request_rate}, {args.num_prompts} sessions")
    if summary["errors"]:
        print("errors: " + json.dumps(summary["errors"]), file=sys.stderr)
    return 0 if summary["completed"] else 1


async def _run(args: argparse.Namespace, chat: bool, key: str | None, sessions: list, params: dict) -> tuple:
    from deepinfer.loadgen import runner
    from deepinfer.loadgen.grpc_client import GrpcClient
    from deepinfer.loadgen.http_client import OpenAIClient

    kw = {"request_rate": args.request_rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
          "params": params, "seed": args.seed, "session_ids": args.session_ids}  # fmt: skip
    if args.backend.startswith("grpc"):
        async with GrpcClient(args.grpc_address, args.model, chat, key, args.timeout) as client:
            return await runner.run(client, sessions, **kw)
    return await runner.run(OpenAIClient(args.base_url, args.model, chat, key, args.timeout), sessions, **kw)


__all__ = ["BACKENDS", "add_parser", "cmd_bench_serve"]
