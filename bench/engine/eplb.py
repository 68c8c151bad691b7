"""EPLB on a skewed routing workload: tokens per rank, max / mean, with the even placement (the peer) and with
EPLB's placements (``deepinfer.parallel.eplb``), against perfect balance (1.0, the bound).

The workload: per MoE layer an expert popularity of Zipf shape (expert ``i`` of a random order weighs
``(i + 1)^-s``), each token picking its top-``k`` experts by Gumbel-perturbed log popularity (distinct experts, the
busier ones more often, as a router skewed towards them would), tokens spread over the ranks in turn (attention
data parallel). EPLB places each layer from the loads of a first window of tokens (``--calibration``) and is
judged on a second, fresh window (``--tokens``): a placement that only fits its own statistics would not carry
over. Tokens of a replicated expert are split over its copies by ``ExpertPlacement.route``'s rule, as served.

A rank's MoE time follows the tokens it computes, and a step waits for its slowest rank: max / mean is the
factor by which imbalance stretches a step's expert work.

    PYTHONPATH=libs:. python bench/engine/eplb.py --out bench/results/engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

from deepinfer.parallel.eplb import rebalance  # noqa: E402
from deepinfer.parallel.placement import ExpertPlacement  # noqa: E402

# (name, experts, top-k, layers): V4-Flash; V4-Pro and V4.1-Flash share 384 experts, top-6
MODELS = {"v4-flash": (256, 6, 43), "384-experts": (384, 6, 61)}


def routes(pop: np.ndarray, tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[tokens, k]`` distinct experts per token: the top-k of log popularity plus Gumbel noise."""
    g = np.log(pop)[None, :] - np.log(-np.log(rng.random((tokens, len(pop)))))
    return np.argpartition(-g, k, axis=1)[:, :k]


def per_rank(p: ExpertPlacement, idx: np.ndarray, ranks: int) -> np.ndarray:
    """Rows each rank computes when token ``t`` (on rank ``t % ranks``) goes where ``route`` sends it."""
    out = np.zeros(ranks)
    t = torch.from_numpy(idx)
    for src in range(ranks):
        dest, _ = p.route(t[src::ranks], src)
        out += np.bincount(dest.numpy(), minlength=ranks)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    rows = []
    for model in args.models:
        e, k, layers = MODELS[model]
        layers = min(layers, args.layers)
        pops = [(np.arange(1, e + 1) ** -args.skew)[rng.permutation(e)] for _ in range(layers)]
        calib = [routes(p, args.calibration, k, rng) for p in pops]
        test = [routes(p, args.tokens, k, rng) for p in pops]
        for ranks, redundant, nodes in args.setups:
            if e % ranks and not redundant:
                continue
            slots = -(-(e + redundant) // ranks)
            before, after = [], []
            for c, t in zip(calib, test):
                load = np.bincount(c.reshape(-1), minlength=e)
                placed = rebalance(load, ranks, slots, nodes)
                b, a = per_rank(ExpertPlacement.even(e, ranks), t, ranks), per_rank(placed, t, ranks)
                before.append(b.max() / b.mean())
                after.append(a.max() / a.mean())
            rows.append({"model": model, "experts": e, "ranks": ranks, "redundant": slots * ranks - e,
                         "nodes": nodes, "layers": layers, "even_mean": float(np.mean(before)),
                         "even_worst": float(np.max(before)), "eplb_mean": float(np.mean(after)),
                         "eplb_worst": float(np.max(after))})  # fmt: skip
            r = rows[-1]
            print(f"{model} {ranks} ranks, {r['redundant']} redundant, {nodes} node(s): even {r['even_mean']:.3f} "
                  f"(worst {r['even_worst']:.3f}) -> EPLB {r['eplb_mean']:.3f} (worst {r['eplb_worst']:.3f})",
                  flush=True)  # fmt: skip
    return {"rows": rows}


def table(res: dict[str, Any]) -> list[str]:
    a = res["args"]
    lines = [f"EPLB, tokens per rank max / mean over the layers (1.0: balanced, the bound); Zipf skew {a['skew']}, "
             f"{a['calibration']} calibration + {a['tokens']} judged tokens per layer", "",
             "| experts | layers | ranks | redundant | nodes | even (peer) mean / worst | EPLB mean / worst | "
             "step's expert time |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["rows"]:
        lines.append(f"| {r['experts']} | {r['layers']} | {r['ranks']} | {r['redundant']} | {r['nodes']} | "
                     f"{r['even_mean']:.3f} / "
                     f"{r['even_worst']:.3f} | {r['eplb_mean']:.3f} / {r['eplb_worst']:.3f} | "
                     f"{r['eplb_mean'] / r['even_mean']:.2f}x |")  # fmt: skip
    return lines


def setups(text: str) -> list[tuple[int, int, int]]:
    """``ranks:redundant:nodes,...``"""
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a few layers and tokens (the CI smoke run)")
    ap.add_argument("--device", default="cpu", help="(the algorithm runs on the host)")
    ap.add_argument("--models", default="v4-flash,384-experts")
    ap.add_argument("--setups", type=setups, default=None, help="ranks:redundant:nodes, ... (default: 8 to 32 ranks)")
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the expert popularity")
    ap.add_argument("--tokens", type=int, default=None, help="judged tokens per layer (default 16384; tiny 512)")
    ap.add_argument("--calibration", type=int, default=None, help="tokens EPLB sees per layer (default 16384)")
    ap.add_argument("--layers", type=int, default=None, help="at most this many layers (default all; tiny 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    args.setups = args.setups or ([(4, 0, 1), (4, 4, 1)] if args.tiny else
                                  [(8, 0, 1), (8, 32, 1), (8, 64, 1), (16, 32, 2), (32, 64, 4)])  # fmt: skip
    args.tokens = args.tokens or (512 if args.tiny else 16384)
    args.calibration = args.calibration or (512 if args.tiny else 16384)
    args.layers = args.layers or (2 if args.tiny else 1000)
    res = {**harness.result_header("cpu", args), **run(args)}
    harness.write_result(args.out, args.name or f"{res['date']}-eplb{'-tiny' if args.tiny else ''}", res, table(res))
    return res


if __name__ == "__main__":
    main()
