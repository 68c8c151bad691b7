"""Multi-turn chat through `deepinfer up`'s mesh: time to first token per turn with and without the prefix cache.

    PYTHONPATH=libs:. python bench/serving/prefix_turns.py --out bench/results/serving     # one GPU (≈ 5 min)
    PYTHONPATH=libs:. python bench/serving/prefix_turns.py --tiny --device cpu              # smoke mode

The mesh (``deepinfer.launcher.Mesh``: NATS, the kvstore, the grammar service, the worker, its scheduler, the
balancer, each its own process) serves a random checkpoint (GPU: ``--layers`` layers of V4-Flash's width in the
official FP8 / MXFP4 format; CPU: the tiny model). One conversation of ``--turns`` turns, one request at a time, over
the balancer's gRPC ``Generate`` (token ids, greedy, ``ignore_eos``): turn ``k`` sends the whole conversation so far
(the previous prompt, its reply and ``--user`` new random tokens) and generates ``--reply`` tokens.

* **ours**: the requests as a client sends them; from turn 2 on the replica resumes from the previous turn's
  sequence-end resume point and prefills only what is new (``cached`` is the usage's ``cached_tokens``).
* **peer, no cache**: the same requests in the same mesh, each with a ``cache_salt`` of its own, so none finds a
  resume point: the whole conversation prefilled each turn, as without a prefix cache.
* **roofline**: the FLOP / byte roofline of prefilling the new tokens alone (``bench/engine/sweep.py``'s ``Work``,
  with the ceilings measured in the run): what a hit leaves to do.

The two alternate request by request (each turn ``--repeats`` times: the median TTFT; greedy, so a repeat replies the
same), so a noisy minute hits both. TTFT is the client's: from sending the request to the first token's message.
``engine/prefix_cache.py`` measures the same conversation in the engine's own process (no transport).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.harness import ROOT, SERVED_PAGE_SIZE, command_line, git_commit, served_checkpoint, write_result
from deepinfer.launcher import Mesh
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc


async def one_request(stub: Any, ids: list[int], reply: int, salt: str | None) -> tuple[float, list[int], int]:
    """TTFT (s), the reply's token ids and the prompt tokens served from a cache, of one streamed request."""
    req = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True),
    )
    if salt is not None:
        req.cache_salt = salt
    t0, ttft, out, cached = time.perf_counter(), None, [], 0
    async for msg in stub.Generate(req, timeout=600):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        out.extend(msg.token_ids)
        if msg.HasField("finished"):
            cached = msg.finished.usage.cached_tokens
    if ttft is None or len(out) != reply:
        raise RuntimeError(f"a turn's request ended with {len(out)} of {reply} tokens")
    return ttft, out, cached


