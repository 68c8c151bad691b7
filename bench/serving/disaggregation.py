"""Prefill/decode disaggregation against co-location: decode streams' TPOT while long prompts arrive.

    PYTHONPATH=libs:. python bench/serving/disaggregation.py --out bench/results/serving   # tiny model, CPU (≈ 8 min)
    PYTHONPATH=libs:. python bench/serving/disaggregation.py --tiny --device cpu           # smoke mode
    PYTHONPATH=libs:. python bench/serving/disaggregation.py --device cuda --width flash --depth 4 \
        --prefill-input 8192 --streams 16 --stream-output 256 --out bench/results/serving      # both workers on one GPU

The same hardware either way: two workers, one torch thread each (``DEEPINFER_TORCH_THREADS=1``), so on a 2-core
host each has a core. **Co-located**: two mixed replicas, each request served whole on one of them. **Disaggregated**:
one prefill and one decode replica (``deepinfer up --prefill-replicas 1 --decode-replicas 1``), each request's prompt
on the first, its decoding on the second, its state through the kvstore. Each configuration is a mesh of its own
(``deepinfer.launcher.Mesh``: NATS, the kvstore, the replicas, a balancer), run one after the other.

The workload, through the balancer's OpenAI completions API (``deepinfer bench serve``'s runner): ``--streams``
decode-heavy requests (``--stream-input`` prompt tokens, ``--stream-output`` output tokens) start together, and
while they decode ``--prefills`` long prompts (``--prefill-input`` tokens, ``--prefill-output`` output tokens) arrive
at ``--prefill-rate`` a second (Poisson). Reported per configuration: the decode streams' TPOT and ITL p50 / p99
(what a long prefill in the same step costs a decoding request), the long prompts' TTFT p50 / p99, the disaggregated
run's handoffs, and the state they moved: the long prompts' second-token gap p50 (disaggregated, the handoff's cost:
the export's put, the second hop, the decode replica's fetch and install, one decode step; co-located, one decode
step), and the kvstore's puts by path (its shared directory on one host, else the gRPC stream) with their size.
Greedy, ``ignore_eos``.

On CPU the figures are of a tiny model on CPU cores, where a prefill's cost grows with its tokens as on a GPU but
nothing else does: the direction and the size of the effect at this scale, not a GPU's. With ``--device cuda`` both
workers run on the one GPU the host shows first (``--pages`` KV pages each); ``--width flash`` makes the model
DeepSeek-V4-Flash's attention, compressors and window at ``--depth`` layers (8 routed experts: they move no state), so
a handoff moves what the real model's layers of those kinds hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from deepinfer.parallel.launch import free_port

CONFIGS = {"colocated": ["mixed", "mixed"], "disaggregated": ["prefill", "decode"]}


def handoffs(http: str) -> float:
    text = urllib.request.urlopen(http.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("deepinfer_balancer_handoffs_total{"))


def transfers(metrics_url: str) -> dict[str, float]:
    """The kvstore's puts and their bytes by path: ``{"shared": n, "shared_bytes": b, "stream": ...}``."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        for name, suffix in (
            ("deepinfer_kvstore_transfers_total{", ""),
            ("deepinfer_kvstore_transfer_bytes_total{", "_bytes"),
        ):
            if ln.startswith(name) and 'op="put"' in ln:
                path = ln.split('path="')[1].split('"')[0]
                out[path + suffix] = float(ln.split()[-1])
    return out


# DeepSeek-V4-Flash's attention and state at reduced depth (``--width flash``): the state a handoff moves per token
# is that of the real model's layer kinds; the routed experts are few (they move nothing and only cost memory)
FLASH = json.loads((ROOT / "docs" / "configs" / "deepseek-v4-flash" / "config.json").read_text())


def flash_overrides(depth: int) -> dict:
    kinds = FLASH["compress_ratios"]
    return {k: v for k, v in FLASH.items() if k not in ("architectures", "quantization_config")} | {
        "num_hidden_layers": depth, "compress_ratios": kinds[:depth], "n_routed_experts": 8,
        "num_nextn_predict_layers": 0, "num_hash_layers": min(FLASH["num_hash_layers"], depth),
    }  # fmt: skip


