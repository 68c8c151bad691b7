"""Decode step time of the offline engine, synchronous against async scheduling, beside the roofline.

``bench/engine/sweep.py`` times the model's decode step alone (``model(ForwardBatch)`` + logits, with a wait before and
after). This times what the engine serves: ``LLMEngine.step()`` with the real scheduler, ``ModelRunner`` (the
sampler, the host copy of the tokens) and detokenisation, on the sweep's model (V4-Flash widths, ``--layers``
layers, native FP8 / MXFP4 weights, random values). ``B`` requests with distinct random ``--context``-token
prompts are prefilled through the engine; once every request decodes, ``--steps`` engine steps are timed (device
synchronised at both ends): ms per step = the inter-token latency every request sees.

* **sync** (the peer): plan, run, wait for the tokens, apply; the device idles while the host works.
* **async** (``async_scheduling=True``, the default): step N+1 is planned and launched before step N's tokens are
  collected (placeholders read on the device), so the host's work hides behind the device's.

Both decode the same prompts with the same parameters (``--mix``). The roofline is the sweep's (``Work.decode``:
dense bytes, expected distinct experts, KV at the context, measured copy GB/s). Each batch size first gets a
throwaway run (``--warm-steps``): the first steps at a new batch size compile Triton kernels and capture the decode
graphs, seconds that would land in whichever mode ran first. The JSON records the Triton compiles of the warm pass
and of each timed run (none expected), the graph replays, and with ``--profile`` / ``--sync-census`` a cProfile of
the timed steps and the calls that made the host wait for the GPU.

    PYTHONPATH=libs:. python bench/engine/engine_decode.py --batches 1,16,64 --out bench/results
    PYTHONPATH=libs:. python bench/engine/engine_decode.py --tiny --device cpu --batches 1,4 --context 128
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch  # noqa: E402

from bench import harness
from bench.engine import sweep
from deepinfer.engine.engine import LLMEngine  # noqa: E402
from deepinfer.engine.factory import build_scheduler  # noqa: E402
from deepinfer.engine.models import family_of  # noqa: E402
from deepinfer.engine.worker import ModelRunner  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.quant.native import prepare_native  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from deepinfer.tokenizer import load_tokenizer  # noqa: E402

MIXES = {
    "greedy": dict(temperature=0),
    "topk50_topp0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "t1_seeded": dict(temperature=1.0),  # (seeded: every request's seed is --seed)
}


def run_engine(
    model, cache, dev, config, tok, b: int, args, async_scheduling: bool, steps: int, constraint: Any = None
) -> dict[str, Any]:
    """Prefill ``b`` requests through the engine, then time ``steps`` decode steps of all ``b`` (each request under
    ``constraint``, an ``engine.constraint.Constraint``, where given: ``bench/engine/structured_outputs.py``)."""
    total = args.warmup + steps + 3 + prefill_steps(b, args)  # the first requests decode while the last prefill
    sched = build_scheduler(config, cache.num_pages, cache.page_size, args.context + total + 1, max_num_seqs=b,
                            max_num_batched_tokens=max(args.chunk, b), prefix_caching=False)  # fmt: skip
    runner = ModelRunner(model, cache, dev, family=family_of(model.config))
    if constraint is not None:
        from deepinfer.engine.factory import constraint_set

        runner.constraints = constraint_set(None, config)
    engine = LLMEngine(sched, runner, tok, config.vocab_size, async_scheduling=async_scheduling)
    rng = random.Random(args.seed)
    params = SamplingParams(**MIXES[args.mix], max_tokens=total, ignore_eos=True, seed=args.seed)
    for i in range(b):
        prompt = [rng.randrange(2, config.vocab_size) for _ in range(args.context)]
        engine.add_request(f"r{i}", prompt, params, constraint=constraint)
    t = time.perf_counter()
    before = 0
    while min(len(r.output_token_ids) for r in sched.requests.values()) < args.warmup:  # prefill, then warm up
        engine.step()
        before += 1
    harness.sync(dev)
    prefill_s = time.perf_counter() - t
    graphs = getattr(model, "decode_graphs", None)
    replays = graphs.replays if graphs is not None else 0
    prof = cProfile.Profile() if b in args.profile else None
    shapes: list[tuple[int, int]] = []  # (sequences, tokens) of each step launched while timed
    launch = runner.launch
    runner.launch = lambda plan: shapes.append((len(plan.chunks), plan.num_tokens)) or launch(plan)
    compiles = triton_compiles()
    pauses: list[tuple[int, float]] = []  # (generation, ms) of each garbage collection in the timed steps
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], 1e3 * (time.perf_counter() - gc_start[0])))

    gc.callbacks.append(on_gc)
    marks = []
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    try:
        for _ in range(steps):
            engine.step()
            marks.append(time.perf_counter())
        harness.sync(dev)
    finally:
        compiled = compiles()
        runner.launch = launch
        gc.callbacks.remove(on_gc)
    ms = 1e3 * (time.perf_counter() - t) / steps
    each = [1e3 * (b - a) for a, b in zip([t, *marks], marks)]
    if any(sh != (b, b) for sh in shapes) or len(shapes) != steps:
        print(f"-- B={b} async={async_scheduling}: timed steps were not all {b}-row decode steps: {shapes}", flush=True)
    out = {"ms": ms, "prefill_and_warmup_s": prefill_s, "steps_before": before, "triton_compiles": compiled,
           "step_shapes": sorted(set(shapes)), "step_ms_median": statistics.median(each), "step_ms_max": max(each),
           "gc_pauses_ms": [(g, round(p, 3)) for g, p in pauses]}  # fmt: skip
    if compiled:
        print(f"-- B={b} async={async_scheduling}: {len(compiled)} Triton compiles in the timed steps:", flush=True)
        for c in compiled:
            print("   ", c, flush=True)
    if prof is not None:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        out["host_profile"] = buf.getvalue()[-12000:]
        print(f"-- B={b} async={async_scheduling}: cProfile of {steps} steps\n{out['host_profile']}", flush=True)
    graphs = getattr(model, "decode_graphs", None)
    out["graph_replays"] = (graphs.replays if graphs is not None else 0) - replays
    if args.sync_census and dev.type == "cuda":
        out["host_waits"] = host_waits(engine)
        print(f"-- B={b} async={async_scheduling}: host waits in 2 steps: {out['host_waits']}", flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def prefill_steps(b: int, args) -> int:
    """Steps the engine takes to prefill ``b`` prompts of ``--context`` tokens, at most (``--chunk`` tokens a step)."""
    return -(-b * (args.context + 1) // args.chunk) + 2


def triton_compiles():
    """Record the Triton kernels compiled from now on (name, constexprs, signature); the returned call stops and
    returns them."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return list
    seen: list[str] = []
    orig = JITFunction._do_compile

    def record(self, key, signature, device, constexprs, *a, **k):
        stack = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(stack[-4:]))
        seen.append(f"{self.fn.__name__} {str(constexprs)[:160]} {str(signature)[:120]} at {where}")
        return orig(self, key, signature, device, constexprs, *a, **k)

    JITFunction._do_compile = record

    def stop() -> list[str]:
        JITFunction._do_compile = orig
        return seen

    return stop


