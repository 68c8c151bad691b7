"""``python -m services.grammar [--model DIR]``: compiles structured-output grammars (xgrammar) in a process pool."""

import argparse
import asyncio
import sys

from deepinfer import envs
from deepinfer.grammar.spec import GrammarUnavailable
from deepinfer.telemetry import MissingExtra, configure_logging, configure_tracing
from services.grammar.service import GrammarConfig, run_grammar


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="deepinfer grammar: compiles regex / JSON schema / EBNF / structural tags")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50091)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--model", help="model directory whose tokenizer.json to compile against "
                   "(default: DEEPINFER_HF_MODEL_DIR, else the packaged DeepSeek-V4 tokenizer)")  # fmt: skip
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish in-flight calls on SIGTERM")
    return p


def main() -> int:
    args = build_parser().parse_args()
    try:
        envs.validate_all()
        config = GrammarConfig.from_env(args.model or envs.DEEPINFER_HF_MODEL_DIR)
    except envs.EnvError as e:
        print(f"deepinfer grammar: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    configure_logging()
    try:
        provider = configure_tracing("deepinfer-grammar")
    except MissingExtra as e:  # a setting that needs an extra: say which, no traceback
        print(f"deepinfer grammar: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(run_grammar(config, args.host, args.port, args.metrics_port, args.grace))
    except GrammarUnavailable as e:
        print(f"deepinfer grammar: cannot start: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        provider.shutdown()  # flushes the spans still batched
    return 0


if __name__ == "__main__":
    sys.exit(main())