async def _both(url: str, args: argparse.Namespace, seed: int = 0) -> tuple:
    params = {"temperature": 0, "ignore_eos": True}
    streams = workload.build(args.streams, args.stream_input, args.stream_output, seed=seed + 1)
    prefills = workload.build(args.prefills, args.prefill_input, args.prefill_output, seed=seed + 2)

    async def later() -> tuple:
        await asyncio.sleep(args.prefill_delay_s)  # the streams are decoding by then
        client = OpenAIClient(url, "model", chat=False, timeout_s=900)
        return await runner.run(client, prefills, request_rate=args.prefill_rate, params=params, seed=3)

    client = OpenAIClient(url, "model", chat=False, timeout_s=900)
    return await asyncio.gather(runner.run(client, streams, params=params), later())


def keep_metrics(mesh: Mesh, where: Path) -> None:
    """Every service's ``/metrics`` text (step times by phase, queue lengths, ...) into ``where``, for a reader who
    asks where a figure's time went."""
    where.mkdir(parents=True, exist_ok=True)
    urls = {k: u for k, u in mesh.endpoints.items() if k.endswith(" metrics")}
    urls["balancer metrics"] = mesh.endpoints["http"].removesuffix("/v1") + "/metrics"
    for key, url in urls.items():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        (where / f"{key.removesuffix(' metrics')}.txt").write_text(text)