def host_waits(engine: LLMEngine) -> list[str]:
    """Every call that makes the host wait for the GPU in two engine steps (``set_sync_debug_mode``), with the
    repository's frames that led to it."""
    seen: list[str] = []

    def show(message, *_a, **_k):
        frames = [f for f in traceback.extract_stack() if "/deepinfer/" in f.filename or "bench/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in reversed(frames[-5:]))
        seen.append(f"{str(message)[:60]} at {where}")

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    return seen


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--v41", action="store_true", help="DeepSeek-V4.1 (bench/engine/sweep_v41.py's model) instead of V4"
    )
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before timing (graph captures)")
    ap.add_argument("--warm-steps", type=int, default=8, help="a throwaway run of this many steps per batch first")
    ap.add_argument("--chunk", type=int, default=4096, help="the scheduler's token budget per step (prefill)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--mix", choices=sorted(MIXES), default="greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=ints, default=[], help="batch sizes whose timed steps run under cProfile")
    ap.add_argument("--modes", type=lambda x: x.split(","), default=["sync", "async"], help="run order per batch")
    ap.add_argument("--sync-census", action="store_true", help="list the calls that wait for the GPU in 2 steps")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sweep_argv = ["--context", str(args.context), "--page-size", str(args.page_size), "--no-peer"]
    sweep_argv += ["--tiny"] if args.tiny else []
    sweep_argv += ["--layers", str(args.layers)] if args.layers else []
    return args, sweep.parse_args(sweep_argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, sargs = parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.v41:  # bench/engine/sweep_v41.py's model: DeepSeek-V4.1 at Flash width
        from bench.engine import sweep_v41

        ns = argparse.Namespace(tiny=args.tiny, layers=args.layers or 4, context=args.context)
        config = sweep_v41.build_config(ns)
        work, build = sweep_v41.Work(config), sweep_v41.build_ours
    else:
        config = sweep.build_config(sargs)
        work, build = sweep.Work.of(config), sweep.build_ours
    res: dict[str, Any] = {
        **harness.result_header(dev, args),
        "model": work.summary() if hasattr(work, "summary") else {"v41": True},
    }
    with torch.no_grad():
        ce = sweep.probe_ceilings(dev)
        res["ceilings"] = ce
        bw = ce["hbm_copy_GBps"] * 1e9
        peak = max(ce["fp8_TFLOPs"] or 0.0, ce["bf16_TFLOPs"]) * 1e12
        model = build(config, dev, args.seed)
        if getattr(model.ops, "native_weights", False):
            prepare_native(model, tuple(config.weight_block_size), quantize=True)
        model.ops.prepare_weights(model)
    tok = load_tokenizer()
    longest = args.context + args.warmup + max(args.steps, args.warm_steps) + prefill_steps(max(args.batches), args) + 8
    pages_per_seq = -(-longest // args.page_size)
    cache = PagedKVCache(config, max(args.batches) * pages_per_seq + 2, args.page_size, torch.bfloat16, dev)
    rows = []
    for b in args.batches:
        row: dict[str, Any] = {"batch": b, **work.decode(b, args.context, bw, peak)}
        if args.warm_steps:  # the first steps at a new batch size compile kernels and capture graphs (~3-7 s)
            warm = run_engine(model, cache, dev, config, tok, b, args, args.modes[0] == "async", args.warm_steps)
            row["warm_pass_compiles"] = len(warm["triton_compiles"])
            sweep.free(dev)
        for mode in args.modes:
            flag = mode == "async"
            r = run_engine(model, cache, dev, config, tok, b, args, flag, args.steps)
            row[f"{mode}_ms"] = r["ms"]
            row[f"{mode}_x_roofline"] = r["ms"] / row["roofline_ms"]
            row[f"{mode}_prefill_s"] = r["prefill_and_warmup_s"]
            row[f"{mode}_graph_replays"] = r["graph_replays"]
            row[f"{mode}_timed_compiles"] = len(r["triton_compiles"])
            row[f"{mode}_step_ms_median"], row[f"{mode}_step_ms_max"] = r["step_ms_median"], r["step_ms_max"]
            row[f"{mode}_gc_pauses_ms"] = r["gc_pauses_ms"]
            if "host_profile" in r:
                row[f"{mode}_host_profile"] = r["host_profile"]
            sweep.free(dev)
        for m in args.modes:
            sweep.log(f"B={b} {m}: step median {row[f'{m}_step_ms_median']:.3f} ms, max {row[f'{m}_step_ms_max']:.3f} "
                      f"ms; collections (generation, ms): {row[f'{m}_gc_pauses_ms']}")  # fmt: skip
        sweep.log(f"B={b}: sync {row['sync_ms']:.3f} ms, async {row['async_ms']:.3f} ms, roofline "
                  f"{row['roofline_ms']:.3f} ms ({row['sync_x_roofline']:.2f}x / {row['async_x_roofline']:.2f}x); "
                  f"graph replays {row['sync_graph_replays']} / {row['async_graph_replays']}")  # fmt: skip
        rows.append(row)
    res["decode"] = rows
    table = ["| batch | roofline ms | sync ms (× roofline) | async ms (× roofline) |", "|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['batch']} | {r['roofline_ms']:.3f} | {r['sync_ms']:.3f} ({r['sync_x_roofline']:.2f}×) | "
                     f"{r['async_ms']:.3f} ({r['async_x_roofline']:.2f}×) |")  # fmt: skip
    harness.write_result(args.out, args.name or f"{res['date']}-engine-decode", res, table)
    return res


if __name__ == "__main__":
    main()
