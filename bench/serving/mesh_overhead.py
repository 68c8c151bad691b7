"""What the service mesh costs: the same requests through the in-process engine and through `deepinfer up`'s mesh.

    PYTHONPATH=libs:. python bench/serving/mesh_overhead.py --out bench/results/serving      # one GPU (≈ 10 min)
    PYTHONPATH=libs:. python bench/serving/mesh_overhead.py --tiny --device cpu              # smoke mode

On a GPU the model is a random checkpoint of V4-Flash's width in the official format (``--layers`` layers, FP8 /
MXFP4 as stored; ``checkpoint.synthetic``), on the CPU the tiny model. For each concurrency ``c`` (``--concurrency``)
``c`` requests of ``--prompt-len`` random prompt tokens and ``--max-tokens`` greedy output tokens (``ignore_eos``)
start together:

* **peer, the in-process engine** (``LLM``'s engine stepped in this process, async scheduling as served): wall time,
  output tokens/s, and its step times (a step gives each running request its next token: the TPOT the mesh can at
  best reach);
* **ours, the mesh** (``deepinfer.launcher.Mesh``: NATS, kvstore, grammar service, the worker on the same backend,
  its scheduler, the balancer, each its own process; the scheduler reaches its worker through a Unix socket) through
  each of ``--protocols`` (gRPC ``Generate`` and OpenAI HTTP completions, streamed; the load generator of
  ``deepinfer bench serve``): output tokens/s, TPOT and ITL percentiles, and stalls (gaps between tokens more than
  1 ms above the request's median gap). ``--replica-streams``: how the balancer sends its requests to the scheduler,
  one mesh each: ``session`` (one stream for all of them, each step's tokens in one message: the default) and / or
  ``submit`` (a call per request, ``DEEPINFER_REPLICA_SESSIONS=0``).

The roofline is the peer: the mesh cannot beat the engine running the same batches (ratio 1.0). The two paths
alternate per concurrency so that a noisy minute hits both, and each runs the level once untimed first (the same
requests with other prompts, to the same lengths: graphs captured for those batches and context spans, buffers grown,
on both sides, so neither is timed with one-off costs; the graph captures that still fall in a timed run are counted
in its ``phases``).
Each timed run also records the CPU each process used over its wall time (``cpu``: the bench process, which holds the
in-process engine or the load generator's client, and each mesh service): a value near 1.0 is a saturated
interpreter, the first suspect when the mesh is slower than the engine. ``phases``: the mean host time per step
of the worker's launch, finish and starved phases and the scheduler's plan and deliver phases over the run (their
``*_step_phase_seconds`` metrics, read from the running services), the graphs captured in the run and the resume
points offloaded to the kvstore in it (``kvstore puts``: the mesh's work that the peer, with no kvstore, never does —
resume points left by earlier runs are evicted to make room). ``--kvstore on,off`` adds a mesh without its kvstore
(``deepinfer up --no-kvstore``: evicted resume points dropped, as the peer drops them): the exchange alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, SERVED_PAGE_SIZE, command_line, git_commit, pct, served_checkpoint, write_json
from deepinfer import LLM, SamplingParams
from deepinfer.launcher import Mesh
from deepinfer.loadgen import runner, workload
from deepinfer.loadgen.grpc_client import GrpcClient
from deepinfer.loadgen.http_client import OpenAIClient
from deepinfer.loadgen.metrics import summarize
from deepinfer.serving.healthcheck import free_port


def sessions(c: int, args: argparse.Namespace, seed: int) -> list[workload.Session]:
    """``c`` prompts of random ids (no two share a prefix: no prefix-cache hit on either path)."""
    return workload.build(c, args.prompt_len, args.max_tokens, token_range=(1000, 100_000), seed=seed)


def offline(llm: LLM, ss: list[workload.Session]) -> dict[str, float]:
    """All requests added at once, the engine stepped until they finish: wall time, tokens/s, step times."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=ss[0].turns[0].output_len, ignore_eos=True)
    for s in ss:
        engine.add_request(engine.new_request_id(), s.turns[0].prompt_ids, params)
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    decode = steps[len(steps) // 4 :]  # past the prefills: the steady decode steps
    tokens = sum(s.turns[0].output_len for s in ss)
    return {"wall_s": wall, "output_throughput": tokens / wall, "step_p50_ms": statistics.median(decode) * 1e3,
            "step_p99_ms": pct(decode, 0.99) * 1e3}  # fmt: skip


def cpu_seconds(mesh: Mesh | None) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and of each of ``mesh``'s services (Linux ``/proc``)."""
    t = os.times()
    out = {"bench": t.user + t.system}
    tick = os.sysconf("SC_CLK_TCK")
    for name, proc in mesh.procs if mesh is not None else ():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_use(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each process's CPU over ``wall_s`` (1.0: one core busy the whole time)."""
    return {k: round((after[k] - before[k]) / wall_s, 3) for k in after if k in before and wall_s > 0}


PHASES = {"worker": "deepinfer_worker_step_phase_seconds", "scheduler": "deepinfer_scheduler_step_phase_seconds"}
# counters read beside the phases: graphs captured while serving (a step that stalled on a new shape) and resume
# points offloaded to the kvstore (the worker reads each one's pages and state: work the in-process peer never does)
# and host copies the worker's pinned pool had no room for (each a pinned block from PyTorch's allocator)
COUNTS = {"worker": [("deepinfer_worker_graph_captures", "graph captures", {}),
                     ("deepinfer_worker_pinned_pool_fallbacks", "pinned fallbacks", {})],
          "kvstore": [("deepinfer_kvstore_transfers", "puts", {"op": "put"})]}  # fmt: skip


def phase_totals(mesh: Mesh) -> dict[str, list[float]]:
    """``"worker-0 launch": [seconds, count]``, ...: the step-phase histograms' sums and counts so far, read from each
    worker's and scheduler's /metrics, and the counts of :data:`COUNTS` (``"worker-0 graph captures": [0, n]``,
    ``"kvstore puts": [0, n]``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for name, url in mesh.endpoints.items():
        service = name.removesuffix(" metrics")
        kind = service.split("-")[0]
        if not name.endswith(" metrics") or (kind not in PHASES and kind not in COUNTS):
            continue
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - the mesh's own loopback endpoint
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for counter, label, where in COUNTS.get(kind, []):
                if family.name == counter:  # (a counter: its count, no time)
                    total = sum(x.value for x in family.samples if x.name.endswith("_total")
                                and all(x.labels.get(k) == v for k, v in where.items()))  # fmt: skip
                    out[f"{service} {label}"] = [0.0, total]
            if family.name != PHASES.get(kind):
                continue
            for sample in family.samples:
                key = f"{service} {sample.labels.get('phase')}"
                if sample.name.endswith("_sum"):
                    out.setdefault(key, [0.0, 0.0])[0] = sample.value
                elif sample.name.endswith("_count"):
                    out.setdefault(key, [0.0, 0.0])[1] = sample.value
    return out


def phase_use(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per phase over a run: how many times it ran and its mean in ms."""
    use = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, [0.0, 0.0])
        if count > c0:
            use[key] = {"n": int(count - c0), "mean_ms": round(1e3 * (total - t0) / (count - c0), 3)}
            if key.endswith(tuple(label for counts in COUNTS.values() for _, label, _ in counts)):  # (counts only)
                use[key] = {"n": int(count - c0)}
    return use


def stalls(outcomes: list[Any], above_ms: float = 1.0) -> int:
    """Gaps between tokens more than ``above_ms`` over their request's median gap."""
    n = 0
    for o in outcomes:
        if len(o.itl) > 2:
            med = statistics.median(o.itl)
            n += sum(gap - med > above_ms / 1e3 for gap in o.itl)
    return n


async def through_mesh(mesh: Mesh, protocol: str, ss: list[workload.Session], model: str) -> dict[str, Any]:
    if protocol == "grpc":
        client: Any = GrpcClient(mesh.endpoints["grpc"], model, chat=False)
    else:
        client = OpenAIClient(mesh.endpoints["http"], model, chat=False)
    enter = getattr(client, "__aenter__", None)
    if enter is not None:
        await enter()
    try:
        outcomes, duration = await runner.run(client, ss, max_concurrency=len(ss), params={"temperature": 0})
    finally:
        if enter is not None:
            await client.__aexit__(None, None, None)
    summary = summarize(outcomes, duration)
    keep = ("completed", "failed", "output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
            "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms", "errors")  # fmt: skip
    return {k: summary[k] for k in keep if k in summary} | {"stalls_over_1ms": stalls(outcomes)}


PROFILED = ("worker", "scheduler", "balancer")


def profilers(mesh: Mesh, args: argparse.Namespace, name: str) -> list[Any]:
    """``--py-spy DIR``: a sampling profile of each worker, scheduler and balancer over a timed run (py-spy's folded
    stacks, all threads, DIR/<name>-<service>.txt); stopped by :func:`stop_profilers`."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy") if args.py_spy else None
    if exe is None:
        return []
    args.py_spy.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(proc.pid), "--threads", "--nonblocking", "--rate", "200",
                              "--format", "raw", "--output", str(args.py_spy / f"{name}-{service}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for service, proc in mesh.procs if service.split("-")[0] in PROFILED]  # fmt: skip


def stop_profilers(procs: list[Any]) -> None:
    import signal

    for p in procs:
        p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in procs:
        p.wait(timeout=60)


def measure(mesh: Mesh, llm: LLM, args: argparse.Namespace, model: str, t0: float, streams: str,
            kvstore: str = "on") -> list[dict]:  # fmt: skip
    """Each concurrency level through the in-process engine and through ``mesh``, alternating."""
    rows = []
    asyncio.run(through_mesh(mesh, args.protocol_list[0], sessions(2, args, seed=999), model))  # warm-up
    for c in args.levels:
        warm = sessions(c, args, seed=10_000 + c)  # the level's workload with other prompts: the same contexts
        offline(llm, warm)
        before, t = cpu_seconds(None), time.perf_counter()
        row: dict[str, Any] = {"c": c, "streams": streams, "kvstore": kvstore,
                               "offline": offline(llm, sessions(c, args, seed=c))}  # fmt: skip
        row["offline"]["cpu"] = cpu_use(before, cpu_seconds(None), time.perf_counter() - t)
        for proto in args.protocol_list:
            asyncio.run(through_mesh(mesh, proto, warm, model))
            spies = profilers(mesh, args, f"pyspy-{streams}{'' if kvstore == 'on' else '-nokv'}-{proto}-c{c}")
            before, phases, t = cpu_seconds(mesh), phase_totals(mesh), time.perf_counter()
            row[proto] = asyncio.run(through_mesh(mesh, proto, sessions(c, args, seed=c), model))
            stop_profilers(spies)
            row[proto]["cpu"] = cpu_use(before, cpu_seconds(mesh), time.perf_counter() - t)
            row[proto]["phases"] = phase_use(phases, phase_totals(mesh))
        rows.append(row)
        print(f"[{time.perf_counter() - t0:.0f} s] concurrency {c} done ({variant(row)})", flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--tiny", action="store_true", help="smoke mode: concurrency 1 and 2, 16-token prompts, 4 tokens")
    ap.add_argument("--layers", type=int, default=4, help="layers of the V4-Flash-width model (GPU)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 1,16,64; --tiny: 1,2)")
    ap.add_argument("--protocols", default="grpc,http", help="grpc and/or http")
    ap.add_argument("--replica-streams", default="session", help="session and/or submit: how the balancer sends its "
                    "requests to the scheduler (DEEPINFER_REPLICA_SESSIONS on / off), one mesh each")  # fmt: skip
    ap.add_argument("--kvstore", default="on", help="on and/or off, one mesh each; off: the mesh starts no kvstore "
                    "(`deepinfer up --no-kvstore`), so resume points evicted from the device are dropped as in the "
                    "peer, not offloaded: the mesh's exchange alone")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="write DIR/<date>-mesh-overhead-<device>.json")
    ap.add_argument("--log-level", default="warning", help="the services' DEEPINFER_LOG_LEVEL (their logs stay in the "
                    "run's temporary directory, beside the checkpoint)")  # fmt: skip
    ap.add_argument("--py-spy", type=Path, default=None, help="profile each worker and scheduler over every timed "
                    "mesh run with py-spy (when on PATH) into DIR (it perturbs those runs: profile apart from "
                    "the figures)")  # fmt: skip
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.prompt_len, args.max_tokens = 16, 4
    args.concurrency = args.concurrency or ("1,2" if args.tiny else "1,16,64")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.protocol_list = [p for p in args.protocols.split(",") if p]
    if not set(args.protocol_list) <= {"grpc", "http"}:
        ap.error(f"--protocols: grpc and/or http, got {args.protocols!r}")
    args.stream_list = [p for p in args.replica_streams.split(",") if p]
    args.kvstore_list = [k for k in args.kvstore.split(",") if k]
    if not args.kvstore_list or not set(args.kvstore_list) <= {"on", "off"}:
        ap.error(f"--kvstore: on and/or off, got {args.kvstore!r}")
    if not args.stream_list or not set(args.stream_list) <= {"session", "submit"}:
        ap.error(f"--replica-streams: session and/or submit, got {args.replica_streams!r}")
    return args


def variant(row: dict[str, Any]) -> str:
    """The mesh a row measured: the balancer's stream to its replica, and whether the mesh had its kvstore."""
    return row["streams"] + ("" if row.get("kvstore", "on") == "on" else ", no kvstore")


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"workload: c requests x {args.prompt_len} prompt tokens, {args.max_tokens} greedy output tokens, "
          f"all started together; {args.device}")  # fmt: skip
    print("| c | path | tokens/s | × peer | TPOT p50 ms | ITL p99 ms | TTFT p50 ms | stalls > 1 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        off = r["offline"]
        print(f"| {r['c']} | in-process engine (peer) | {off['output_throughput']:.0f} | 1.00 | "
              f"{off['step_p50_ms']:.2f} | {off['step_p99_ms']:.2f} | — | — |")  # fmt: skip
        for proto in args.protocol_list:
            m = r[proto]
            ratio = m["output_throughput"] / off["output_throughput"]
            lat = f"{m.get('median_tpot_ms', 0):.2f} | {m.get('p99_itl_ms', 0):.2f} | {m.get('median_ttft_ms', 0):.1f}"
            print(f"| {r['c']} | mesh, {proto} ({variant(r)}) | {m['output_throughput']:.0f} | {ratio:.2f} | {lat} | "
                  f"{m['stalls_over_1ms']} |")  # fmt: skip
    print("\nCPU per process over each timed run (1.0: one core busy throughout)")
    for r in rows:
        for path in ["offline", *args.protocol_list]:
            cpu = r[path].get("cpu", {})
            print(f"  c={r['c']} {path} ({variant(r)}): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    print("\nStep phases over each timed run (mean ms, times run): the worker's launch / finish / starved (no step on "
          "the device, no plan), the scheduler's plan / deliver")  # fmt: skip
    for r in rows:
        for proto in args.protocol_list:
            ph = r[proto].get("phases", {})
            print(f"  c={r['c']} {proto} ({variant(r)}): " + ", ".join(
                f"{k} {v['mean_ms']:.3f} ({v['n']})" if "mean_ms" in v else f"{k} {v['n']}" for k, v in ph.items()
            ))  # fmt: skip


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mesh-overhead-"))
    t0 = time.perf_counter()
    model = served_checkpoint(tmp, args.device, args.layers)
    print(f"[{time.perf_counter() - t0:.0f} s] checkpoint written: {model}", flush=True)
    accelerator = "cpu" if args.device == "cpu" else "nvidia"
    tokens = args.prompt_len + args.max_tokens
    page_size = SERVED_PAGE_SIZE[args.device]
    pages = max(args.levels) * -(-tokens // page_size) + 64
    settings = {"DEEPINFER_PAGE_SIZE": str(page_size), "DEEPINFER_NUM_PAGES": str(pages),
                "DEEPINFER_MAX_NUM_SEQS": str(max(args.levels))}  # fmt: skip
    os.environ.update(settings)  # the in-process engine reads the same settings as the mesh's services
    os.environ["DEEPINFER_KVSTORE_DIR"] = str(tmp / "kvstore")
    dtype = "float32" if args.device == "cpu" else "auto"
    if args.device == "cpu":  # the compute threads the launcher gives the mesh's cpu worker
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    llm = LLM(model=model, dtype=dtype, accelerator=accelerator, async_scheduling=True, num_pages=pages,
              page_size=page_size, max_num_seqs=max(args.levels))  # fmt: skip
    llm.generate([{"prompt_token_ids": [0, 5, 6]}], SamplingParams(max_tokens=2))  # warm-up
    print(f"[{time.perf_counter() - t0:.0f} s] in-process engine ready", flush=True)
    path = os.pathsep.join(p for p in (str(ROOT / "libs"), str(ROOT), os.environ.get("PYTHONPATH")) if p)  # (+ ours)
    env = {"PYTHONPATH": path, "DEEPINFER_LOG_LEVEL": args.log_level}
    rows: list[dict[str, Any]] = []
    for streams, kv in [(s, k) for s in args.stream_list for k in args.kvstore_list]:  # one mesh each (the
        sessions_on = "1" if streams == "session" else "0"  # balancer reads DEEPINFER_REPLICA_SESSIONS at its start)
        http_port = free_port("127.0.0.1") if "http" in args.protocol_list else 0
        logs = tmp / f"logs-{streams}-kvstore-{kv}"  # each mesh's service logs (``--log-level``), kept
        logs.mkdir()
        mesh = Mesh(model, grpc_port=0, http_port=http_port, log_dir=logs, accelerator=accelerator,
                    kvstore=kv == "on",
                    extra_env=env | settings | {"DEEPINFER_REPLICA_SESSIONS": sessions_on})  # fmt: skip
        try:
            mesh.start()
            print(f"[{time.perf_counter() - t0:.0f} s] mesh serving ({streams}, kvstore {kv}, logs {logs})", flush=True)
            rows += measure(mesh, llm, args, model.name, t0, streams, kv)
        finally:
            mesh.stop()
    report(args, rows)
    if args.out:
        res = {"date": time.strftime("%Y-%m-%d"), "command": command_line(), "git": git_commit(),
               "device": args.device, "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
               "mesh_over_inprocess": {str(r["c"]): r[args.protocol_list[0]]["output_throughput"]
                                       / r["offline"]["output_throughput"]
                                       for r in rows if r["streams"] == args.stream_list[0]
                                       and r["kvstore"] == args.kvstore_list[0]}}  # fmt: skip
        if "off" in args.kvstore_list:  # the mesh without its kvstore: the exchange alone
            res["mesh_no_kvstore_over_inprocess"] = {
                str(r["c"]): r[args.protocol_list[0]]["output_throughput"] / r["offline"]["output_throughput"]
                for r in rows if r["streams"] == args.stream_list[0] and r["kvstore"] == "off"}  # fmt: skip
        write_json(args.out / f"{res['date']}-mesh-overhead-{args.device}.json", res)


if __name__ == "__main__":
    main()
