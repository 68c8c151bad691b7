"""Structured outputs: the per-token mask cost and the decode step time (TPOT) with and without a JSON schema.

Two loops at batch 1 / 32 / 64, each once unconstrained (the peer, same run, same weights) and once with every
request under a JSON schema whose language is finite but long (an array of ``--items`` objects with bounded strings
and integers, compact JSON), seeded sampling at temperature 1:

- **served** (what a user sees): ``LLMEngine.step()`` with async scheduling (``bench/engine/engine_decode.py``'s
  ``run_engine``): ``B`` requests of ``--prompt`` random tokens prefilled, then ``--steps`` decode steps timed, ms
  a step. A constrained step is launched before the previous step's tokens reach the host; its masks are filled
  when the sampler needs them, behind the forward (``engine.pending_tokens``);
- **synchronous**: the scheduler and model runner with a device wait around each step (``decode``): the step's own
  cost, the mask fill included where it does not hide behind the forward.

Reported per batch: both loops' step with and without the schema and the served overhead in % of the plain step
(target: ≤ 3%), the mask fill (the constraint set's ``fill`` for the batch's rows, on the CPU) measured on its own,
and the HBM roofline of the decode step (sweep's ``Work.decode``, ceilings measured in the run).

CPU (the tiny config)::

    PYTHONPATH=libs:. python bench/engine/structured_outputs.py --tiny --device cpu --out bench/results

GPU (V4-Flash width, ``--layers`` layers, bf16, random weights)::

    PYTHONPATH=libs:. python bench/engine/structured_outputs.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import harness
from bench.engine import engine_decode, sweep
from deepinfer.engine import pending_tokens  # noqa: E402
from deepinfer.engine.constraint import Constraint  # noqa: E402
from deepinfer.engine.factory import constraint_set  # noqa: E402
from deepinfer.engine.models import family_of  # noqa: E402
from deepinfer.engine.pages import PagePool  # noqa: E402
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from deepinfer.engine.worker import ModelRunner  # noqa: E402
from deepinfer.grammar import Compiler, GrammarSpec  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from deepinfer.serving.server import tune_interpreter  # noqa: E402
from deepinfer.tokenizer import load_tokenizer  # noqa: E402


def schema(items: int) -> dict:
    item = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "qty": {"type": "integer", "minimum": 0, "maximum": 99999},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        },
        "required": ["name", "qty", "ok", "kind"],
        "additionalProperties": False,
    }
    return {"type": "object", "properties": {"items": {"type": "array", "items": item, "minItems": items,
            "maxItems": items}}, "required": ["items"], "additionalProperties": False}  # fmt: skip


def decode(model, args, dev, batch: int, constraint: Constraint | None) -> dict:
    """Median decode step (ms) of ``batch`` sequences, and how many tokens they produced."""
    c, ps = model.config, args.page_size
    total = args.prompt + args.tokens + ps
    pages = batch * -(-total // ps) + 4
    runner = ModelRunner(model, PagedKVCache(c, pages, ps, torch.bfloat16, dev), dev, family=family_of(model.config))
    runner.constraints = constraint_set(None, c)
    cfg = SchedulerConfig(page_size=ps, max_model_len=total + ps, eos_token_id=c.eos_token_id, max_num_seqs=batch,
                          max_num_batched_tokens=max(batch * args.prompt, 2048), prefix_caching=False)  # fmt: skip
    sched = Scheduler(cfg, PagePool(pages))
    rng = random.Random(args.seed)
    for i in range(batch):
        prompt = [rng.randrange(2, c.vocab_size) for _ in range(args.prompt)]
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=args.tokens, ignore_eos=True)
        sched.add(f"r{i}", prompt, params, constraint=constraint)
    steps, produced, eos = [], 0, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        decoding = all(len(ch.token_ids) == 1 for ch in plan.chunks)
        harness.sync(dev)
        t0 = time.perf_counter()
        res = runner.execute(plan)
        harness.sync(dev)
        if decoding and plan.chunks:
            steps.append(time.perf_counter() - t0)
        for r in res.results:
            produced += r.token_id is not None
            eos += r.token_id == c.eos_token_id
        for req in sched.update(res):
            sched.pop_finished(req.request_id)
    return {"step_ms": 1e3 * statistics.median(steps[2:] or steps), "tokens": produced, "eos_tokens": eos}


def served(model, args, dev, tok, batch: int, constraint: Constraint | None, profile: bool = False) -> dict:
    """ms per decode step of the async engine at ``batch`` (``engine_decode.run_engine``; a warm pass first); with
    ``profile``, a cProfile of the timed steps (``host_profile``; its timing is not comparable)."""
    ns = argparse.Namespace(warmup=4, context=args.prompt, chunk=max(batch * args.prompt, 2048), seed=args.seed,
                            mix="t1_seeded", profile=[batch] if profile else [], sync_census=False)  # fmt: skip
    longest = args.prompt + ns.warmup + args.steps + engine_decode.prefill_steps(batch, ns) + 8
    cache = PagedKVCache(model.config, batch * -(-longest // args.page_size) + 2, args.page_size, torch.bfloat16, dev)
    engine_decode.run_engine(model, cache, dev, model.config, tok, batch, ns, True, 4, constraint)  # (warm)
    return engine_decode.run_engine(model, cache, dev, model.config, tok, batch, ns, True, args.steps, constraint)


def mask_cost(cs_factory, compiled, batch: int, tokens: int, seed: int) -> tuple[float, float]:
    """Median ms to fill the masks of ``batch`` matchers advancing by random allowed tokens, and to have them accept
    their tokens (both on the host's critical path of a constrained step)."""
    cs = cs_factory()
    rng = random.Random(seed)
    rids = [f"m{i}" for i in range(batch)]
    for rid in rids:
        cs.install(rid, Constraint(compiled))
    fills, accepts = [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        packed = cs.fill(rids)
        fills.append(time.perf_counter() - t0)
        allowed = cs.allowed(packed, cs.vocab_size, "cpu")
        picks = []
        for i in range(batch):
            ids = allowed[i].nonzero().flatten().tolist()
            picks.append(rng.choice(ids) if len(ids) > 1 else ids[0])
        t0 = time.perf_counter()
        for rid, t in zip(rids, picks):
            cs.accept(rid, t)
        accepts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(fills), 1e3 * statistics.median(accepts)


def report(result: dict, args: argparse.Namespace, layers: int) -> str:
    """The result as the markdown table the results folder keeps."""
    rows, compile_ms = result["rows"], result["schema_compile_ms"]
    lines = [f"# structured outputs: TPOT with and without a JSON schema on {result['device']} "
             f"({layers} layers, bf16)", "",
             f"Served: the async engine's decode step ({args.steps} timed) after a {args.prompt}-token prompt; "
             f"synchronous: {args.tokens} decode tokens per sequence, a device wait around each step. Seeded "
             f"sampling at temperature 1; the schema is an array of {args.items} objects (compact JSON, compiled in "
             f"{compile_ms:.0f} ms). Mask fill and accept: the batch's rows on the CPU, measured alone.", "",
             "Held: the schema's steps each held until the previous one is collected (the code before the early "
             "accept, `pending_tokens.EARLY = False`), same run.", "",
             "| batch | served ms (plain, peer) | served ms (schema) | overhead | held ms (overhead) | "
             "synchronous ms (plain / schema) | mask fill ms (batch) | accept ms (batch) | roofline ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} | {r['served_ms']:.2f} | {r['served_schema_ms']:.2f} | "
                     f"{100 * r['served_overhead']:+.1f}% | {r['served_schema_held_ms']:.2f} "
                     f"({100 * r['served_held_overhead']:+.1f}%) | {r['tpot_ms']:.2f} / {r['tpot_schema_ms']:.2f} | "
                     f"{r['mask_fill_ms']:.3f} | {r['accept_ms']:.3f} | {r['roofline_ms']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def host_profiles(model, args, dev, tok, batch: int, constraint: Constraint) -> dict:
    """``--profile``: where the host's time goes in the served steps at ``batch``, plain and under the schema (runs
    of their own after the timed ones: cProfile slows the host, so these runs give no timing)."""
    return {name: served(model, args, dev, tok, batch, c, profile=True)["host_profile"]
            for name, c in (("plain", None), ("schema", constraint))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hash-layers", type=int, default=2)
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens per sequence (synchronous loop)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps of the served loop")
    ap.add_argument("--items", type=int, default=16, help="array items in the schema (its language's length)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="", help="batch sizes whose served steps are also profiled (cProfile)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = sweep.build_config(args)
    model = sweep.build_ours(config, dev, args.seed)
    ceil = sweep.probe_ceilings(dev)
    work = sweep.Work.of(config)
    t0 = time.perf_counter()
    compiled = Compiler(None).compile(GrammarSpec("json_schema", json.dumps(schema(args.items))))
    compile_ms = 1e3 * (time.perf_counter() - t0)
    constraint = Constraint(compiled)
    tune_interpreter()  # the thread switch interval the worker serves with (its mask thread hands over on it)
    tok = load_tokenizer()
    warm = argparse.Namespace(**{**vars(args), "tokens": 4})
    bw = ceil["hbm_copy_GBps"] * 1e9
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for c in (None, constraint):  # both modes' kernels compiled and graphs captured at this batch, untimed
            decode(model, warm, dev, b, c)
        plain = decode(model, args, dev, b, None)
        so = decode(model, args, dev, b, constraint)
        s_plain, s_so = served(model, args, dev, tok, b, None), served(model, args, dev, tok, b, constraint)
        pending_tokens.EARLY = False  # the peer of the early accept: each constrained step held, as before
        try:
            s_held = served(model, args, dev, tok, b, constraint)
        finally:
            pending_tokens.EARLY = True
        fill, accept = mask_cost(lambda: constraint_set(None, config), compiled, b, min(args.tokens, 32), args.seed)
        roof = work.decode(b, args.prompt + args.tokens // 2, bw, ceil["bf16_TFLOPs"] * 1e12)["roofline_ms"]
        rows.append({"batch": b, "served_ms": s_plain["ms"], "served_schema_ms": s_so["ms"],
                     "served_overhead": s_so["ms"] / s_plain["ms"] - 1, "served_schema_held_ms": s_held["ms"],
                     "served_held_overhead": s_held["ms"] / s_plain["ms"] - 1, "served_schema_compiles":
                     len(s_so["triton_compiles"]), "tpot_ms": plain["step_ms"], "tpot_schema_ms": so["step_ms"],
                     "delta_ms": so["step_ms"] - plain["step_ms"], "mask_fill_ms": fill, "accept_ms": accept,
                     "mask_fill_us_per_token": 1e3 * fill / b, "roofline_ms": roof,
                     "schema_eos_tokens": so["eos_tokens"]})  # fmt: skip
        if str(b) in args.profile.split(","):
            rows[-1]["host_profile"] = host_profiles(model, args, dev, tok, b, constraint)
        sweep.log(f"  batch {b}: served {s_plain['ms']:.2f} ms plain, {s_so['ms']:.2f} ms with the schema "
                  f"({s_held['ms']:.2f} ms held); synchronous {plain['step_ms']:.2f} / {so['step_ms']:.2f} ms; "
                  f"mask fill {fill:.3f} ms, accept {accept:.3f} ms")  # fmt: skip
    result = {"device": harness.device_name(dev), "torch": torch.__version__, "layers": config.num_hidden_layers,
              "command": " ".join(sys.argv), "ceilings": ceil, "schema_compile_ms": compile_ms,
              "rows": rows}  # fmt: skip
    text = report(result, args, config.num_hidden_layers)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today().isoformat()}-structured-outputs-{'cpu' if dev.type == 'cpu' else 'gpu'}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        cmd = f"PYTHONPATH=libs:. python {result['command']}"
        (args.out / f"{stem}.md").write_text(text + f"\n\nCommand: `{cmd}`\n")


if __name__ == "__main__":
    main()
