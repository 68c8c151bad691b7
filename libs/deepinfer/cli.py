"""The ``deepinfer`` command line.

deepinfer up                       # the mesh on the embedded default (a tiny DeepSeek-V4.1 model)
deepinfer make-tiny-model DIR      # a random tiny checkpoint in the official formats
deepinfer generate --prompt TEXT   # offline generation on a model directory or hub id
deepinfer env                      # validate and print the DEEPINFER_* variables
deepinfer certs DIR                # a development CA and the services' TLS certificates
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
    """``DEEPINFER_HF_MODEL_DIR`` if set, else a tiny random DeepSeek-V4.1 model under the cache dir (generated
    once)."""
    if envs.DEEPINFER_HF_MODEL_DIR is not None:
        return envs.DEEPINFER_HF_MODEL_DIR
    from deepinfer.checkpoint.tiny import make_tiny_model

    path = envs.DEEPINFER_CACHE_DIR / "tiny-deepseek_v41-seed0"
    if not (path / "config.json").exists():
        print(f"No model configured (DEEPINFER_HF_MODEL_DIR is unset): generating a tiny model in {path}")
        import shutil
        import tempfile

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:  # written aside, then renamed: an interrupted run never leaves a partial model behind
            make_tiny_model(tmp, arch="deepseek_v41", seed=0)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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


def cmd_offline(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=args.model or _default_model(), dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outputs = llm.chat(DEMO_CONVERSATIONS, params) if not args.prompt else llm.generate(args.prompt, params)
    _print_outputs(outputs, time.perf_counter() - t0)
    return 0


def replica_roles(replicas: int | None, prefill: int, decode: int) -> list[str]:
    """Each replica's role for ``deepinfer up``: ``replicas`` mixed ones (default 1), and with disaggregation
    ``prefill`` prefill and ``decode`` decode replicas (at least one of each; mixed ones then only as many as
    ``replicas`` says, default none). Raises ValueError naming the option."""
    if min(replicas or 0, prefill, decode) < 0:
        raise ValueError("--replicas, --prefill-replicas and --decode-replicas must not be negative")
    if not prefill and not decode:
        if replicas is not None and replicas < 1:
            raise ValueError("--replicas: at least one replica")
        return ["mixed"] * (1 if replicas is None else replicas)
    if not prefill or not decode:
        raise ValueError("--prefill-replicas and --decode-replicas: disaggregation needs at least one of each")
    return ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * (replicas or 0)


def cmd_up(args: argparse.Namespace) -> int:
    import signal
    import tempfile

    from deepinfer.launcher import Mesh
    from deepinfer.parallel.layout import from_args as layout_from_args

    try:
        layout = layout_from_args(args)
        roles = replica_roles(args.replicas, args.prefill_replicas, args.decode_replicas)
        if args.no_kvstore and set(roles) != {"mixed"} and not envs.DEEPINFER_KVSTORE_URL:
            raise ValueError("--no-kvstore: prefill and decode replicas hand requests off through a kvstore")
    except ValueError as e:
        print(f"deepinfer up: {e}", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else _default_model()
    log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-up-"))
    mesh = Mesh(
        model=model,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        replicas=len(roles),
        roles=roles,
        ranks=layout.ranks,
        tp=layout.tp,
        cp=layout.cp,
        served_model_name=args.served_model_name,
        accelerator=envs.DEEPINFER_ACCELERATOR,
        log_dir=log_dir,
        kvstore=not args.no_kvstore,
        grammar=False if args.no_grammar else None,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting the mesh on {model} (logs in {log_dir}) ...", flush=True)
    try:
        mesh.start()
        for name, addr in mesh.endpoints.items():
            print(f"  {name:18s} {addr}", flush=True)
        if args.demo:
            return _demo(mesh.endpoints["grpc"], args.max_tokens)
        mesh.start_supervisor()  # a service that exits is restarted with backoff
        print("serving; Ctrl-C (or SIGTERM) drains and stops everything", flush=True)
        while not stopping:
            time.sleep(0.2)
        print("draining ...", flush=True)
        return 0
    finally:
        mesh.stop()
        print("stopped", flush=True)


def _demo(address: str, max_tokens: int) -> int:
    """The demo conversations through the public gRPC API, streamed."""
    import asyncio

    from deepinfer.rpc.channel import client_channel
    from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    async def one(stub: generation_pb2_grpc.GenerationStub, conv: list[dict]) -> tuple[str, generation_pb2.Finished]:
        chat = generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(**m) for m in conv])
        req = generation_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        )
        text, fin = "", None
        async for msg in stub.Generate(req, timeout=300):
            text += msg.text
            fin = msg.finished if msg.HasField("finished") else fin
        return text, fin

    async def run() -> list:
        async with client_channel(address) as ch:  # TLS when DEEPINFER_TLS_CA is set
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*[one(stub, c) for c in DEMO_CONVERSATIONS])

    t0 = time.perf_counter()
    results = asyncio.run(run())
    for conv, (text, fin) in zip(DEMO_CONVERSATIONS, results):
        print(
            f"--- {conv[-1]['content']!r} -> {text!r} ({common_pb2.FinishReason.Name(fin.reason)}, "
            f"{fin.usage.completion_tokens} tokens)"
        )
    print(f"{len(results)} requests through the mesh in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion from a running mesh's gRPC API."""
    import asyncio

    import grpc

    from deepinfer.rpc.channel import client_channel
    from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    sampling = common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.chat:
        chat = generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(role="user", content=args.prompt)])
        req = generation_pb2.GenerateRequest(chat=chat, sampling=sampling)
    else:
        req = generation_pb2.GenerateRequest(text=args.prompt, sampling=sampling)

    async def run() -> None:
        async with client_channel(f"{args.host}:{args.grpc_port}") as ch:  # TLS when DEEPINFER_TLS_CA is set
            async for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=args.timeout):
                print(msg.text, end="", flush=True)
                if msg.HasField("finished"):
                    f = msg.finished
                    print(
                        f"\n[{common_pb2.FinishReason.Name(f.reason)}; {f.usage.prompt_tokens} prompt + "
                        f"{f.usage.completion_tokens} generated tokens]"
                    )

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        print(f"deepinfer: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    if args.markdown:
        print(envs.render_markdown())
        return 0
    envs.validate_all()
    for k, v in envs.snapshot().items():
        print(f"{k}={v}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from deepinfer.parallel.memory_plan import GIB, PlanError, parse_bytes, plan, render

    engram = args.engram or envs.DEEPINFER_ENGRAM_TABLES
    try:
        p = plan(args.model, args.gpus, parse_bytes(args.gpu_mem), int(parse_bytes(args.reserve)), engram, args.tp)
    except PlanError as e:
        print(f"deepinfer plan: {e}", file=sys.stderr)
        return 2
    print(render(p))
    if p.context(1) == 0:
        print(f"deepinfer plan: no room for one sequence's state ({p.per_sequence / GIB:.2f} GiB)", file=sys.stderr)
        return 2
    return 0


def cmd_rank(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from deepinfer.engine.factory import build_worker
    from deepinfer.engine.model_dir import resolve_model_dir
    from deepinfer.parallel.launch import expert_group, join, same_pages
    from deepinfer.parallel.layout import Layout
    from deepinfer.parallel.placement import routed_experts_of
    from deepinfer.parallel.rank_group import RankRunner, follow
    from deepinfer.runtime import shared_host

    channel = join(args.rank, args.world, args.port, args.accelerator)
    try:
        layout = Layout(args.world, args.tp, args.cp)
        group = expert_group(routed_experts_of(resolve_model_dir(args.model)[1]), channel, layout)
        flag = {None: None, "true": True, "false": False}
        parts = build_worker(args.model, args.dtype, args.accelerator, args.max_model_len, args.num_pages,
                             args.page_size, flag[args.quant_sim], flag[args.batch_invariant],
                             args.num_speculative_tokens, ep=group)  # fmt: skip
        same_pages(parts.num_pages, channel)
        shared_host.release(group.host_key)
        follow(RankRunner(parts.runner), channel)
    finally:
        dist.destroy_process_group()
    return 0


def _up_parser(sub: argparse._SubParsersAction) -> None:
    from deepinfer.parallel.layout import add_arguments as add_layout_arguments

    s = sub.add_parser("up", help="run the mesh (NATS, worker, scheduler, balancer) on one machine")
    s.add_argument(
        "--model", help="model directory or hub id (default: DEEPINFER_HF_MODEL_DIR or a tiny DeepSeek-V4.1 model)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--grpc-port", type=int, default=50051)
    s.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API (0: off)")
    s.add_argument("--replicas", type=int, help="replicas serving whole requests (default 1; none with disaggregation)")
    s.add_argument("--prefill-replicas", type=int, default=0, help="prefill/decode disaggregation: replicas that "
                   "prefill prompts and hand them off (with --decode-replicas; docs/routing.md)")  # fmt: skip
    s.add_argument("--decode-replicas", type=int, default=0, help="replicas that decode what prefill replicas hand off")
    add_layout_arguments(
        s,
        "ranks of each replica's worker, one device each, the MoE experts shared "
        "among them (default: DEEPINFER_EP; docs/parallelism.md)",
    )
    s.add_argument("--served-model-name", help="the model's name in the APIs (default: the model directory's name)")
    s.add_argument("--no-kvstore", action="store_true", help="start no kvstore: resume points the replicas evict "
                   "from their devices are dropped, not kept in host memory and on disk, unless "
                   "DEEPINFER_KVSTORE_URL names another (docs/kv_cache.md)")  # fmt: skip
    s.add_argument("--no-grammar", action="store_true", help="start no grammar service (DEEPINFER_UP_GRAMMAR=0): "
                   "structured-output requests are refused, unless DEEPINFER_GRAMMAR_URL names another "
                   "(docs/structured_outputs.md)")  # fmt: skip
    s.add_argument("--demo", action="store_true", help="send the demo conversations, print them, stop")
    s.add_argument("--max-tokens", type=int, default=24)
    s.set_defaults(func=cmd_up)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="Serve DeepSeek-V4.1 and DeepSeek-V4 models.")
    sub = p.add_subparsers(dest="command", required=True)
    _up_parser(sub)
    s = sub.add_parser("make-tiny-model", help="write a random tiny checkpoint in the official formats")
    s.add_argument("dir")
    s.add_argument("--arch", default="deepseek_v4", choices=["deepseek_v4", "deepseek_v41"])
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_make_tiny_model)
    s = sub.add_parser("generate", help="stream a completion from a running mesh (gRPC)")
    s.add_argument("prompt")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--grpc-port", type=int, default=50051)
    s.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--timeout", type=float, default=300.0)
    s.set_defaults(func=cmd_generate)
    s = sub.add_parser("offline", help="the engine in this process: demo conversations or --prompt")
    s.add_argument("--model")
    s.add_argument("--prompt", action="append")
    s.add_argument("--max-tokens", type=int, default=24)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--dtype", default="auto")
    s.set_defaults(func=cmd_offline)
    s = sub.add_parser("plan", help="how a model fits on N GPUs: weights per rank, KV state, batch x context")
    s.add_argument("--model", required=True, help="a directory with the model's config.json (weights not needed)")
    s.add_argument("--gpus", type=int, required=True, help="GPUs of the worker (expert parallel across them)")
    s.add_argument("--gpu-mem", required=True, help="memory of each GPU, e.g. 141GB or 80GiB")
    s.add_argument("--reserve", default="8GiB", help="per GPU, beside weights and KV state (context, activations)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel group size: the attention heads split over it")
    s.add_argument("--engram", choices=("host", "device"), default=None,
                   help="where DeepSeek-V4.1's Engram tables go (default: DEEPINFER_ENGRAM_TABLES)")  # fmt: skip
    s.set_defaults(func=cmd_plan)
    s = sub.add_parser("rank", help="one rank of a worker of several (started by rank 0: LLM(ep=N))")
    s.add_argument("--rank", type=int, required=True)
    s.add_argument("--world", type=int, required=True)
    s.add_argument("--port", type=int, required=True, help="rank 0's rendezvous port on loopback")
    s.add_argument("--accelerator", required=True, choices=("nvidia", "ascend", "cpu"))
    s.add_argument("--tp", type=int, default=1, help="ranks of each tensor-parallel group")
    s.add_argument("--cp", type=int, default=1, help="ranks of each context-parallel group")
    s.add_argument("--model")
    s.add_argument("--dtype", default="auto")
    for name in ("max-model-len", "num-pages", "page-size", "num-speculative-tokens"):
        s.add_argument(f"--{name}", type=int)
    for name in ("quant-sim", "batch-invariant"):
        s.add_argument(f"--{name}", type=str.lower, choices=("true", "false"))
    s.set_defaults(func=cmd_rank)
    s = sub.add_parser("env", help="validate and print the DEEPINFER_* variables")
    s.add_argument("--markdown", action="store_true", help="print the reference as markdown")
    s.set_defaults(func=cmd_env)
    from deepinfer.certs import add_parser as add_certs_parser

    add_certs_parser(sub)
    from deepinfer.loadgen.command import add_parser as add_bench_parser

    add_bench_parser(sub)
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
