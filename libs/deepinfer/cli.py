"""The ``deepinfer`` command line.

deepinfer up                       # the embedded default: tiny model + offline generation
deepinfer make-tiny-model DIR      # a random tiny checkpoint in the official formats
deepinfer generate --prompt TEXT   # offline generation on a model directory or hub id
deepinfer env                      # validate and print the DEEPINFER_* variables
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deepinfer import envs

DEMO_CONVERSATIONS = [
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [{"role": "user", "content": "List three prime numbers."}],
]


def _default_model() -> Path:
    """``DEEPINFER_HF_MODEL_DIR`` if set, else the tiny model under the cache dir (generated once)."""
    if envs.DEEPINFER_HF_MODEL_DIR is not None:
        return envs.DEEPINFER_HF_MODEL_DIR
    from deepinfer.checkpoint.tiny import make_tiny_model

    path = envs.DEEPINFER_CACHE_DIR / "tiny-deepseek_v4-seed0"
    if not (path / "config.json").exists():
        print(f"No model configured (DEEPINFER_HF_MODEL_DIR is unset): generating a tiny model in {path}")
        make_tiny_model(path, seed=0)
    return path


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from deepinfer.checkpoint.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {path}")
    return 0


def _print_outputs(outputs: list, elapsed: float) -> None:
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    for o in outputs:
        print(f"--- {o.request_id} ({o.outputs[0].finish_reason}, {len(o.outputs[0].token_ids)} tokens)")
        print(f"prompt: {o.prompt!r}")
        print(f"output: {o.outputs[0].text!r}")
    print(f"{len(outputs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s")


def cmd_up(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    model = args.model or _default_model()
    llm = LLM(model=model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outputs = llm.chat(DEMO_CONVERSATIONS, params)
    _print_outputs(outputs, time.perf_counter() - t0)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=args.model or _default_model(), dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    _print_outputs(outputs, time.perf_counter() - t0)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    if args.markdown:
        print(envs.render_markdown())
        return 0
    envs.validate_all()
    for k, v in envs.snapshot().items():
        print(f"{k}={v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="Serve DeepSeek-V4 models.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("up", help="run the embedded default: a tiny model (or DEEPINFER_HF_MODEL_DIR) end to end")
    s.add_argument("--model", help="model directory or hub id (default: DEEPINFER_HF_MODEL_DIR or a tiny model)")
    s.add_argument("--max-tokens", type=int, default=24)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.set_defaults(func=cmd_up)
    s = sub.add_parser("make-tiny-model", help="write a random tiny checkpoint in the official formats")
    s.add_argument("dir")
    s.add_argument("--arch", default="deepseek_v4", choices=["deepseek_v4"])
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_make_tiny_model)
    s = sub.add_parser("generate", help="offline generation")
    s.add_argument("--model")
    s.add_argument("--prompt", action="append", required=True)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--dtype", default="auto")
    s.set_defaults(func=cmd_generate)
    s = sub.add_parser("env", help="validate and print the DEEPINFER_* variables")
    s.add_argument("--markdown", action="store_true", help="print the reference as markdown")
    s.set_defaults(func=cmd_env)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from deepinfer.telemetry import configure_logging

    try:
        envs.validate_all()
        configure_logging()
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
