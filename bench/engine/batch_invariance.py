"""Batch-invariant mode on vs off (issue 4): bitwise checks on the device, then decode throughput.

In one run, on one device (a GPU, or the CPU with ``--tiny``):

* **check**: a target sequence (``--target`` prompt tokens, then 4 decode steps) runs alone, then inside
  ``--compositions`` random batches (1–16 other sequences of 1–``--other-max`` tokens, the target's prefill cut
  into random chunks, the others part prefill and part decode, shuffled each step). For each op set it reports
  how many compositions gave bit-identical logits for the target and the largest |Δ logit| otherwise. The
  default ops are the control (they are expected to differ).
* **decode**: ``bench/engine/sweep.py``'s decode harness (a ``--context``-token context cloned to ``B`` sequences,
  single-token steps of the whole batch, median step time) with the default ops, then with the batch-invariant
  ops, on the same model, cache and token streams; next to the HBM roofline of the same step (sweep's ``Work``
  with the ceilings measured in the run). The peer of the invariant mode is the default mode of the same run.

Run on one GPU::

    PYTHONPATH=libs:. python bench/engine/batch_invariance.py --out bench/results

On the CPU (tiny config)::

    PYTHONPATH=libs:. python bench/engine/batch_invariance.py --tiny --device cpu --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

import torch

from bench import harness
from bench.engine import sweep
from bench.engine.compositions import split, target_logits
from deepinfer.ops import get_ops

PAGE_SIZE = 256  # a multiple of every compression ratio


def check(model, args, dev) -> dict:
    vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    target = [rng.randrange(2, vocab) for _ in range(args.target + 4)]
    alone = target_logits(model, [target], [[args.target, 1, 1, 1, 1]], None, PAGE_SIZE, torch.bfloat16, dev)
    same, worst = 0, 0.0
    for k in range(args.compositions):
        r = random.Random(1000 + k)
        others = [[r.randrange(2, vocab) for _ in range(r.randint(1, args.other_max))] for _ in range(r.randint(1, 16))]
        plans = [split(len(o), r, max(1, len(o) // 3)) if r.random() < 0.5 else [1] * len(o) for o in others]
        tplan = [0] * r.randint(0, 2) + split(args.target, r, r.choice([17, 100, args.target])) + [1] * 4
        got = target_logits(model, [target, *others], [tplan, *plans], r, PAGE_SIZE, torch.bfloat16, dev)
        if torch.equal(got, alone):
            same += 1
        else:
            worst = max(worst, (got - alone).abs().max().item())
    return {"compositions": args.compositions, "bit_identical": same, "max_abs_diff": worst}


def use(model, ops) -> None:
    """Run ``model`` on ``ops`` from now on: the CUDA graphs captured on the other op set are dropped (a graph replays
    the kernels, and their plans, of the op set it was captured with)."""
    model.ops = ops
    model.decode_graphs = model.prefill_graphs = None


def kernel_account(profiles: dict[str, dict[int, dict]], rows: int = 25) -> list[str]:
    """Markdown: per profiled batch size, the kernels' device µs in one step of each mode side by side, the
    largest differences first (``sweep.profile_step``'s ``kernels_us``; on the CPU the ops' own CPU µs): where the
    invariant mode's time goes."""
    lines: list[str] = []
    for b in sorted(profiles.get("default", {})):
        d = profiles["default"][b].get("kernels_us", {})
        i = profiles.get("invariant", {}).get(b, {}).get("kernels_us", {})
        if not d or not i:
            continue
        head = (
            f"Batch {b}, one step profiled: own µs by kernel (the device's; on the CPU the ops'), the largest "
            f"differences first; total {sum(d.values()):.0f} default, {sum(i.values()):.0f} invariant"
        )
        lines += ["", head, "", "| kernel | default µs | invariant µs | Δ µs |", "|---|---:|---:|---:|"]
        keys = sorted(set(d) | set(i), key=lambda k: -abs(i.get(k, 0.0) - d.get(k, 0.0)))[:rows]
        for k in keys:
            name = k if len(k) <= 70 else k[:67] + "..."
            dk, ik = d.get(k, 0.0), i.get(k, 0.0)
            lines.append(f"| `{name}` | {dk:.1f} | {ik:.1f} | {ik - dk:+.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hash-layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=None, help="decode context (4096; tiny 1024)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 16, 64])
    ap.add_argument("--target", type=int, default=None, help="target prompt tokens of the check (600; tiny 150)")
    ap.add_argument("--other-max", type=int, default=None, help="longest other sequence (300; tiny 40)")
    ap.add_argument("--compositions", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--weights",
        choices=["auto", "bf16", "native"],
        default="auto",
        help="auto: as served (the checkpoint's FP8 / MXFP4 weights where the op set keeps them)",
    )
    ap.add_argument(
        "--profile",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="batch sizes whose step is profiled in both modes: the kernels' device time side by side",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.context = args.context or (1024 if args.tiny else 4096)
    args.target = args.target or (150 if args.tiny else 600)
    args.other_max = args.other_max or (40 if args.tiny else 300)
    args.contexts, args.chunk, args.page_size, args.prefill_tokens = 1, 4096, 256, []
    # sweep's model and decode harness read more of sweep's options (--ab, --graphs, ...): start from its defaults
    args = argparse.Namespace(**{**vars(sweep.parse_args(["--no-peer"])), **vars(args)})
    accel = "nvidia" if dev.type == "cuda" else "cpu"
    ops = {"default": get_ops(accel), "invariant": get_ops(accel, batch_invariant=True)}
    config = sweep.build_config(args)
    model = sweep.build_ours(config, dev, args.seed)
    if args.weights == "native" or (args.weights == "auto" and getattr(model.ops, "native_weights", False)):
        sweep.prepare_native(model, tuple(config.weight_block_size), quantize=True)  # as served: FP8 / MXFP4 stored
    model.ops.prepare_weights(model)
    args.weights_used = "native" if getattr(model.ops, "native_weights", False) else "bf16"
    ceil = sweep.probe_ceilings(dev)
    work = sweep.Work.of(config)
    result = {"device": harness.device_name(dev), "weights": args.weights_used,
              "torch": torch.__version__, "layers": config.num_hidden_layers, "context": args.context,
              "ceilings": ceil, "command": " ".join(sys.argv), "check": {}, "decode": []}  # fmt: skip
    for name, o in ops.items():
        use(model, o)
        result["check"][name] = check(model, args, dev)
        sweep.log(f"check {name}: {result['check'][name]}")
    rows, profiles = {}, {}
    for name, o in ops.items():
        use(model, o)
        ours = sweep.Ours(model, args, dev, args.batches)
        budget = sweep.Budget(args.budget_s, float("inf"))
        rows[name], _ = ours.decode(args.batches, budget)
        profiles[name] = ours.profiles
        del ours
        sweep.free(dev)
    for d, i in zip(rows["default"], rows["invariant"]):
        roof = work.decode(d["batch"], args.context, ceil["hbm_copy_GBps"] * 1e9, ceil["fp8_TFLOPs"] * 1e12)
        row = {"batch": d["batch"], "default_ms": d.get("ms"), "invariant_ms": i.get("ms"),
               "roofline_ms": roof["roofline_ms"]}  # fmt: skip
        if d.get("ms") and i.get("ms"):
            row["invariant_throughput_fraction"] = d["ms"] / i["ms"]
        result["decode"].append(row)
    title = (f"# batch invariance on {result['device']} ({result['layers']} layers, {args.weights_used} weights, "
             f"bf16 activations, context {args.context})")  # fmt: skip
    lines = [title, "",
             "| check | bit-identical compositions | max abs diff |", "|---|---|---|"]  # fmt: skip
    for name, c in result["check"].items():
        lines.append(f"| {name} | {c['bit_identical']}/{c['compositions']} | {c['max_abs_diff']:.3g} |")
    lines += ["", "| batch | default ms | invariant ms | invariant / default throughput | roofline ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in result["decode"]:
        frac = r.get("invariant_throughput_fraction")
        lines.append(f"| {r['batch']} | {r['default_ms'] or float('nan'):.2f} | {r['invariant_ms'] or float('nan'):.2f}"
                     f" | {frac if frac else float('nan'):.2f} | {r['roofline_ms']:.3f} |")  # fmt: skip
    if args.profile:
        result["profiles"] = profiles
        lines += kernel_account(profiles)
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today().isoformat()}-batch-invariance-{'cpu' if dev.type == 'cpu' else 'gpu'}"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{stem}.md").write_text(text + f"\n\nCommand: `{result['command']}`\n")


if __name__ == "__main__":
    main()