async def conversation(address: str, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Each turn's prompt length, cached tokens and TTFTs (ms), ours and the peer's, alternating request by request."""
    rng = random.Random(args.seed)
    rows, prompt = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for k in range(args.turns):
            prompt = prompt + [rng.randrange(1000, vocab) for _ in range(args.user)]
            ours, peer, cached, reply = [], [], 0, []
            for r in range(args.repeats):
                ttft, reply, cached = await one_request(stub, prompt, args.reply, None)
                ours.append(1e3 * ttft)
                ttft, _, peer_cached = await one_request(stub, prompt, args.reply, f"no-cache-{k}-{r}")
                peer.append(1e3 * ttft)
                if peer_cached:
                    raise RuntimeError(f"turn {k + 1}: the salted request found {peer_cached} cached tokens")
            rows.append({"turn": k + 1, "prompt_tokens": len(prompt), "cached_tokens": cached,
                         "ttft_ms": statistics.median(ours), "ttft_no_cache_ms": statistics.median(peer),
                         "ttft_runs_ms": ours, "ttft_no_cache_runs_ms": peer})  # fmt: skip
            print(f"  turn {k + 1}: {len(prompt)} tokens, {cached} cached, TTFT {rows[-1]['ttft_ms']:.1f} ms "
                  f"(no cache {rows[-1]['ttft_no_cache_ms']:.1f} ms)", flush=True)  # fmt: skip
            prompt = prompt + reply
    return rows


def rooflines(model: Path, device: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's ``roofline_new_tokens_ms`` (the new tokens' prefill); returns the ceilings measured."""
    import torch

    from bench.engine import sweep
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config

    ceil = sweep.probe_ceilings(torch.device(device))
    work = sweep.Work.of(DeepseekV4Config.from_file(model / "config.json"))
    for r in rows:
        new = r["prompt_tokens"] - r["cached_tokens"]
        r["roofline_new_tokens_ms"] = work.prefill(new, ceil["hbm_copy_GBps"] * 1e9, ceil["fp8_TFLOPs"] * 1e12)[
            "roofline_ms"
        ]
    return ceil


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 3 turns of 64 new tokens, 4-token replies")
    ap.add_argument("--layers", type=int, default=4, help="layers of the V4-Flash-width model (GPU)")
    ap.add_argument("--turns", type=int, default=None, help="default 10 (--tiny: 3)")
    ap.add_argument("--user", type=int, default=None, help="new user tokens per turn (default 2048; --tiny: 64)")
    ap.add_argument("--reply", type=int, default=None, help="reply tokens per turn (default 16; --tiny: 4)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each turn's request (default 3; --tiny: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write DIR/<date>-prefix-turns-<device>.{json,md}")
    ap.add_argument("--log-level", default="warning", help="the services' DEEPINFER_LOG_LEVEL")
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = (3, 64, 4, 1) if args.tiny else (10, 2048, 16, 3)
    for name, value in zip(("turns", "user", "reply", "repeats"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def table(args: argparse.Namespace, rows: list[dict[str, Any]], ratios: tuple[float, float]) -> list[str]:
    lines = [f"# prefix cache through the mesh: a {args.turns}-turn conversation ({args.device})", "",
             f"{args.user} new tokens and {args.reply} reply tokens per turn, one request at a time over the "
             f"balancer's gRPC; TTFT = median of {args.repeats} runs of each turn's request.", "",
             "| turn | prompt tokens | cached | TTFT ms (cache) | TTFT ms (no cache, peer) | roofline ms (new) |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_ms']:.1f} | "
                     f"{r['ttft_no_cache_ms']:.1f} | {r['roofline_new_tokens_ms']:.2f} |")  # fmt: skip
    lines += ["", f"TTFT(turn {args.turns}) / TTFT(turn 1): **{ratios[0]:.2f}** with the cache, {ratios[1]:.2f} "
              "without (the peer)."]  # fmt: skip
    return lines


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prefix-turns-"))
    t0 = time.perf_counter()
    model = served_checkpoint(tmp, args.device, args.layers)
    total = args.turns * (args.user + args.reply)
    ps = SERVED_PAGE_SIZE[args.device]
    # the conversation's resume points and the peer's salted ones (each repeat's prompt and sequence end) all fit
    pages = (2 * args.repeats + 2) * args.turns * -(-total // ps) + 64
    settings = {"DEEPINFER_PAGE_SIZE": str(ps), "DEEPINFER_NUM_PAGES": str(pages),
                "DEEPINFER_MAX_MODEL_LEN": str(total + 2 * ps), "DEEPINFER_LOG_LEVEL": args.log_level,
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "libs"), str(ROOT), os.environ.get("PYTHONPATH"))
                                              if p)}  # fmt: skip
    mesh = Mesh(model, grpc_port=0, http_port=0, log_dir=tmp, accelerator="cpu" if args.device == "cpu" else "nvidia",
                extra_env=settings)  # fmt: skip
    try:
        mesh.start()
        print(f"[{time.perf_counter() - t0:.0f} s] mesh serving", flush=True)
        from deepinfer.models.deepseek_v4.config import DeepseekV4Config

        vocab = DeepseekV4Config.from_file(model / "config.json").vocab_size
        warm = argparse.Namespace(**{**vars(args), "turns": 2, "repeats": 1, "seed": args.seed + 1})
        asyncio.run(conversation(mesh.endpoints["grpc"], warm, vocab))  # untimed: graphs, buffers, both paths
        rows = asyncio.run(conversation(mesh.endpoints["grpc"], args, vocab))
    finally:
        mesh.stop()
    ceilings = rooflines(model, args.device, rows)
    ratios = (rows[-1]["ttft_ms"] / rows[0]["ttft_ms"], rows[-1]["ttft_no_cache_ms"] / rows[0]["ttft_no_cache_ms"])
    res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(), "device": args.device,
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
           "ceilings": ceilings, "turns": rows, "ttft_last_over_first": ratios[0],
           "ttft_last_over_first_no_cache": ratios[1]}  # fmt: skip
    write_result(args.out, f"{res['date']}-prefix-turns-{args.device}", res, table(args, rows, ratios))


if __name__ == "__main__":
    main()
