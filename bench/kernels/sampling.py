"""The sampler on one GPU: the Triton kernel (``kernels.sampling``) against the torch sampler it replaces, beside the
HBM roofline of reading the logits once.

For each batch size and parameter mix, at DeepSeek-V4's vocabulary (129280), in one process, interleaved:

- ``torch``: ``Sampler(kernel=False)`` (log_softmax, a stable sort of the vocabulary for top-k / top-p, a generator
  and a draw per seeded row), the peer;
- ``kernel``: ``Sampler(kernel=True)`` (the host packs the parameters, one copy, two launches);
- ``launches`` (``kernel_only_ms``): the two launches alone, timed with CUDA events over ``--calls`` calls (bound
  by the host's launch cost when the work is small);
- ``graphed``: the same, 10 calls captured in a CUDA graph (the kernels' device time, no launch cost);
- the roofline: ``B · V · 4`` bytes over 4.8 TB/s.

Then the top logprobs a request asks for (``logprobs`` / ``prompt_logprobs``, up to 20 a row): ``sampler._top_sorted``
(ours: ``topk`` of an order-preserving integer key per token, exact ties by id) against the stable sort of the whole
vocabulary it replaced (the peer), wall time per call at each batch size, ``--top-k`` a row, same roofline
(``--top-only``: this section alone).

Both sampler columns are wall time per call including the host's work and the wait for the tokens (the worker reads
them right after). Logits: ``zipf`` (a peaked distribution, as a language model's: ``-1.1 · log(rank)`` over a random
permutation, plus noise) or ``flat`` (``randn``, where top-p needs several rejection rounds).

    PYTHONPATH=libs:. python bench/kernels/sampling.py --batches 1,16,64,256 --out bench/results
    PYTHONPATH=libs:. python bench/kernels/sampling.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode runs both samplers and the two launches at a vocabulary of 512, batches 1 and 2, three mixes, zipf
logits, on the host's clock (the kernels in Triton's interpreter); the graphed column (a CUDA graph) is skipped there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.harness import add_common_args, device_name, interpret_if_cpu, note_skipped, per_call_us, pick_device, sync

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

from deepinfer.engine.sampler import Sampler, _top_sorted  # noqa: E402
from deepinfer.kernels.sampling import pack_params, sample  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

HBM_BPS = 4.8e12
MIXES = {
    "greedy": lambda i: (SamplingParams(temperature=0), None),
    "t1": lambda i: (SamplingParams(temperature=1.0), None),
    "topk50_topp0.95": lambda i: (SamplingParams(temperature=0.8, top_k=50, top_p=0.95), None),
    "topp0.9_seeded": lambda i: (SamplingParams(temperature=1.0, top_p=0.9, seed=i), 1000 + i),
    "minp0.05": lambda i: (SamplingParams(temperature=1.0, min_p=0.05), None),
    "topk1000": lambda i: (SamplingParams(temperature=1.0, top_k=1000), None),
    "topp0.5_minp0.1": lambda i: (SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1), None),
}


def make_logits(kind: str, b: int, v: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        return torch.randn(b, v, generator=g).to(dev)
    rank = torch.arange(1, v + 1, dtype=torch.float32)
    rows = [(-1.1 * rank.log())[torch.randperm(v, generator=g)] + 0.3 * torch.randn(v, generator=g) for _ in range(b)]
    return torch.stack(rows).to(dev)


def wall(fn, reps: int, dev: torch.device | None = None) -> float:
    times = []
    for _ in range(reps):
        sync(dev or "cuda")
        t = time.perf_counter()
        fn()
        sync(dev or "cuda")
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def device_ms(fn, calls: int, dev: torch.device | None = None) -> float:
    if dev is not None and dev.type != "cuda":  # the smoke mode: the host's clock
        return per_call_us(fn, calls) / 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def graphed_ms(fn, calls: int = 10, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return device_ms(graph.replay, replays) / calls


def top_logprobs(args: argparse.Namespace, dev: torch.device) -> list[dict]:
    """Ours (``_top_sorted``) against the full stable sort per batch size, the same selection asserted."""
    rows = []
    print(f"\n| batch | top {args.top_k}: ours ms | full sort ms (peer) | × peer | roofline ms |")
    print("|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        lp = torch.log_softmax(make_logits("zipf", b, args.vocab, dev), dim=-1)
        k = min(args.top_k, args.vocab)
        peer = lambda lp=lp, k=k: torch.sort(lp, dim=-1, descending=True, stable=True)[1][:, :k].tolist()  # noqa: E731
        ours = lambda lp=lp, k=k: _top_sorted(lp, k)[1].tolist()  # noqa: E731
        assert ours() == peer(), "the top-k selection must be the stable sort's head"
        t_ours, t_peer = [], []
        for _ in range(2):  # interleaved
            t_ours.append(wall(ours, args.reps, dev))
            t_peer.append(wall(peer, args.reps, dev))
        r = {
            "batch": b,
            "k": k,
            "ours_ms": min(t_ours),
            "sort_ms": min(t_peer),
            "roofline_ms": b * args.vocab * 4 / HBM_BPS * 1e3,
        }
        rows.append(r)
        print(f"| {b} | {r['ours_ms']:.3f} | {r['sort_ms']:.3f} | {r['sort_ms'] / r['ours_ms']:.1f} | "
              f"{r['roofline_ms']:.4f} |", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--mixes", default="greedy,t1,topk50_topp0.95,topp0.9_seeded,minp0.05", help=",".join(MIXES))
    ap.add_argument("--logits", default="zipf,flat")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=20, help="top logprobs a row (OpenAI's most: 20)")
    ap.add_argument("--top-only", action="store_true", help="only the top-logprobs section")
    add_common_args(ap)
    ap.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-sampling")
    args = ap.parse_args()
    dev = pick_device(args)
    if args.tiny:  # the interpreter runs a program at a time: a small vocabulary, few rows
        args.batches, args.vocab, args.mixes, args.logits = "1,2", 512, "greedy,topk50_topp0.95,topp0.9_seeded", "zipf"
        args.reps, args.calls = 1, 1
    skipped = {} if dev.type == "cuda" else {"graphed ms": "a CUDA graph", "launches ms": "host clock, not CUDA events"}
    note_skipped(skipped)
    torch_s, kern_s = Sampler(kernel=False), Sampler(kernel=True)
    rows = []
    print("| logits | mix | batch | torch ms | kernel ms | launches ms | graphed ms | roofline ms | graphed × roof |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in [] if args.top_only else args.logits.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            logits = make_logits(kind, b, args.vocab, dev)
            for mix in args.mixes.split(","):
                ps, seeds = zip(*(MIXES[mix](i) for i in range(b)))
                ps, seeds = list(ps), list(seeds)
                packed = pack_params(
                    [0.0 if p.greedy else p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                    [p.min_p for p in ps], [s if s is not None else 7 + i for i, s in enumerate(seeds)], args.vocab,
                ).to(dev)  # fmt: skip
                t_torch, t_kern = [], []
                run_torch = lambda lg=logits, ps=ps, sd=seeds: torch_s(lg, ps, sd).token_ids.tolist()  # noqa: E731
                run_kern = lambda lg=logits, ps=ps, sd=seeds: kern_s(lg, ps, sd).token_ids.tolist()  # noqa: E731
                for _ in range(2):  # interleaved
                    t_torch.append(wall(run_torch, args.reps, dev))
                    t_kern.append(wall(run_kern, args.reps, dev))
                only = device_ms(lambda lg=logits, pk=packed: sample(lg, lg, pk), args.calls, dev)
                graphed = graphed_ms(lambda lg=logits, pk=packed: sample(lg, lg, pk)) if dev.type == "cuda" else None
                roof = b * args.vocab * 4 / HBM_BPS * 1e3
                if mix == "greedy":
                    got = kern_s(logits, ps, seeds).token_ids
                    assert torch.equal(got, logits.argmax(-1)), "greedy rows must be the first maximum"
                r = {"logits": kind, "mix": mix, "batch": b, "torch_ms": min(t_torch), "kernel_ms": min(t_kern),
                     "kernel_only_ms": only, "graphed_ms": graphed, "roofline_ms": roof}  # fmt: skip
                rows.append(r)
                g = ("—", "—") if graphed is None else (f"{graphed:.3f}", f"{graphed / roof:.1f}")
                print(f"| {kind} | {mix} | {b} | {r['torch_ms']:.3f} | {r['kernel_ms']:.3f} | {only:.3f} | "
                      f"{g[0]} | {roof:.4f} | {g[1]} |", flush=True)  # fmt: skip
    top = top_logprobs(args, dev)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else device_name(dev)
        meta = {"gpu": gpu, "torch": torch.__version__, "vocab": args.vocab}
        if skipped:
            meta["skipped"] = skipped
        (args.out / f"{args.name}.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "top_logprobs": top}, indent=1)
        )


if __name__ == "__main__":
    main()
