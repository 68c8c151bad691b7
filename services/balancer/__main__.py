"""``python -m services.balancer --model DIR --scheduler HOST:PORT [...]``: the public Generation API."""

import argparse
import asyncio
import sys

from deepinfer.serving.server import tune_interpreter
from deepinfer.telemetry import MissingExtra, configure_logging, configure_tracing
from services.balancer.main import run_balancer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="deepinfer balancer: the public API in front of scheduler replicas")
    p.add_argument("--model", help="model directory or hub id (tokenizer and config are read from it)")
    p.add_argument(
        "--scheduler",
        action="append",
        default=[],
        help="a scheduler replica (host:port), repeatable; with DEEPINFER_NATS_URL, registered schedulers are added",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0 or less: off)")
    p.add_argument(
        "--served-model-name",
        help="the model's name in the APIs (default: the model directory's base name, or the hub id)",
    )
    return p


def main() -> int:
    args = build_parser().parse_args()
    tune_interpreter()
    configure_logging()
    http_port = args.http_port if args.http_port > 0 else None
    try:
        provider = configure_tracing("deepinfer-balancer")
    except MissingExtra as e:  # a setting that needs an extra: say which, no traceback
        print(f"deepinfer balancer: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        served = args.served_model_name
        asyncio.run(
            run_balancer(args.model, args.scheduler, args.host, args.grpc_port, args.max_model_len, http_port, served)
        )
    finally:
        provider.shutdown()  # flushes the spans still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
