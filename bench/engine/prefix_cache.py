"""Multi-turn chat with a growing history: time to first token per turn with and without the prefix cache.

Turn ``k`` sends the whole conversation so far (previous prompt + the reply + ``--user`` new tokens) and
generates ``--reply`` tokens, one request at a time, through the engine's own scheduler and model runner
(no transport). With the cache the turn resumes from the previous turn's sequence-end resume point and
prefills only the new tokens; without it (the peer, same run, same weights) it prefills everything.
Beside each TTFT: the FLOP roofline of the prefill the cache leaves to do (the new tokens, sweep's
``Work.prefill`` with the ceilings measured in the run).

GPU (V4-Flash width, ``--layers`` layers, bf16, random weights)::

    PYTHONPATH=libs:. python bench/engine/prefix_cache.py --out bench/results

CPU (the tiny config)::

    PYTHONPATH=libs:. python bench/engine/prefix_cache.py --tiny --device cpu --out bench/results
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
from bench.engine import sweep
from deepinfer.engine.models import family_of  # noqa: E402
from deepinfer.engine.pages import PagePool  # noqa: E402
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from deepinfer.engine.worker import ModelRunner  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402


def conversation(model, args, dev, cache_on: bool) -> list[dict]:
    c = model.config
    ps, turns = args.page_size, args.turns
    total = turns * (args.user + args.reply) + ps
    pages = 2 * -(-total // ps) + 8
    runner = ModelRunner(model, PagedKVCache(c, pages, ps, torch.bfloat16, dev), dev, family=family_of(model.config))
    cfg = SchedulerConfig(page_size=ps, max_model_len=total + ps, eos_token_id=c.eos_token_id,
                          max_num_batched_tokens=args.chunk, prefix_caching=cache_on, fingerprint="bench")  # fmt: skip
    sched = Scheduler(cfg, PagePool(pages))
    rng = random.Random(args.seed)
    prompt: list[int] = []
    rows = []
    for k in range(turns):
        prompt = prompt + [rng.randrange(2, c.vocab_size) for _ in range(args.user)]
        times, out = [], None
        for r in range(args.repeats):  # the same request again: the median TTFT (greedy: the same reply)
            rid = f"turn{k}.{r}"
            harness.sync(dev)
            t0 = time.perf_counter()
            sched.add(rid, prompt, SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True))
            ttft, done = None, None
            while done is None:
                res = runner.execute(sched.schedule())
                harness.sync(dev)
                if ttft is None and any(x.request_id == rid and x.token_id is not None for x in res.results):
                    ttft = time.perf_counter() - t0
                for req in sched.update(res):
                    done = sched.pop_finished(req.request_id)
            runner.execute(sched.schedule())  # the snapshot order and the release travel with the next plan
            times.append(ttft)
            out = out or done
        ttft = statistics.median(times)
        rows.append({"turn": k + 1, "prompt_tokens": len(prompt), "cached_tokens": out.num_cached_tokens,
                     "ttft_ms": 1e3 * ttft, "ttft_runs_ms": [1e3 * t for t in times]})  # fmt: skip
        sweep.log(f"  cache {'on ' if cache_on else 'off'} turn {k + 1}: {len(prompt)} tokens, "
                  f"{out.num_cached_tokens} cached, TTFT {1e3 * ttft:.1f} ms (median of {len(times)})")  # fmt: skip
        prompt = prompt + out.output_token_ids
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hash-layers", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user", type=int, default=None, help="new user tokens per turn (2048; tiny 256)")
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each turn's request (median TTFT)")
    ap.add_argument("--chunk", type=int, default=8192, help="step token budget (prefill chunk)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--hca", type=int, default=None, help="with --tiny: the HCA ratio (tiny's own is 8; V4's 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.user = args.user or (256 if args.tiny else 2048)
    config = sweep.build_config(args)
    if args.tiny and args.hca:  # the tiny widths with V4's compression ratios
        from deepinfer.checkpoint.tiny import TINY_V4
        from deepinfer.models.deepseek_v4.config import DeepseekV4Config

        ratios = [r if r in (0, 4) else args.hca for r in TINY_V4["compress_ratios"]]
        config = DeepseekV4Config.from_dict({**TINY_V4, "num_nextn_predict_layers": 0, "compress_ratios": ratios})
    model = sweep.build_ours(config, dev, args.seed)
    ceil = sweep.probe_ceilings(dev)
    work = sweep.Work.of(config)
    conversation(model, argparse.Namespace(**{**vars(args), "turns": 2}), dev, True)  # warm-up (allocator, kernels)
    runs = {"off": conversation(model, args, dev, False), "on": conversation(model, args, dev, True)}
    bw, peak = ceil["hbm_copy_GBps"] * 1e9, ceil["fp8_TFLOPs"] * 1e12
    table = []
    for off, on in zip(runs["off"], runs["on"]):
        new = on["prompt_tokens"] - on["cached_tokens"]
        table.append({**{k: on[k] for k in ("turn", "prompt_tokens", "cached_tokens")},
                      "ttft_ms": on["ttft_ms"], "ttft_no_cache_ms": off["ttft_ms"],
                      "ttft_runs_ms": on["ttft_runs_ms"], "ttft_no_cache_runs_ms": off["ttft_runs_ms"],
                      "roofline_new_tokens_ms": work.prefill(new, bw, peak)["roofline_ms"]})  # fmt: skip
    ratio = table[-1]["ttft_ms"] / table[0]["ttft_ms"]
    ratio_off = table[-1]["ttft_no_cache_ms"] / table[0]["ttft_no_cache_ms"]
    result = {"device": harness.device_name(dev), "torch": torch.__version__, "layers": config.num_hidden_layers,
              "dtype": "bfloat16", "command": " ".join(sys.argv), "ceilings": ceil, "turns": table,
              "ttft_last_over_first": ratio, "ttft_last_over_first_no_cache": ratio_off}  # fmt: skip
    ratios = ",".join(map(str, config.compress_ratios[: config.num_hidden_layers]))
    lines = [f"# prefix cache, {args.turns}-turn chat on {result['device']} ({config.num_hidden_layers} layers, "
             f"compression ratios {ratios}, bf16)",
             "", f"{args.user} new user tokens and {args.reply} reply tokens per turn; one request at a time; "
             f"TTFT = median of {args.repeats} runs of each turn's request.", "",
             "| turn | prompt tokens | cached | TTFT ms (cache) | TTFT ms (no cache) | roofline ms (new tokens) |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in table:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_ms']:.1f} | "
                     f"{r['ttft_no_cache_ms']:.1f} | {r['roofline_new_tokens_ms']:.2f} |")  # fmt: skip
    lines += ["", f"TTFT(turn {args.turns}) / TTFT(turn 1): **{ratio:.2f}** with the cache, {ratio_off:.2f} without."]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today().isoformat()}-prefix-cache-{'cpu' if dev.type == 'cpu' else 'gpu'}"
        stem += f"-hca{args.hca}" if args.tiny and args.hca else ""
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        cmd = f"PYTHONPATH=libs:. python {result['command']}"
        (args.out / f"{stem}.md").write_text(text + f"\n\nCommand: `{cmd}`\n")


if __name__ == "__main__":
    main()
