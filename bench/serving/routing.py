"""Cache-aware routing against least-loaded and round-robin routing, on a multi-turn chat workload of many users.

    PYTHONPATH=libs:. python bench/serving/routing.py --out bench/results/serving      # tiny model, CPU (≈ 5 min)
    PYTHONPATH=libs:. python bench/serving/routing.py --tiny --device cpu              # smoke mode

One mesh (``deepinfer.launcher.Mesh``: NATS, the kvstore, the grammar service, ``--replicas`` replicas of the tiny
model, a balancer) and one more balancer per policy (``DEEPINFER_ROUTER_POLICY``: ``cache``, ``load``,
``round_robin``), all in front of the same replicas, in one run. For each policy in turn, ``--users`` users each hold a
``--turns``-turn conversation through that policy's balancer (``deepinfer bench serve``'s runner: OpenAI chat over
HTTP, streamed; each turn sent after the previous answer; the users start together). Every conversation opens with
the same system message of ``--system-len`` words; each policy gets a system message of its own, so no policy finds
what another left in the caches. Each request names its user (``user``), which only the ``cache`` policy reads.
Before the first policy, ``2 x --replicas`` single-turn requests (a system message of their own) warm the replicas
up, untimed.

Reported per policy: the share of prompt tokens served from a prefix cache (the usage's ``cached_tokens``: a
replica's device cache or the kvstore, which every replica reads), TTFT p50 / p99, end-to-end p50, output tokens/s,
and the balancer's routes by reason. The kvstore makes a miss on the routed replica a fetch instead of a prefill
when another replica offloaded the prefix: ``load`` and ``round_robin`` still get hits, later and dearer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.harness import ROOT, add_common_args, git_commit, result_header, write_result
from deepinfer.launcher import Mesh
from deepinfer.loadgen import runner, workload
from deepinfer.loadgen.http_client import OpenAIClient
from deepinfer.loadgen.metrics import summarize

POLICIES = ("cache", "load", "round_robin")


def routes(http: str) -> dict[str, float]:
    """The balancer's ``deepinfer_balancer_routes_total`` by reason."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(http.removesuffix("/v1") + "/metrics", timeout=10).read().decode().splitlines():
        if line.startswith("deepinfer_balancer_routes_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.split()[-1])
    return out


def run_policy(base_url: str, args: argparse.Namespace, seed: int) -> dict:
    sessions = workload.build(args.users, args.user_len, args.output_len, "fixed", 0.0, args.turns, chat=True,
                              seed=seed, system_len=args.system_len)  # fmt: skip
    client = OpenAIClient(base_url, "model", chat=True, timeout_s=600)
    before = routes(base_url)
    outcomes, duration = asyncio.run(runner.run(client, sessions, params={"temperature": 0}, session_ids=True))
    s = summarize(outcomes, duration)
    after = routes(base_url)
    s["routes"] = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--replicas", type=int, default=None, help="default 4; tiny 2")
    ap.add_argument("--users", type=int, default=None, help="default 16; tiny 2")
    ap.add_argument("--turns", type=int, default=None, help="default 6; tiny 2")
    ap.add_argument("--system-len", type=int, default=None, help="words of the shared system message (default 200)")
    ap.add_argument("--user-len", type=int, default=None, help="words of each user message (default 24)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens of each answer (default 8)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    tiny = {"replicas": 2, "users": 2, "turns": 2, "system_len": 40, "user_len": 8, "output_len": 2}
    full = {"replicas": 4, "users": 16, "turns": 6, "system_len": 200, "user_len": 24, "output_len": 8}
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    policies = args.policies.split(",")
    if any(p not in POLICIES for p in policies):
        raise SystemExit(f"--policies: each of {', '.join(POLICIES)}")
    from deepinfer.checkpoint.tiny import make_tiny_model

    rows = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = os.pathsep.join([str(ROOT / "libs"), str(ROOT), os.environ.get("PYTHONPATH", "")])
        os.environ |= {"PYTHONPATH": path, "DEEPINFER_LOG_LEVEL": "warning", "DEEPINFER_CACHE_DIR": str(tmp / "cache")}
        mesh = Mesh(make_tiny_model(tmp / "model", seed=0), grpc_port=0, http_port=0, replicas=args.replicas,
                    log_dir=tmp)  # fmt: skip
        try:
            mesh.start()
            urls = {p: mesh.add_balancer(f"balancer-{p}", {"DEEPINFER_ROUTER_POLICY": p})[1] for p in policies}
            warm = workload.build(2 * args.replicas, args.user_len, 2, chat=True, seed=99, system_len=args.system_len)
            client = OpenAIClient(urls[policies[0]], "model", chat=True, timeout_s=600)
            asyncio.run(runner.run(client, warm, max_concurrency=1))  # each replica's first requests, untimed
            for i, p in enumerate(policies):
                rows[p] = run_policy(urls[p], args, seed=100 + i)
                print(f"{p}: {rows[p]['cache_hit_rate']:.1%} cached, TTFT p50 {rows[p]['median_ttft_ms']:.0f} ms",
                      flush=True)  # fmt: skip
        finally:
            mesh.stop()
    table = [
        f"{args.users} users x {args.turns} turns, system message {args.system_len} words, user messages "
        f"{args.user_len} words, answers {args.output_len} tokens, {args.replicas} replicas of the tiny model",
        "",
        "| policy | prompt tokens cached | of them from the kvstore | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms | "
        "output tok/s | routes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p, r in rows.items():
        why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["routes"].items()))
        far = r["cached_tokens_by_tier"].get("kvstore", 0) / max(1, r["total_cached_tokens"])
        ttft = f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f}"
        table.append(f"| {p} | {r['cache_hit_rate']:.1%} | {far:.0%} | {ttft} | {r['median_e2el_ms']:.0f} | "
                     f"{r['output_throughput']:.1f} | {why} |")  # fmt: skip
    failed = sum(r["failed"] for r in rows.values())
    res = {**result_header("cpu", args), "commit": git_commit(), "policies": rows, "failed": failed}
    write_result(args.out, f"{res['date']}-routing{'-tiny' if args.tiny else ''}", res, table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
