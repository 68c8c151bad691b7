"""Host work of a DeepSeek-V4 decode step: per-sequence state bookkeeping against the pooled state, on CPU.

A graphed decode step on a GPU is bound by the host at large batches: the attention's state bookkeeping issues
tensor operations per sequence (bench/results/engine/2026-11-29-sweep-4.md). This measures that work where it can be
measured without a GPU: a model with V4-Flash's attention structure (4 layers SWA, SWA, CSA ratio 4, HCA ratio 128;
window 128, index top-k 64) at tiny widths (hidden 64) on the reference ops, ``--batch`` sequences cloned from one
``--context``-token prefill, each with its own cache pages. Two lanes of the same sequences decode interleaved:
``model.pooled_decode = False`` (the per-sequence bookkeeping: the peer, as before this change) and ``True`` (the
``StatePool``: ``models/deepseek_v4/state_pool.py``). Reported: median ms per step of each, and the number of aten
operations one step dispatches (``torch.profiler``), which is what costs host time on any device. A host-work
roofline does not exist: the figure of merit is the operation count, which the pooled path makes independent of
the batch size in the attention bookkeeping.

    PYTHONPATH=libs:. python bench/host/decode_host.py --batch 64 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402

from bench.harness import add_common_args
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.checkpoint.tiny import TINY_V4, random_weights  # noqa: E402
from deepinfer.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.model import DeepseekV4Model  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402


def aten_calls(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    return sum(e.count for e in p.key_averages() if e.key.startswith("aten::"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4, help="SWA, SWA, then CSA (ratio 4) and HCA (128) alternating")
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.device == "cuda":
        raise SystemExit("decode_host measures the host's work on the CPU: run it with --device cpu (or no --device)")
    if args.tiny:
        args.batch, args.context, args.rounds = [2, 4], 64, 2
    torch.set_num_threads(1)
    ratios = ([0, 0] + [4, 128] * args.layers)[: args.layers] + [0]
    cfg = DeepseekV4Config.from_dict({**TINY_V4, "num_hidden_layers": args.layers, "compress_ratios": ratios,
                                      "sliding_window": 128, "num_hash_layers": 2, "index_topk": 64})  # fmt: skip
    model = DeepseekV4Model(cfg, ReferenceOps())
    model.load_state_dict(random_weights(cfg, seed=0))
    rng = random.Random(0)
    rows = []
    for b in args.batch:
        ps = 128
        pages = -(-(args.context + 2 * args.rounds + 16) // ps)
        cache = PagedKVCache(cfg, pages * (2 * b + 1), ps)
        st0, t0 = SequenceState(), torch.arange(pages)
        ids = [rng.randrange(2, 1000) for _ in range(args.context)]
        model(ForwardBatch.build([SeqChunk(st0, 0, args.context, t0)], [ids]), cache)
        lanes = {}
        for lane, pooled in enumerate((False, True)):
            states, tables = [], []
            for i in range(b):
                tb = torch.arange(pages * (1 + lane * b + i), pages * (2 + lane * b + i))
                for store in list(cache.rows.values()) + list(cache.index_keys.values()):
                    store[tb] = store[t0]
                states.append(st0.clone())
                tables.append(tb)
            lanes[pooled] = (states, tables)

        def step(pooled: bool, lanes: dict = lanes, cache: PagedKVCache = cache) -> float:
            model.pooled_decode = pooled
            states, tables = lanes[pooled]
            chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
            batch = ForwardBatch.build(chunks, [[rng.randrange(2, 1000)] for _ in states])
            t = time.perf_counter()
            model.logits(model(batch, cache))
            return time.perf_counter() - t

        for _ in range(2):
            step(False), step(True)
        ts: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for p in (False, True):
                ts[p].append(step(p))
        row = {"batch": b, "per_sequence_ms": 1e3 * statistics.median(ts[False]),
               "pooled_ms": 1e3 * statistics.median(ts[True]),
               "per_sequence_aten_calls": aten_calls(lambda: step(False)),
               "pooled_aten_calls": aten_calls(lambda: step(True))}  # fmt: skip
        rows.append(row)
        print(f"batch {b}: per-sequence {row['per_sequence_ms']:.1f} ms, {row['per_sequence_aten_calls']} aten ops; "
              f"pooled {row['pooled_ms']:.1f} ms, {row['pooled_aten_calls']} aten ops", flush=True)  # fmt: skip
    res = {"command": " ".join([Path(sys.executable).name] + sys.argv), "torch": torch.__version__, "rows": rows,
           "context": args.context, "rounds": args.rounds, "layers": args.layers}  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-host-cpu.json").write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
