"""``python -m services.kvstore [--data-dir DIR]``: KV blobs in host memory and on local disk."""

import argparse
import asyncio
import sys
from pathlib import Path

from deepinfer import envs
from deepinfer.telemetry import MissingExtra, configure_logging, configure_tracing
from services.kvstore.service import KVStoreConfig, run_kvstore


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="deepinfer kvstore: KV blobs in host memory and on disk")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50081)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--data-dir", help="disk tier directory (overrides DEEPINFER_KVSTORE_DIR; unset: no disk tier)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish in-flight calls on SIGTERM")
    return p


def main() -> int:
    args = build_parser().parse_args()
    try:
        envs.validate_all()
        config = KVStoreConfig.from_env(args.data_dir)
        if config.data_dir is not None:
            config.data_dir.mkdir(parents=True, exist_ok=True)
        if config.shared_dir not in ("auto", "off"):  # a named shared directory: made (0700) before serving
            Path(config.shared_dir).expanduser().mkdir(mode=0o700, parents=True, exist_ok=True)
    except (envs.EnvError, OSError) as e:
        print(f"deepinfer kvstore: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    configure_logging()
    try:
        provider = configure_tracing("deepinfer-kvstore")
    except MissingExtra as e:  # a setting that needs an extra: say which, no traceback
        print(f"deepinfer kvstore: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(run_kvstore(config, args.host, args.port, args.metrics_port, args.grace))
    finally:
        provider.shutdown()  # flushes the spans still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