def run_config(name: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict:
    logs = (args.keep / name) if args.keep else (tmp / name)
    logs.mkdir(parents=True)
    gpu = args.device == "cuda"  # both workers on the one GPU the host shows first (CUDA_VISIBLE_DEVICES)
    env = {"DEEPINFER_NUM_PAGES": str(args.pages)} if gpu else {"DEEPINFER_TORCH_THREADS": "1"}
    mesh = Mesh(model, grpc_port=0, http_port=free_port(), replicas=2, roles=CONFIGS[name], log_dir=logs,
                accelerator="nvidia" if gpu else "cpu", extra_env=env)  # fmt: skip
    try:
        mesh.start()
        url = mesh.endpoints["http"]
        if not args.tiny:  # untimed: the same workload with other prompts (no cache hits), so the timed run meets no
            # first-use costs (kernels compiled for a step's shapes, graphs captured for its batch)
            asyncio.run(_both(url, args, seed=100))
        before, moved = handoffs(url), transfers(mesh.endpoints["kvstore metrics"])
        (s_out, s_dur), (p_out, p_dur) = asyncio.run(_both(url, args))
        streams, prefills = (summarize(o, t, percentiles=(50, 99)) for o, t in ((s_out, s_dur), (p_out, p_dur)))
        moved = {k: v - moved.get(k, 0.0) for k, v in transfers(mesh.endpoints["kvstore metrics"]).items()}
        if args.keep or args.tiny:  # (the smoke mode too, into its temporary directory: the code does not rot)
            keep_metrics(mesh, logs / "metrics")
        first = sorted(o.itl[0] * 1e3 for o in p_out if o.ok and o.itl)  # a long prompt's second token: its handoff
        return {
            "streams": streams,
            "prefills": prefills,
            "handoffs": handoffs(url) - before,
            "puts": moved,
            "first_itl_p50_ms": first[len(first) // 2] if first else None,
        }
    finally:
        mesh.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    flags = [("streams", "decode-heavy requests"), ("stream-input", "their prompt tokens"),
             ("stream-output", "their output tokens"), ("prefills", "long prompts"),
             ("prefill-input", "their prompt tokens"), ("prefill-output", "their output tokens")]  # fmt: skip
    for flag, what in flags:
        ap.add_argument(f"--{flag}", type=int, default=None, help=what)
    ap.add_argument("--prefill-rate", type=float, default=None, help="long prompts a second (Poisson)")
    ap.add_argument("--prefill-delay-s", type=float, default=None, help="when the long prompts start arriving")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--width",
        choices=["tiny", "flash"],
        default="tiny",
        help="the model: tiny, or DeepSeek-V4-Flash's attention and state at --depth layers (8 experts)",
    )
    ap.add_argument("--depth", type=int, default=4, help="--width flash: layers")
    ap.add_argument("--pages", type=int, default=2048, help="--device cuda: each worker's KV pages")
    ap.add_argument("--keep", type=Path, default=None, help="a new directory: each configuration's service logs and "
                    "its services' /metrics after the timed run")  # fmt: skip
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = dict(streams=1, stream_input=8, stream_output=4, prefills=1, prefill_input=32, prefill_output=2,
                prefill_rate=10.0, prefill_delay_s=0.1)  # fmt: skip
    full = dict(streams=8, stream_input=32, stream_output=160, prefills=6, prefill_input=1536, prefill_output=4,
                prefill_rate=0.5, prefill_delay_s=2.0)  # fmt: skip
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    configs = args.configs.split(",")
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: each of {', '.join(CONFIGS)}")
    from deepinfer.checkpoint.tiny import make_tiny_model

    rows = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = os.pathsep.join([str(ROOT / "libs"), str(ROOT), os.environ.get("PYTHONPATH", "")])
        os.environ |= {
            "PYTHONPATH": path,
            "DEEPINFER_LOG_LEVEL": os.environ.get("DEEPINFER_LOG_LEVEL", "warning"),
            "DEEPINFER_CACHE_DIR": str(tmp / "cache"),
        }
        overrides = flash_overrides(args.depth) if args.width == "flash" else None
        model = make_tiny_model(tmp / "model", seed=0, overrides=overrides)
        for c in configs:
            rows[c] = run_config(c, args, model, tmp)
            s = rows[c]["streams"]
            print(f"{c}: TPOT p50 {s['median_tpot_ms']:.1f} p99 {s['p99_tpot_ms']:.1f} ms; long prompts' second token "
                  f"{rows[c]['first_itl_p50_ms']} ms; puts {rows[c]['puts']}", flush=True)  # fmt: skip
    table = [
        f"{args.streams} decode streams ({args.stream_input} prompt + {args.stream_output} output tokens) while "
        f"{args.prefills} prompts of {args.prefill_input} tokens ({args.prefill_output} output) arrive at "
        f"{args.prefill_rate}/s; "
        + (
            f"two workers on one GPU, V4-Flash attention at {args.depth} layers"
            if args.device == "cuda" and args.width == "flash"
            else "two workers of one torch thread each, tiny model, CPU"
            if args.device == "cpu"
            else f"two workers on one GPU, {args.width} model"
        ),
        "",
        "| configuration | streams TPOT p50 ms | TPOT p99 ms | ITL p99 ms | long prompts TTFT p50 ms | TTFT p99 ms | "
        "long prompts' 2nd token p50 ms | handoffs | state put (shared / stream), MB each | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for c, r in rows.items():
        s, p, m = r["streams"], r["prefills"], r["puts"]
        per = [
            f"{m.get(k + '_bytes', 0) / m[k] / 1e6:.2f} × {m[k]:.0f}" if m.get(k) else "—" for k in ("shared", "stream")
        ]
        second = "—" if r["first_itl_p50_ms"] is None else f"{r['first_itl_p50_ms']:.0f}"
        table.append(f"| {c} | {s['median_tpot_ms']:.1f} | {s['p99_tpot_ms']:.1f} | {s['p99_itl_ms']:.1f} | "
                     f"{p['median_ttft_ms']:.0f} | {p['p99_ttft_ms']:.0f} | {second} | {r['handoffs']:.0f} | "
                     f"{' / '.join(per)} | {s['failed'] + p['failed']} |")  # fmt: skip
    failed = sum(r["streams"]["failed"] + r["prefills"]["failed"] for r in rows.values())
    res = {**result_header(args.device, args), "commit": git_commit(), "configs": rows, "failed": failed}
    write_result(args.out, f"{res['date']}-disaggregation{'-tiny' if args.tiny else ''}", res, table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
