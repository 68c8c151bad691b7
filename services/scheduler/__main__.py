"""``python -m services.scheduler --worker HOST:PORT``: one engine replica in front of its worker."""

import argparse
import asyncio
import sys

from deepinfer import envs
from deepinfer.serving.server import tune_interpreter
from deepinfer.telemetry import MissingExtra, configure_logging, configure_tracing
from services.scheduler.main import run_scheduler


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="deepinfer scheduler: one engine replica")
    p.add_argument("--worker", required=True, help="address of its worker (host:port, or unix:PATH on this host)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--max-queued", type=int, default=1024, help="waiting requests beyond this are refused")
    p.add_argument("--grace", type=float, help="seconds to finish running requests on SIGTERM "
                   "(default: DEEPINFER_DRAIN_GRACE_S)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--role", choices=["mixed", "prefill", "decode"], default="mixed",
                   help="what the balancer routes here: whole requests, or one side of prefill/decode disaggregation "
                   "(prefill and decode need a kvstore: DEEPINFER_KVSTORE_URL)")  # fmt: skip
    return p


def main() -> int:
    args = build_parser().parse_args()
    tune_interpreter()
    configure_logging()
    try:
        provider = configure_tracing("deepinfer-scheduler")
    except MissingExtra as e:  # a setting that needs an extra: say which, no traceback
        print(f"deepinfer scheduler: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        grace = envs.DEEPINFER_DRAIN_GRACE_S if args.grace is None else args.grace
        return asyncio.run(
            run_scheduler(args.worker, args.host, args.port, args.max_queued, grace, args.metrics_port, args.role)
        )
    finally:
        provider.shutdown()  # flushes the spans still batched


if __name__ == "__main__":
    sys.exit(main())
