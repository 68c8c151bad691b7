"""Prefill of the sweep's model with its random router as is, and balanced as training balances a V4 router.

The sweep's score-routed MoE layers have random gate weights: the hidden states share a direction, so a few experts
win most tokens (hundreds of slots each at 1k tokens) while most get a handful. A trained DeepSeek-V4 router is
load-balanced by its selection bias (``gate.bias``, DeepSeek's auxiliary-loss-free balancing: after each step the
bias of an overloaded expert goes down by γ, an underloaded one's up). ``balance`` applies that rule to the random
model on random prompts — a few rounds, γ halving each round from the spread of the selection scores — and leaves
the gate weights alone, so only which experts are selected changes (the routing weights stay the unbiased scores).
Hash-routed layers are balanced by construction (a random ``tid2eid``) and untouched.

Reports, in one run on the same model: per score-routed layer the slots of the busiest expert over the mean and the
experts with no slot, before and after; prefill ms at each ``--prefill-tokens`` before and after, with the fraction
of the FP8 peak (the sweep's FLOP roofline, measured ceilings).

    PYTHONPATH=libs:. python bench/engine/router_balance.py --out bench/results
    PYTHONPATH=libs:. python bench/engine/router_balance.py --tiny --device cpu --prefill-tokens 256
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import harness
from bench.engine import sweep
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.quant.native import prepare_native  # noqa: E402


def score_gates(model) -> list:
    return [layer.ffn.gate for layer in model.layers if not layer.ffn.gate.hashed]


def routing(model, run) -> list[dict[str, Any]]:
    """Per score-routed layer, over one ``run()`` (eager): slots per expert and the selection scores' spread."""
    gates = score_gates(model)
    loads = [torch.zeros(g.weight.shape[0], dtype=torch.long, device=g.weight.device) for g in gates]
    spread = [0.0] * len(gates)

    def hook(i):
        def f(mod, inputs, out):
            idx = out[0]
            loads[i] += torch.bincount(idx.flatten(), minlength=loads[i].numel())
            scores = F.softplus(F.linear(inputs[0].float(), mod.weight.float())).sqrt()
            spread[i] = float(scores.std())

        return f

    hooks = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    ops = model.ops
    graphs = getattr(ops, "cuda_graphs", False)
    ops.cuda_graphs = False
    try:
        run()
    finally:
        ops.cuda_graphs = graphs
        for h in hooks:
            h.remove()
    out = []
    for load, s in zip(loads, spread):
        mean = load.float().mean().item()
        out.append({"max_over_mean": load.max().item() / mean, "idle_experts": int((load == 0).sum()), "load": load,
                    "spread": s})  # fmt: skip
    return out


@torch.no_grad()
def balance(model, run, rounds: int = 10) -> list[list[dict[str, float]]]:
    """DeepSeek's bias update, ``rounds`` times: ``bias -= γ·sign(load - mean)``, γ from half the scores' spread,
    halving each round. Returns each round's (max/mean, idle experts) per layer."""
    history = []
    for r in range(rounds):
        stats = routing(model, run)
        history.append([{"max_over_mean": s["max_over_mean"], "idle_experts": s["idle_experts"]} for s in stats])
        for g, s in zip(score_gates(model), stats):
            load = s["load"].float()
            g.bias -= (0.5 * s["spread"] * 0.5**r) * torch.sign(load - load.mean()).to(g.bias.dtype)
    return history


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prefill-tokens", type=ints, default=[1024, 4096])
    ap.add_argument("--calibration-tokens", type=int, default=4096, help="random prompt the bias is fitted on")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sargv = ["--no-peer", "--page-size", "256"] + (["--tiny"] if args.tiny else [])
    sargv += ["--layers", str(args.layers)] if args.layers else []
    sargs = sweep.parse_args(sargv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = sweep.build_config(sargs)
    work = sweep.Work.of(config)
    res: dict[str, Any] = {
        **harness.result_header(dev, args),
    }
    with torch.no_grad():
        ce = sweep.probe_ceilings(dev)
        res["ceilings"] = ce
        bw, peak = ce["hbm_copy_GBps"] * 1e9, max(ce["fp8_TFLOPs"] or 0.0, ce["bf16_TFLOPs"]) * 1e12
        model = sweep.build_ours(config, dev, args.seed)
        if getattr(model.ops, "native_weights", False):
            prepare_native(model, tuple(config.weight_block_size), quantize=True)
        model.ops.prepare_weights(model)
        longest = max(args.prefill_tokens + [args.calibration_tokens])
        cache = PagedKVCache(config, -(-longest // 256) + 1, 256, torch.bfloat16, dev)
        table = torch.arange(cache.num_pages, device=dev)
        gen = torch.Generator().manual_seed(args.seed)

        def prefill(n: int):
            ids = torch.randint(2, config.vocab_size, (n,), generator=gen).tolist()

            def run():
                st = SequenceState()
                h = None
                for s in range(0, len(ids), 4096):
                    part = ids[s : s + 4096]
                    h = model(ForwardBatch.build([SeqChunk(st, s, len(part), table)], [part], dev), cache)
                return model.logits(h[-1:])

            return run

        calib = prefill(args.calibration_tokens)
        budget = sweep.Budget(600.0, sweep.T0 + 3600)

        def timed_prefills(label: str) -> list[dict[str, Any]]:
            rows = []
            for n in args.prefill_tokens:
                run = prefill(n)
                stats = routing(model, run)
                row = {"tokens": n, **sweep.run_timed(run, dev, 1, args.repeats, budget, None)}
                roof = work.prefill(n, bw, peak)
                row["fraction_of_fp8_peak"] = roof["fp8_flop_ms"] / row["ms"]
                row["max_over_mean"] = [round(s["max_over_mean"], 2) for s in stats]
                row["idle_experts"] = [s["idle_experts"] for s in stats]
                pct = 100 * row["fraction_of_fp8_peak"]
                sweep.log(f"{label} prefill {n}: {row['ms']:.1f} ms ({pct:.1f}% of the FP8 peak); busiest expert / "
                          f"mean {row['max_over_mean']}, idle {row['idle_experts']}")  # fmt: skip
                rows.append(row)
            return rows

        res["random_router"] = timed_prefills("random router")
        res["balancing"] = balance(model, calib, args.rounds)
        res["balanced_router"] = timed_prefills("balanced router")
    lines = ["| tokens | random router ms (% FP8 peak) | balanced ms (% FP8 peak) | busiest / mean, random → "
             "balanced |", "|---:|---:|---:|---|"]  # fmt: skip
    for a, b in zip(res["random_router"], res["balanced_router"]):
        pa, pb = 100 * a["fraction_of_fp8_peak"], 100 * b["fraction_of_fp8_peak"]
        lines.append(f"| {a['tokens']} | {a['ms']:.1f} ({pa:.1f}%) | {b['ms']:.1f} ({pb:.1f}%) | "
                     f"{a['max_over_mean']} → {b['max_over_mean']} |")  # fmt: skip
    harness.write_result(args.out, args.name or f"{res['date']}-router-balance", res, lines)
    return res


if __name__ == "__main__":
    main()
