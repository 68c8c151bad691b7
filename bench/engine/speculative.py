"""Speculative decoding's TPOT on the offline engine, with and without drafts, at reduced depth and projected to the
real one.

The model is the sweep's (``--model v4``: V4-Flash widths with its MTP block; ``--model v41``: V4.1-Flash widths,
``bench/engine/sweep_v41.py``, with 3 DSpark stages reading the last 3 layers; native FP8 / MXFP4 weights, random
values), at each depth of ``--depths``. ``B`` requests with distinct random ``--context``-token prompts are
prefilled through the engine (async scheduling, CUDA graphs for plain decode steps); once every request decodes,
the run is timed until each has ``--tokens`` more: TPOT = elapsed / tokens per request. In the same run, per batch size:

* **off** (the peer): plain decoding, one token per step, without logprobs as every other run (the top-2 logprobs
  that ``divergence`` reads come from an untimed run before it: computing them slows a step).
* **oracle e**: ``--drafts`` drafts per sequence and step from ``engine.speculative.oracle``, which replays the
  target's greedy continuation (below) with a draft error rate ``e`` (random weights make the MTP block useless, so
  this sets the acceptance); the tokens emitted per verify step (kept drafts + 1) and the TPOT.
* **mtp**: the model's own drafter (V4: the MTP block; V4.1: DSpark, which also makes every step it follows run
  eagerly with the target's features captured; its measured acceptance on random weights is near 0), whose step time
  less the oracle's at ``e = 1`` (same verify shape, nothing kept) is the drafter's cost per step.
* **policy**: the oracle at the error rate closest to 3 tokens per verify step under the scheduler's default batch
  limit (``DEEPINFER_SPEC_DECODE_MAX_BATCH``: above it the steps run without drafts) and its cost policy
  (``--explore``, the server's default 64: it measures both modes and keeps the cheaper; ``steps_off`` counts both
  reasons), timed after an untimed run of the same whose estimates it starts from (a server's policy has measured
  both modes long before); its oracle judges the drafts itself (``OracleProposer(judged=True)``: a run mixing plain
  and verify steps leaves the replayed continuation at the first near-tie that a plain step's rounding decides the
  other way, and the oracle would be wrong from there on); **policy_mtp**: the same with the model's drafter
  (timed after an untimed run too). The other runs draft at every step.

The verify step's time is set beside its roofline (``sweep.Work.decode`` with ``rows = drafts + 1``: the weights read
once, every row's experts and FLOPs, each sequence's KV once). A reduced-depth target makes drafting look dearer than
it is (one MTP layer against 43 target layers in V4-Flash; 3 DSpark stages against V4.1-Flash's 40), so plain and
verify step times are fitted per layer over the depths measured (``t(L) = a + b·L``) and projected to the real depth
with the drafter's cost, which does not grow with depth: TPOT(L) = (verify(L) + draft) / emitted, against plain(L).

With the default ops a verify row's numbers differ from a plain decode row's by rounding (other GEMM shapes), so
near-ties may go the other way, and an oracle replaying the plain run's tokens would be wrong from there on. The
continuation the oracle replays is therefore a run whose every step is a verify step with every draft wrong (the
oracle at ``e = 1``): a verify step's numbers do not depend on which of its rows a position is, so an oracle run
emits those tokens as long as its steps hold the same sequences as the reference's (a verify step's rounding depends
on its batch: give ``--chunk`` at least batch x context so that every prompt is prefilled in one step and no run
starts in two halves). ``verify_vs_plain`` says where that run's tokens first differ from the plain run's and the top-1
/ top-2 margin there; each speculative run's ``divergence`` compares it with the reference run (none expected; with
``--batch-invariant`` none against the plain run either).

    PYTHONPATH=libs:. python bench/engine/speculative.py --depths 2,4 --batches 1,16,64 --out bench/results/engine
    PYTHONPATH=libs:. python bench/engine/speculative.py --model v41 --depths 4,5 --batches 1,16 --out <dir>
    PYTHONPATH=libs:. python bench/engine/speculative.py --tiny --device cpu [--model v41]

Each run's JSON also says what one-time work fell in its timed window: ``graph_captures`` (the CUDA graph buckets
captured, by kind: a batch bucket or context span met first there, e.g. the smaller batches of a run whose requests
finish at different steps), ``launches_capturing`` and ``tpot_ms_less_captures`` (the TPOT without those launches'
intervals); ``slowest_launch_gaps_ms`` lists ``[ms, step, drafted, captures]``.

``--mixed-ab N`` adds, per batch size, the oracle at the policy's error rate with an ``N``-token prompt joining after
the first timed step (one output token; ``--chunk`` below ``N`` spreads it over several steps), so that steps mix
its chunks with verify rows: run as two forwards (``models/deepseek_v4/verify_split.py``; ``split_steps`` counts
them) and on the ragged path, each's TPOT of the drafting requests (the window holds the prompt's steps too).

``--kernel-profile B`` adds, at batch ``B`` and the largest depth, a plain run and a verify run (every draft wrong)
under ``torch.profiler``: per step, the device's busy time and idle gaps (``bench/host/device_gaps.py``), the kernels
by device time, and the host's launches and syncs (``kernel_profile_off`` / ``kernel_profile_verify`` in the JSON).
With programmatic dependent launch on (``pdl`` in the JSON; Hopper's default), a kernel starts while the one before
it drains and waits there, and the profiler counts that wait as the kernel's time: a short kernel after a long one
looks long. For each kernel's own time profile with ``DEEPINFER_PDL=0``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import io
import os
import pstats
import random
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench import harness
from bench.engine import sweep, sweep_v41
from bench.host.device_gaps import device_gaps
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.factory import build_scheduler
from deepinfer.engine.models import family_of
from deepinfer.engine.speculative.oracle import OracleProposer
from deepinfer.engine.warmup import FixedDrafts, decode_sizes, warm_up
from deepinfer.engine.worker import ModelRunner
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.ops import get_ops
from deepinfer.quant.native import prepare_native
from deepinfer.runtime.decode_graphs import captures_so_far
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer

REAL_DEPTH = {"v4": 43, "v41": 40}  # V4-Flash's and V4.1-Flash's layers


@dataclasses.dataclass
class Setup:
    model: Any
    config: Any
    cache: PagedKVCache
    dev: torch.device
    tok: Any
    args: argparse.Namespace


GRAPH_KINDS = ("decode", "prefill", "verify", "draft", "observe")  # the model's graphs (``runtime.step_graphs``)


def run(
    s: Setup, b: int, drafter: str | float | None, cont: dict | None = None, limit: int = 1 << 30,
    profile: bool = False, explore: int = 0, kernels: bool = False, logprobs: bool = False, late: int = 0,
    judged: bool = False, learned: dict | None = None, learn: dict | None = None,
) -> dict:  # fmt: skip
    """Prefill ``b`` requests, then time ``--tokens`` more tokens each. ``drafter``: None (off; ``logprobs``: with
    the top-2 logprobs, for ``divergence``: not for timing, they slow a step), "mtp", or the oracle's error rate
    (``cont``: its continuations); ``profile``: a cProfile of the timed steps; ``explore``: the scheduler's cost
    policy (0: every step under ``limit`` drafts); ``kernels``: ``torch.profiler`` over the timed steps
    (``kernel_profile``: its times are not the run's); ``late``: a request of that many prompt tokens (one output
    token, not in the TPOT) joins after the first timed step, so that steps mix its prompt chunks with verify rows;
    ``judged``: the oracle decides which drafts are kept (``OracleProposer``: the set acceptance in a run mixing plain
    and verify steps, whose tokens then are not the target's); ``learned``: the cost policy starts from these
    estimates (``learn`` of an earlier run, which this dict receives: a server's policy has measured both modes
    long before)."""
    args, n = s.args, s.args.drafts
    total = args.tokens + 2
    sched = build_scheduler(
        s.config, s.cache.num_pages, s.cache.page_size, max(args.context, late) + total + n + 2,
        max_num_seqs=b + bool(late), max_num_batched_tokens=max(args.chunk, b * (n + 1)), prefix_caching=False,
        num_speculative_tokens=0 if drafter is None else n,
    )  # fmt: skip
    sched.config = dataclasses.replace(sched.config, spec_max_batch=limit, spec_explore=explore)
    sched.spec_policy.explore = explore
    if learned:
        sched.spec_policy.estimates.update(copy.deepcopy(learned))
    runner = ModelRunner(s.model, s.cache, s.dev, family=family_of(s.config))
    family = family_of(s.config)
    if drafter == "mtp":
        runner.spec = family.speculator(s.model, n)
    elif drafter is not None:
        oracle = OracleProposer(cont or {}, float(drafter), s.config.vocab_size, judged=judged)
        runner.spec = family.speculator(s.model, n, oracle)
    engine = LLMEngine(sched, runner, s.tok, s.config.vocab_size, async_scheduling=True)
    rng = random.Random(args.seed)
    prompts = {f"r{i}": [rng.randrange(2, s.config.vocab_size) for _ in range(args.context)] for i in range(b)}
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True, logprobs=2 if logprobs else None)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    while min(len(r.output_token_ids) for r in sched.requests.values()) < 1:
        engine.step()
    harness.sync(s.dev)
    start = {rid: len(r.output_token_ids) for rid, r in sched.requests.items()}
    stats0 = dataclasses.replace(sched.spec)
    launch, steps, marks, captured = runner.launch, [0], [], []
    graphs_before = {k: getattr(s.model, f"{k}_graphs", None) for k in GRAPH_KINDS}
    captures0 = {k: getattr(g, "captures", 0) for k, g in graphs_before.items()}
    total0 = captures_so_far()

    def timed_launch(plan: Any) -> Any:
        steps[0] += 1
        marks.append((time.perf_counter(), any(c.num_drafts for c in plan.chunks)))
        before = captures_so_far()
        try:
            return launch(plan)
        finally:
            captured.append(captures_so_far() - before)  # graph buckets this launch captured

    runner.launch = timed_launch
    outs: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    prof = cProfile.Profile() if profile else None
    tracer = torch.profiler.profile(activities=activities(s.dev)) if kernels else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    if tracer is not None:
        tracer.__enter__()
    joining = [rng.randrange(2, s.config.vocab_size) for _ in range(late)] if late else None
    try:
        while engine.has_unfinished_requests():
            if joining is not None and steps[0] >= 1:
                engine.add_request("late", joining, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                joining = None
            for o in engine.step():
                outs[o.request_id], lps[o.request_id] = o.outputs[0].token_ids, o.outputs[0].logprobs
        harness.sync(s.dev)
    finally:
        runner.launch = launch
        if prof is not None:
            prof.disable()
        if tracer is not None:
            tracer.__exit__(None, None, None)
    elapsed = time.perf_counter() - t
    if learn is not None:
        learn.update(sched.spec_policy.estimates)
    tokens = sum(len(outs[rid]) - start[rid] for rid in prompts) / b
    # where the time went: the launches' spacing (a step's host work and the wait for the one before it), the
    # slowest intervals with whether the step drafted and how many graph buckets its launch captured, and the CUDA
    # graph buckets captured during the timed run, by kind
    gaps = [(1e3 * (b_[0] - a_[0]), i, a_[1], captured[i]) for i, (a_, b_) in enumerate(zip(marks, marks[1:]))]
    kinds = {}
    for k, g0 in graphs_before.items():
        g = getattr(s.model, f"{k}_graphs", None)
        kinds[k] = getattr(g, "captures", 0) - (captures0[k] if g is g0 else 0)
    st = sched.spec
    verifies, kept = st.verifies - stats0.verifies, st.accepted_tokens - stats0.accepted_tokens
    drafted = st.draft_tokens - stats0.draft_tokens
    return {
        "tpot_ms": 1e3 * elapsed / tokens,
        "step_ms": 1e3 * elapsed / max(steps[0], 1),
        "steps": steps[0],
        "tokens_per_seq": tokens,
        "verifies": verifies,
        "emitted_per_verify": (verifies + kept) / verifies if verifies else None,
        "acceptance": kept / drafted if drafted else None,
        "steps_off": st.steps_off - stats0.steps_off,
        "slowest_launch_gaps_ms": [[round(g, 3), i, d, c] for g, i, d, c in sorted(gaps, reverse=True)[:8]],
        "median_launch_gap_ms": {
            "drafts": median([g for g, _, d, _ in gaps if d]),
            "plain": median([g for g, _, d, _ in gaps if not d]),
        },  # fmt: skip
        # the timed run's steps whose launch captured graphs, and its time less those launches' gaps (one-time)
        "launches_capturing": sum(1 for c in captured if c),
        "tpot_ms_less_captures": 1e3 * (elapsed - 1e-3 * sum(g for g, _, _, c in gaps if c)) / tokens,
        "graph_captures": {**kinds, "total": captures_so_far() - total0},
        "policy_estimates": {
            f"{b}/{'on' if d else 'off'}": [e.seconds_per_token, e.samples]
            for (b, d), e in sched.spec_policy.estimates.items()
        },  # fmt: skip
        "continuations": {rid: prompts[rid] + outs[rid] for rid in prompts},
        "logprobs": lps,
        "prompt_len": args.context,
        **({"host_profile": profile_text(prof)} if prof is not None else {}),
        **({"kernel_profile": kernel_profile(tracer, steps[0])} if tracer is not None else {}),
    }


def kernel_profile(tracer: Any, steps: int) -> dict[str, Any]:
    """What the device did in a profiled run's timed steps: busy and idle time per step (``device_gaps``), the
    kernels by device time and the host's launch and sync counts per step."""
    ka = tracer.key_averages()
    key = "self_device_time_total" if on_device(ka) else "self_cpu_time_total"
    gaps = device_gaps(tracer) if on_device(ka) else {}
    counts = {tag: round(sum(e.count for e in ka if tag in e.key) / max(steps, 1), 1)
              for tag in ("LaunchKernel", "cudaGraphLaunch", "cudaStreamSynchronize", "cudaMemcpyAsync")}  # fmt: skip
    # the union of the kernels' intervals where the trace has them (the table's sum counts an op and its kernel twice)
    busy = gaps["busy_ms"] if gaps else sum(getattr(e, "self_device_time_total", 0.0) for e in ka) / 1e3
    from deepinfer.kernels import pdl  # (Triton: only where a run is profiled)

    return {
        "steps": steps,
        "pdl": bool(pdl.launch()),  # True: a kernel's time includes its wait for the kernel before it
        "device_busy_ms_per_step": round(busy / max(steps, 1), 3),
        "gaps": gaps,
        "counts_per_step": counts,
        "table": ka.table(sort_by=key, row_limit=45, max_name_column_width=70),
    }


def on_device(ka: Any) -> bool:
    return any(getattr(e, "self_device_time_total", 0.0) for e in ka)


def activities(dev: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])


def median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def profile_text(prof: cProfile.Profile) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    return buf.getvalue()[-16000:]


def divergence(off: dict, run_: dict) -> dict:
    """Where a run's greedy tokens first leave the plain run's, per request, and the plain run's margin there (its
    top-1 minus top-2 logprob: a near-tie means rounding between a verify row and a decode row, not a defect)."""
    n0, firsts, margins = off["prompt_len"], [], []
    for rid, want in off["continuations"].items():
        got = run_["continuations"][rid]
        k = next((i for i, (x, y) in enumerate(zip(want[n0:], got[n0:])) if x != y), None)
        if k is None:
            continue
        firsts.append(k)
        top = sorted((off["logprobs"].get(rid) or [{}])[k].values(), reverse=True) if off["logprobs"].get(rid) else []
        margins.append(top[0] - top[1] if len(top) > 1 else None)
    return {"diverged": len(firsts), "of": len(off["continuations"]), "first_at": firsts[:16],
            "margins": [None if m is None else round(m, 5) for m in margins[:16]]}  # fmt: skip


def build(args: argparse.Namespace, depth: int, dev: torch.device) -> Setup:
    if args.model == "v41":
        config = sweep_v41.build_config(argparse.Namespace(layers=depth, tiny=args.tiny), dspark=3)
    else:
        sargs = sweep.parse_args(["--context", str(args.context), "--no-peer", "--layers", str(depth)]
                                 + (["--tiny"] if args.tiny else []))  # fmt: skip
        base = sweep.build_config(sargs)
        config = dataclasses.replace(base, num_nextn_predict_layers=1, compress_ratios=(*base.compress_ratios, 0))
    with torch.no_grad():
        if args.model == "v41":  # (quantized part by part: the bf16 model does not fit)
            model = sweep_v41.build_ours(config, dev, args.seed, tuple(config.weight_block_size))
        else:
            model = sweep.build_ours(config, dev, args.seed)
        if args.verify_attention is not None:
            model.verify_fused = args.verify_attention == "fused"
        args.verify_attention = "fused" if model.verify_fused else "substeps"
        if args.batch_invariant:  # the check: tokens with drafts equal to plain decoding's, bit for bit
            model.ops = get_ops("nvidia" if dev.type == "cuda" else "cpu", batch_invariant=True)
        if getattr(model.ops, "native_weights", False):
            prepare_native(model, tuple(config.weight_block_size), quantize=True)
        model.ops.prepare_weights(model)
    longest = args.context + args.tokens + 2 * args.drafts + 8
    pages = max(args.batches) * -(-longest // args.page_size) + 2
    pages += -(-(args.mixed_ab + 2) // args.page_size) if args.mixed_ab else 0  # (the prompt that joins)
    cache = PagedKVCache(config, pages, args.page_size, torch.bfloat16, dev)
    return Setup(model, config, cache, dev, load_tokenizer(), args)


def warm_graphs(s: Setup, args: argparse.Namespace) -> None:
    """The worker's start-up warm-up (``engine.warmup``, as a server runs it): the decode graphs of every bucket up
    to the largest batch and, for the batches that may draft, the verify steps' piecewise graphs, so that no timed
    run pays a capture (a verify step of a bucket first met in a timed run cost 5 s on the H200)."""
    family = family_of(s.config)
    runner = ModelRunner(s.model, s.cache, s.dev, family=family)
    sizes = decode_sizes(max(args.batches), 256, family.decode_buckets)
    verifier = family.speculator(s.model, args.drafts, FixedDrafts())
    limit = args.context + args.tokens + 2 * args.drafts + 8
    report = warm_up(runner, s.cache.num_pages, s.cache.page_size, limit, s.config.vocab_size, sizes, (),
                     verifier, [b for b in sizes if b <= args.limit])  # fmt: skip
    sweep.log(f"warm-up: {', '.join(f'{k} {v:.2f} s' for k, v in report.items())}")


def fit(xs: list[int], ys: list[float], at: int) -> tuple[float, float, float]:
    """Least squares ``y = a + b·x`` over the depths measured: ``(a, b, y(at))``."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var and n > 1 else 0.0
    a = my - slope * mx
    return a, slope, a + slope * at


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ints = lambda x: [int(v) for v in x.split(",") if v]  # noqa: E731
    floats = lambda x: [float(v) for v in x.split(",") if v]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", choices=["v4", "v41"], default="v4", help="V4-Flash (MTP) or V4.1-Flash (DSpark) widths")
    ap.add_argument("--depths", type=ints, default=None, help="target layers of each model (default 2,4; tiny 2,3)")
    ap.add_argument("--batches", type=ints, default=None, help="default 1,16,64; tiny 1,2")
    ap.add_argument("--errors", type=floats, default=None, help="oracle error rates (default 0,.2,.4,.7,1; tiny 0,1)")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--context", type=int, default=None, help="prompt tokens (default 1024; tiny 32)")
    ap.add_argument("--tokens", type=int, default=None, help="timed tokens per request (default 64; tiny 6)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--limit", type=int, default=32, help="the scheduler's default DEEPINFER_SPEC_DECODE_MAX_BATCH")
    ap.add_argument("--explore", type=int, default=64, help="the policy run's DEEPINFER_SPEC_DECODE_EXPLORE_STEPS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true", help="the batch-invariant op set (a correctness run)")
    ap.add_argument(
        "--verify-attention",
        choices=["fused", "substeps"],
        default=None,
        help="a verify step's attention: one call per layer, or in sub-steps (default: the model's)",
    )
    ap.add_argument("--profile", type=ints, default=[], help="batch sizes to cProfile (2nd-rate oracle, drafter)")
    ap.add_argument("--kernel-profile", type=ints, default=[], help="batch sizes to torch.profile (off, verify)")
    ap.add_argument("--early-ab", action="store_true", help="also time the drafter with DEEPINFER_SPEC_EARLY_DRAFTS=0")
    ap.add_argument(
        "--mixed-ab",
        type=int,
        default=0,
        help="a prompt of this many tokens joins the timed run: its steps as two forwards and ragged",
    )
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    low = 4 if args.model == "v41" else 2  # (V4.1's bench model has 4 layer kinds)
    args.depths = args.depths or ([low, low + 1] if args.tiny else [low, low + 2])
    args.batches = args.batches or ([1, 2] if args.tiny else [1, 16, 64])
    args.errors = args.errors or ([0.0, 1.0] if args.tiny else [0.0, 0.2, 0.4, 0.7, 1.0])
    args.context = args.context or (32 if args.tiny else 1024)
    args.tokens = args.tokens or (6 if args.tiny else 64)
    args.page_size = args.page_size or (16 if args.tiny else 256)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res: dict[str, Any] = {**harness.result_header(dev, args), "drafts": args.drafts, "context": args.context,
                           "model": args.model, "real_depth": REAL_DEPTH[args.model]}  # fmt: skip
    ce = sweep.probe_ceilings(dev)
    bw, peak = ce["hbm_copy_GBps"] * 1e9, max(ce["fp8_TFLOPs"] or 0.0, ce["bf16_TFLOPs"]) * 1e12
    res["ceilings"] = ce
    rows: list[dict[str, Any]] = []
    for depth in args.depths:
        s = build(args, depth, dev)
        res["verify_attention"] = args.verify_attention  # (build sets the model's default)
        if dev.type == "cuda":  # (as the factory: a CPU has nothing to compile or capture)
            warm_graphs(s, args)
        work = sweep_v41.Work(s.config) if args.model == "v41" else sweep.Work.of(s.config)
        for b in args.batches:
            # the plain run with its top-2 logprobs (for ``divergence``; on a GPU also the warm-up: graphs at this
            # batch), then the timed plain run without them, as the speculative runs (a vLLM user's default)
            lp = run(s, b, None, logprobs=True)
            if dev.type == "cuda":  # warm: kernels of the verify shapes, the drafter's graphs
                try:
                    run(s, b, 0.5, lp["continuations"])
                    run(s, b, "mtp")
                except Exception:
                    pass  # measure() records it
            off = run(s, b, None)
            off["logprobs"] = lp["logprobs"]
            same = off["continuations"] == lp["continuations"]  # (greedy: logprobs change no token)
            # every step a verify step, every draft wrong: the target's greedy tokens under the verify step's numbers,
            # which the oracle replays (rounding differs from a plain step's: near-ties may go the other way)
            ref = run(s, b, 1.0, off["continuations"])
            cont = ref["continuations"]
            row: dict[str, Any] = {"depth": depth, "batch": b, "off": off, "_off": ref, "logprobs_same_tokens": same}
            row["verify_vs_plain"] = divergence(off, ref)
            if b in args.kernel_profile and depth == max(args.depths):  # a plain and a verify step's device time
                for key, drafter in (("off", None), ("verify", 1.0)):
                    got = run(s, b, drafter, cont, kernels=True)
                    row[f"kernel_profile_{key}"] = got["kernel_profile"]
                    print(f"-- L={depth} B={b} {key}: kernels\n{got['kernel_profile']['table']}", flush=True)
            row["plain_roofline_ms"] = work.decode(b, args.context, bw, peak)["roofline_ms"]
            row["verify_roofline_ms"] = work.decode(b, args.context, bw, peak, rows=args.drafts + 1)["roofline_ms"]
            try:
                measure(s, b, row, cont, args)
            except Exception:  # record what failed, keep the rows measured so far
                row["error"] = traceback.format_exc()[-4000:]
                print(row["error"], flush=True)
            off.pop("continuations"), off.pop("logprobs"), row.pop("_off")
            rows.append(row)
            sweep.free(dev)
        del s
        sweep.free(dev)
        res["rows"] = rows  # written after each depth: a later failure keeps what was measured
        res["projection"] = project([r for r in rows if "error" not in r], args)
        name = args.name or f"{res['date']}-speculative{'-v41' if args.model == 'v41' else ''}"
        harness.write_result(args.out, name, res, table(res, args))
    return res


def policy_run(
    s: Setup, b: int, drafter: str | float, cont: dict, args: argparse.Namespace, judged: bool = False
) -> dict:
    """The cost policy's run, timed after an untimed one whose estimates it starts from (a server's policy has
    measured both modes long before)."""
    learned: dict = {}
    run(s, b, drafter, cont, args.limit, explore=args.explore, judged=judged, learn=learned)
    return run(s, b, drafter, cont, args.limit, explore=args.explore, judged=judged, learned=learned)


def measure(s: Setup, b: int, row: dict[str, Any], cont: dict, args: argparse.Namespace) -> None:
    """The speculative runs of one batch size (``row`` has the plain one)."""
    off, depth = row["off"], row["depth"]
    for e in args.errors:
        r = run(
            s,
            b,
            e,
            cont,
            profile=b in args.profile and depth == max(args.depths) and e == args.errors[min(1, len(args.errors) - 1)],
        )
        r["divergence"] = divergence(row["_off"], r)
        r.pop("continuations"), r.pop("logprobs")
        row[f"oracle_{e:g}"] = r
        if "host_profile" in r:
            print(f"-- L={depth} B={b} e={e:g}: cProfile of the timed steps\n{r['host_profile']}", flush=True)
    nearest = min(args.errors, key=lambda e: abs((row[f"oracle_{e:g}"]["emitted_per_verify"] or 0) - 3))
    # the policy's run: its oracle judged (a plain step's rounding would send the sequences off the continuation)
    policy = policy_run(s, b, nearest, cont, args, judged=True)
    policy.pop("continuations"), policy.pop("logprobs")
    row["policy"] = {"error": nearest, "limit": args.limit, "judged": True, **policy}
    if args.mixed_ab:
        row["mixed"] = mixed_ab(s, b, nearest, cont, args.mixed_ab)
        sweep.log(f"L={depth} B={b}: a {args.mixed_ab}-token prompt joining, e={nearest:g}: split "
                  f"{row['mixed']['split']['tpot_ms']:.3f} ms/token ({row['mixed']['split_steps']} steps split), "
                  f"ragged {row['mixed']['ragged']['tpot_ms']:.3f}")  # fmt: skip
    worst = row[f"oracle_{max(args.errors):g}"]
    row["verify_step_ms"] = worst["step_ms"]
    try:  # the model's own drafter (a failure there keeps the oracle's rows)
        mtp = run(s, b, "mtp", profile=b in args.profile and depth == max(args.depths))
        if "host_profile" in mtp:
            print(f"-- L={depth} B={b} drafter: cProfile of the timed steps\n{mtp['host_profile']}", flush=True)
        mtp["divergence"] = divergence(row["_off"], mtp)
        mtp.pop("continuations"), mtp.pop("logprobs")
        policy_mtp = policy_run(s, b, "mtp", cont, args)
        policy_mtp.pop("continuations"), policy_mtp.pop("logprobs")
        if args.early_ab:  # the same drafter run with each step drafting at its launch (the A/B of early drafts)
            os.environ["DEEPINFER_SPEC_EARLY_DRAFTS"] = "0"
            try:
                late = run(s, b, "mtp")
            finally:
                os.environ.pop("DEEPINFER_SPEC_EARLY_DRAFTS")
            row["mtp_drafts_at_launch"] = {k: late[k] for k in ("tpot_ms", "step_ms")}
            sweep.log(f"L={depth} B={b}: drafter, early drafts {mtp['tpot_ms']:.3f} ms/token, drafts at launch "
                      f"{late['tpot_ms']:.3f}")  # fmt: skip
    except Exception:
        row["drafter_error"] = traceback.format_exc()[-4000:]
        print(row["drafter_error"], flush=True)
        mtp = policy_mtp = {"failed": True, "tpot_ms": float("nan"), "step_ms": float("nan"), "acceptance": None,
                            "steps_off": 0}  # fmt: skip
    row["mtp"] = mtp
    row["policy_mtp"] = {"limit": args.limit, **policy_mtp}
    row["draft_ms"] = max(0.0, mtp["step_ms"] - worst["step_ms"]) if not mtp.get("failed") else float("nan")
    sweep.log(
        f"L={depth} B={b}: off {off['tpot_ms']:.3f} ms/token (step {off['step_ms']:.3f}, roofline "
        f"{row['plain_roofline_ms']:.3f}); verify step {row['verify_step_ms']:.3f} ms (roofline "
        f"{row['verify_roofline_ms']:.3f}); draft {row['draft_ms']:.3f} ms, acceptance "
        f"{mtp['acceptance']}; "
        + ", ".join(f"e={e:g}: {row[f'oracle_{e:g}']['tpot_ms']:.3f} ms at "
                    f"{row[f'oracle_{e:g}']['emitted_per_verify'] or 0:.2f}/step" for e in args.errors)
        + f"; policy (limit {args.limit}) {policy['tpot_ms']:.3f} ms, steps off {policy['steps_off']}"
        + f"; policy with the drafter {policy_mtp['tpot_ms']:.3f} ms, steps off {policy_mtp['steps_off']}"
    )  # fmt: skip


def project(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per batch: plain and verify step times fitted over depth, projected to the real depth; TPOT there at 3 tokens
    per verify step and at each oracle rate's measured tokens per step."""
    out, real = [], REAL_DEPTH[args.model]
    for b in args.batches:
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["depth"])
        if len({r["depth"] for r in rs}) < 2:  # (a line through one depth: no projection)
            continue
        depths = [r["depth"] for r in rs]
        pa, pb, plain = fit(depths, [r["off"]["step_ms"] for r in rs], real)
        va, vb, verify = fit(depths, [r["verify_step_ms"] for r in rs], real)
        draft = rs[-1]["draft_ms"]
        p = {"batch": b, "depths": depths, "plain_fit_ms": [pa, pb], "verify_fit_ms": [va, vb], "draft_ms": draft,
             "plain_ms": plain, "verify_ms": verify, "tpot_ratio_at_3": (verify + draft) / 3 / plain}  # fmt: skip
        p["at_rates"] = {
            f"{e:g}": {"emitted": (em := rs[-1][f"oracle_{e:g}"]["emitted_per_verify"] or 1.0),
                       "tpot_ratio": (verify + draft) / em / plain}
            for e in args.errors
        }  # fmt: skip
        out.append(p)
        sweep.log(f"B={b} at {real} layers: plain {plain:.3f} ms, verify {verify:.3f} + draft {draft:.3f} ms; "
                  f"TPOT with/without at 3 tokens per verify step {p['tpot_ratio_at_3']:.2f}x")  # fmt: skip
    return out


def mixed_ab(s: Setup, b: int, e: float, cont: dict, late: int) -> dict[str, Any]:
    """The oracle at error rate ``e`` with a ``late``-token prompt joining the timed run, its prompt chunks beside
    verify rows: run as two forwards (``verify_split``: ``split_steps`` counts them) and on the ragged path."""
    from deepinfer.models.deepseek_v4 import verify_split

    real, taken = verify_split.split, [0]

    def counted(*a: Any) -> Any:
        got = real(*a)
        taken[0] += got is not None
        return got

    out: dict[str, Any] = {"prompt": late, "error": e}
    for key, fn in (("split", counted), ("ragged", lambda *a: None)):
        verify_split.split = fn
        try:
            got = run(s, b, e, cont, late=late)
        finally:
            verify_split.split = real
        out[key] = {k: got[k] for k in ("tpot_ms", "step_ms", "steps", "graph_captures", "tpot_ms_less_captures")}
    out["split_steps"] = taken[0]
    return out


def table(res: dict, args: argparse.Namespace) -> list[str]:
    head = " | ".join(f"e={e:g} ms (tok/step)" for e in args.errors)
    lines = [
        f"Model {args.model} ({'DSpark' if args.model == 'v41' else 'MTP'} drafter), drafts {args.drafts}, context "
        f"{args.context}, {args.tokens} timed tokens per request, greedy.",
        "",
        f"| depth | batch | off ms | roofline | verify step ms | verify roofline | draft ms | {head} | policy ms "
        "| policy, drafter ms |",
        "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(args.errors) + "---:|---:|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['depth']} | {r['batch']} | {r['off']['tpot_ms']:.3f} | failed: see the JSON |")
            continue
        cells = " | ".join(f"{r[f'oracle_{e:g}']['tpot_ms']:.3f} ({r[f'oracle_{e:g}']['emitted_per_verify'] or 0:.2f})"
                           for e in args.errors)  # fmt: skip
        lines.append(f"| {r['depth']} | {r['batch']} | {r['off']['tpot_ms']:.3f} | {r['plain_roofline_ms']:.3f} | "
                     f"{r['verify_step_ms']:.3f} | {r['verify_roofline_ms']:.3f} | {r['draft_ms']:.3f} | {cells} | "
                     f"{r['policy']['tpot_ms']:.3f} | {r['policy_mtp']['tpot_ms']:.3f} |")  # fmt: skip
    mixed = [r for r in res["rows"] if "mixed" in r]
    if mixed:
        lines += ["", f"A {args.mixed_ab}-token prompt joining the timed run (its chunks beside verify rows):", "",
                  "| depth | batch | e | TPOT, two forwards ms | TPOT, ragged ms | steps split |",
                  "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in mixed:
            m = r["mixed"]
            lines.append(f"| {r['depth']} | {r['batch']} | {m['error']:g} | {m['split']['tpot_ms']:.3f} | "
                         f"{m['ragged']['tpot_ms']:.3f} | {m['split_steps']} |")  # fmt: skip
    if not res["projection"]:
        return [*lines, "", "No projection to the real depth: it needs two depths or more (--depths)."]
    lines += [
        "",
        f"Projected to {REAL_DEPTH[args.model]} layers (step times fitted over the depths measured):",
        "",
        "| batch | plain ms | verify ms | draft ms | TPOT ratio at 3 tok/step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in res["projection"]:
        lines.append(f"| {p['batch']} | {p['plain_ms']:.3f} | {p['verify_ms']:.3f} | {p['draft_ms']:.3f} | "
                     f"{p['tpot_ratio_at_3']:.2f}× |")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
