"""CPU throughput of deepinfer's engine on the tiny random DeepSeek-V4, beside a peer and a roofline.

For each shape it prints, in one markdown table:

* deepinfer: ``LLM.generate`` (public API; greedy, ``ignore_eos``, fixed ``max_tokens``);
* the peer, measured in the same run: transformers' ``DeepseekV4ForCausalLM`` with the same fp32 weights
  (prefill: one forward of the same prompts with a KV cache and ``logits_to_keep=1``, as ``generate``
  does; decode: ``generate`` with cache, greedy, the same number of new tokens; equal-length prompts, so
  no padding);
* the roofline of the same work on this machine: the sustained fp32 matmul FLOP/s and copy bandwidth are
  probed in the same run; FLOPs and bytes are counted from the model's parameter shapes. The roofline is
  ``min(compute-bound, memory-bound)`` tokens/s, and the table names the bound and the % reached.

Prefill tokens/s = prompt tokens / time of ``generate(max_tokens=1)`` (prefill + one sampled token).
Decode tokens/s = ``B * N / (t(max_tokens=N+1) - t(max_tokens=1))``: the prefill and the first token are
subtracted, for both systems alike. Every timing is the best of ``--repeats`` runs after a warm-up, the
runs of the two systems interleaved so that foreign load hits both alike.

Run (about 2 minutes on 2 idle cores; ``--quick`` about 15 s)::

    PYTHONPATH=libs:. python bench/engine/cpu_throughput.py [--quick] [--json PATH] [--wait-idle S] [--repeats N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.harness import add_common_args, command_line, git_commit, write_json

FP32 = 4  # bytes per element: the engine runs the tiny model in fp32 on CPU, as does the peer


# -- machine probes ---------------------------------------------------------------------------------


def _best(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def probe_matmul(n=2048, reps=5):
    """Sustained fp32 FLOP/s of an n³ matmul (best of ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    return 2 * n**3 / _best(lambda: torch.matmul(a, b, out=c), reps)


def probe_copy_bandwidth(mib=512, reps=5):
    """Bytes/s of a large tensor copy, counting the read and the write (best of ``reps``)."""
    x = torch.ones(mib * 2**20 // FP32)
    y = torch.empty_like(x)
    return 2 * x.numel() * FP32 / _best(lambda: y.copy_(x), reps)


def _busy_seconds():
    """CPU-seconds all cores have spent busy since boot (``/proc/stat``), or None off Linux."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Share of the machine's cores that *other* processes kept busy between start() and share()."""

    def start(self):
        self.busy, self.own, self.wall = _busy_seconds(), sum(os.times()[:2]), time.perf_counter()
        return self

    def share(self):
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return float("nan")
        own = sum(os.times()[:2]) - self.own
        wall = time.perf_counter() - self.wall
        return max(0.0, (busy - self.busy - own) / (wall * os.cpu_count()))


def wait_until_idle(limit_s, threshold=0.05, window_s=5.0):
    """Wait (up to ``limit_s``) for a ``window_s`` window in which other processes use < threshold of the cores."""
    deadline = time.monotonic() + limit_s
    while True:
        load = OtherLoad().start()
        time.sleep(window_s)
        share = load.share()
        if share < threshold or time.monotonic() >= deadline:
            return share
        log(f"  other processes use {100 * share:.0f}% of the cores; waiting ...")


def probe_op_overhead(n=20000):
    """Seconds of one eager op on a one-element tensor: the dispatch floor of every torch call."""
    z = torch.zeros(1)

    def loop():
        for _ in range(n):
            z.add_(1)

    return _best(loop, 3) / n


# -- work of the tiny model -------------------------------------------------------------------------


@dataclass
class ModelWork:
    """FLOPs and bytes of one token of the model, from its parameter shapes (MTP is not run)."""

    config: object
    trunk_matmul_params: int = 0  # weights every token multiplies by (attention, indexer, mHC, gates, shared)
    trunk_other_params: int = 0  # norms, biases, sinks, APE: read but no matmul
    expert_params: int = 0  # one routed expert (w1 + w2 + w3)
    moe_layers: int = 0
    head_params: int = 0
    embed_dim: int = 0
    total_params: int = 0

    @classmethod
    def of(cls, model):
        c = model.config
        w = cls(config=c, embed_dim=c.hidden_size)
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                continue
            w.total_params += p.numel()
            if name == "embed.weight":
                continue
            if name == "head.weight":
                w.head_params = p.numel()
            elif name.endswith((".ffn.w1", ".ffn.w2", ".ffn.w3")):
                w.expert_params += p[0].numel()
                if name.endswith(".w1"):
                    w.moe_layers += 1
            elif p.dim() == 2 and not name.endswith(".ape"):
                w.trunk_matmul_params += p.numel()
            else:
                w.trunk_other_params += p.numel()
        w.expert_params //= max(w.moe_layers, 1)
        return w

    @property
    def active_trunk_params(self):
        return self.trunk_matmul_params + self.config.num_experts_per_tok * self.expert_params * self.moe_layers

    def unique_experts(self, tokens):
        """Expected experts touched per layer by ``tokens`` tokens under uniform top-k routing."""
        e, k = self.config.n_routed_experts, self.config.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def attention(self, pos):
        """(FLOPs, KV bytes read) of attention for one query at absolute position ``pos``, all layers.

        Counts the algorithmic work: the window, every complete HCA row, the indexer's scan of the CSA
        index keys and the top-k CSA rows (the reference ops compute over all rows and mask)."""
        c = self.config
        flops = kv = 0
        for layer in range(c.num_hidden_layers):
            keys = min(pos + 1, c.sliding_window)
            m = c.ratio(layer)
            if m:
                rows = (pos + 1) // m
                if c.layer_kind(layer) == "csa":
                    flops += 2 * c.index_n_heads * c.index_head_dim * rows
                    kv += rows * c.index_head_dim * FP32
                    keys += min(rows, c.index_topk)
                else:
                    keys += rows
            flops += 2 * 2 * c.num_attention_heads * c.head_dim * keys  # QK^T and PV
            kv += keys * c.head_dim * FP32  # MQA: one shared KV row per key
        return flops, kv

    def step(self, positions, logit_rows):
        """(FLOPs, bytes) of one forward over tokens at ``positions`` (all sequences) with ``logit_rows``
        rows through the head. Weights are read once per step; routed experts as touched."""
        n = len(positions)
        flops = n * 2 * self.active_trunk_params + logit_rows * 2 * self.head_params
        weights = self.trunk_matmul_params + self.trunk_other_params + self.head_params
        weights += self.moe_layers * self.unique_experts(n) * self.expert_params
        nbytes = weights * FP32 + n * self.embed_dim * FP32
        for pos in positions:
            f, kv = self.attention(pos)
            flops, nbytes = flops + f, nbytes + kv
        return flops, nbytes


def roofline(steps, work, flops_per_s, bytes_per_s):
    """Roofline of a sequence of steps [(positions, logit_rows)]: (tokens/s, bound) of the lower bound."""
    flops = nbytes = 0.0
    for positions, rows in steps:
        f, b = work.step(positions, rows)
        flops, nbytes = flops + f, nbytes + b
    t_compute, t_memory = flops / flops_per_s, nbytes / bytes_per_s
    return (t_compute, "compute") if t_compute >= t_memory else (t_memory, "memory")


def prefill_steps(batch, length):
    return [([p for _ in range(batch) for p in range(length)], batch)]


def decode_steps(batch, prompt, new):
    # token t of the N measured ones is fed at position prompt + t (the first token came with prefill)
    return [([prompt + t] * batch, batch) for t in range(new)]


# -- the two systems --------------------------------------------------------------------------------


def interleaved_best(fns, repeats):
    """Warm each callable up once, then run them round-robin ``repeats`` times; best time of each.

    Round-robin spreads any foreign load over all of them; the best of several runs is the least disturbed.
    Returns ({name: seconds}, {name: output of the warm-up call})."""
    outs = {name: fn() for name, fn in fns.items()}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best, outs


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (views included): a load-independent measure of per-op overhead."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn):
    with _OpCounter() as c:
        fn()
    return c.count


class Engine:
    def __init__(self, model_dir, num_pages, max_batched):
        from deepinfer import LLM

        self.llm = LLM(model=model_dir, dtype="float32", num_pages=num_pages, max_num_batched_tokens=max_batched)

    def prefill(self, ids):
        return self.generate(ids, 1)

    def generate(self, ids, max_tokens):
        """A callable running ``LLM.generate`` on the rows of ``ids``; it returns the new token ids."""
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
        return lambda: [o.outputs[0].token_ids for o in self.llm.generate(prompts, params)]


class Peer:
    def __init__(self, model):
        from deepinfer.checkpoint.references import build_hf_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.hf = build_hf_model(model)
        self.hf.generation_config.pad_token_id = 0  # no padding happens: all prompts have equal length

    def prefill(self, ids):
        """One forward with a KV cache, logits of the last row only (what ``generate`` does first)."""
        mask = torch.ones_like(ids)
        return torch.no_grad()(lambda: self.hf(ids, attention_mask=mask, use_cache=True, logits_to_keep=1))

    def generate(self, ids, max_tokens):
        kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, use_cache=True)
        mask = torch.ones_like(ids)
        run = torch.no_grad()(lambda: self.hf.generate(ids, attention_mask=mask, **kw))
        return lambda: run()[:, ids.shape[1] :].tolist()


# -- the benchmark ----------------------------------------------------------------------------------


@dataclass
class Row:
    phase: str
    batch: int
    prompt: int
    new: int
    ours: float  # tokens/s
    peer: float
    roof: float
    bound: str
    ours_ms: float  # ms per step: one decode step, or the whole prefill batch
    peer_ms: float
    roof_ms: float
    ours_ops: float  # aten ops per step
    peer_ops: float
    other_load: float  # share of the cores other processes kept busy while this row was measured
    match: str = ""


def token_match(a, b):
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return f"{same}/{sum(len(r) for r in a)}"


BUSY = 0.10  # foreign load above which a row is measured again


def measure_quietly(fns, repeats, args):
    """``interleaved_best`` plus the foreign load during it; a row measured under more than ``BUSY`` foreign
    load is measured again (up to ``--retries`` times, each after waiting up to 60 s for quiet), and the
    least disturbed attempt is kept. Returns (times, outputs, foreign load)."""
    best = None
    for attempt in range(1 + args.retries):
        if attempt:
            log(f"  other processes kept {100 * best[2]:.0f}% of the cores busy; measuring again ...")
            wait_until_idle(60)
        load = OtherLoad().start()
        t, outs = interleaved_best(fns, repeats)
        share = load.share()
        if best is None or share < best[2]:
            best = (t, outs, share)
        if share <= BUSY:
            break
    return best


def rate(tokens, seconds):
    return tokens / seconds if seconds > 0 else float("nan")


def run(args):
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(threads)
    quick = args.quick
    prefill_shapes = [(1, 128), (8, 128)] if quick else [(1, 128), (8, 128), (1, 512), (8, 512)]
    decode_batches = [1, 8] if quick else [1, 8, 32]
    decode_prompt, decode_new = 32, (8 if quick else 32)
    if getattr(args, "tiny", False):  # the smoke mode: one shape each
        prefill_shapes, decode_batches, decode_new = [(1, 32)], [1], 4
    count_new = 8  # decode ops are counted over 8 tokens (a whole cycle of the 4- and 8-token compressors)
    repeats = args.repeats or (1 if quick else 5)

    from deepinfer import telemetry
    from deepinfer.checkpoint.tiny import make_tiny_model

    telemetry.configure_logging(level="warning")  # keep stdout for the table
    log("building the tiny model and the peer ...")
    tmp = tempfile.TemporaryDirectory(prefix="deepinfer-bench-")
    model_dir = args.model_dir or make_tiny_model(Path(tmp.name) / "tiny")
    max_seqs = max(max(b for b, _ in prefill_shapes), max(decode_batches))
    max_len = max(max(n for _, n in prefill_shapes), decode_prompt + decode_new + 1)
    max_batched = max(8192, max(b * n for b, n in prefill_shapes))  # each prefill batch is one step
    engine = Engine(model_dir, num_pages=4 * max_seqs * (max_len // 256 + 2), max_batched=max_batched)
    peer = Peer(engine.llm.model)
    work = ModelWork.of(engine.llm.model)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.llm.config.vocab_size

    if args.wait_idle:
        log(f"waiting up to {args.wait_idle:.0f} s for the other processes to go quiet ...")
        wait_until_idle(args.wait_idle)
    other = OtherLoad().start()
    t_start = time.perf_counter()
    log(f"probing the machine ({threads} threads) ...")
    probes = {
        "flops": lambda: probe_matmul(reps=3 if quick else 5),
        "bytes": lambda: probe_copy_bandwidth(mib=256 if quick else 512, reps=3 if quick else 5),
        "op": probe_op_overhead,
    }
    _, got, probe_load = measure_quietly(probes, 0, args)
    flops_per_s, bytes_per_s, op_s = got["flops"], got["bytes"], got["op"]
    log(f"  fp32 matmul 2048^3: {flops_per_s / 1e9:.1f} GFLOP/s; copy: {bytes_per_s / 1e9:.2f} GB/s; "
        f"tiny op: {op_s * 1e6:.1f} us")  # fmt: skip

    rows = []
    for batch, length in prefill_shapes:
        log(f"prefill batch={batch} prompt={length} ...")
        ids = torch.randint(2, vocab, (batch, length), generator=gen)
        t, _, share = measure_quietly({"ours": engine.prefill(ids), "peer": peer.prefill(ids)}, repeats, args)
        t_roof, bound = roofline(prefill_steps(batch, length), work, flops_per_s, bytes_per_s)
        n = batch * length
        rows.append(Row("prefill", batch, length, 1, rate(n, t["ours"]), rate(n, t["peer"]), rate(n, t_roof), bound,
                        t["ours"] * 1e3, t["peer"] * 1e3, t_roof * 1e3,
                        count_ops(engine.prefill(ids)), count_ops(peer.prefill(ids)), share))  # fmt: skip

    for batch in decode_batches:
        log(f"decode batch={batch} prompt={decode_prompt} new={decode_new} ...")
        ids = torch.randint(2, vocab, (batch, decode_prompt), generator=gen)
        fns = {
            "ours_1": engine.generate(ids, 1),
            "ours_n": engine.generate(ids, decode_new + 1),
            "peer_1": peer.generate(ids, 1),
            "peer_n": peer.generate(ids, decode_new + 1),
        }
        t, outs, share = measure_quietly(fns, repeats, args)
        t_ours, t_peer = t["ours_n"] - t["ours_1"], t["peer_n"] - t["peer_1"]
        t_roof, bound = roofline(decode_steps(batch, decode_prompt, decode_new), work, flops_per_s, bytes_per_s)
        ops = {k: count_ops(engine.generate(ids, 1 + k)) for k in (0, count_new)}
        ops_ours = (ops[count_new] - ops[0]) / count_new
        ops = {k: count_ops(peer.generate(ids, 1 + k)) for k in (0, count_new)}
        ops_peer = (ops[count_new] - ops[0]) / count_new
        n = batch * decode_new
        rows.append(Row("decode", batch, decode_prompt, decode_new, rate(n, t_ours), rate(n, t_peer), rate(n, t_roof),
                        bound, t_ours / decode_new * 1e3, t_peer / decode_new * 1e3, t_roof / decode_new * 1e3,
                        ops_ours, ops_peer, share, match=token_match(outs["ours_n"], outs["peer_n"])))  # fmt: skip

    other_share, elapsed = other.share(), time.perf_counter() - t_start
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "threads": threads,
            "cpu": cpu_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers_version(),
            "other_processes_cpu_share": other_share,
            "other_processes_cpu_share_during_probes": probe_load,
        },
        "probes": {"fp32_matmul_flops_per_s": flops_per_s, "copy_bytes_per_s": bytes_per_s, "tiny_op_s": op_s},
        "model": {
            "total_params_without_mtp": work.total_params,
            "active_trunk_params_per_token": work.active_trunk_params,
            "head_params": work.head_params,
            "trunk_weight_bytes_per_step": (work.trunk_matmul_params + work.trunk_other_params) * FP32,
            "expert_bytes": work.expert_params * FP32,
            "head_bytes": work.head_params * FP32,
        },
        "elapsed_s": elapsed,
        "settings": {"quick": quick, "repeats": repeats, "decode_prompt": decode_prompt, "decode_new": decode_new},
    }
    return meta, rows


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def transformers_version():
    import transformers

    return transformers.__version__


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def render(meta, rows):
    m, pr, mo = meta["machine"], meta["probes"], meta["model"]
    op_us = pr["tiny_op_s"] * 1e6
    lines = [
        f"Machine: {m['cpu']}, nproc {m['nproc']}, torch threads {m['threads']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}.",
        f"Probes (this run): fp32 matmul 2048³ **{pr['fp32_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s**; "
        f"tensor copy (read+write) **{pr['copy_bytes_per_s'] / 1e9:.2f} GB/s**; one eager op on a 1-element "
        f"tensor **{op_us:.1f} µs** (foreign load {100 * m['other_processes_cpu_share_during_probes']:.0f}%). "
        f"Whole run: {meta['elapsed_s']:.0f} s, other processes kept {100 * m['other_processes_cpu_share']:.0f}% "
        "of the cores busy (waits and re-measured rows included; each row's own figure is in the last column).",
        f"Model (tiny, fp32, MTP not run): {mo['total_params_without_mtp'] / 1e6:.2f} M params; "
        f"per token {mo['active_trunk_params_per_token'] / 1e3:.0f} K active trunk params "
        f"+ head {mo['head_params'] / 1e6:.2f} M (every decode token; in prefill only the last row of each "
        f"prompt). Weights read per step: trunk {mo['trunk_weight_bytes_per_step'] / 1e6:.2f} MB + "
        f"head {mo['head_bytes'] / 1e6:.1f} MB + {mo['expert_bytes'] / 1e3:.0f} KB per routed expert touched.",
        "",
        "| phase | batch | prompt | new | deepinfer tok/s | transformers tok/s | deepinfer / transformers "
        "| roofline tok/s | bound | % of roofline: deepinfer / transformers "
        "| ms per step: deepinfer / transformers / roofline "
        f"| aten ops per step: deepinfer / transformers (× {op_us:.1f} µs) | greedy tokens equal | foreign load |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        floor_ours, floor_peer = r.ours_ops * pr["tiny_op_s"] * 1e3, r.peer_ops * pr["tiny_op_s"] * 1e3
        lines.append(
            f"| {r.phase} | {r.batch} | {r.prompt} | {r.new} | {r.ours:,.0f} | {r.peer:,.0f} | "
            f"{r.ours / r.peer:.2f}× | {r.roof:,.0f} | {r.bound} | "
            f"{100 * r.ours / r.roof:.1f}% / {100 * r.peer / r.roof:.1f}% | "
            f"{r.ours_ms:,.1f} / {r.peer_ms:,.1f} / {r.roof_ms:.2f} | "
            f"{r.ours_ops:,.0f} / {r.peer_ops:,.0f} ({floor_ours:.1f} / {floor_peer:.1f} ms) | {r.match or '—'} | "
            f"{100 * r.other_load:.0f}% |"
        )
    lines += [
        "",
        "- Prefill: `batch` prompts of `prompt` random tokens in one step (ms per step = the whole batch); "
        "deepinfer is `generate(max_tokens=1)`, transformers one forward with `logits_to_keep=1`. "
        "Decode: the `new` tokens after the first, `batch` sequences per step; for both systems "
        "t(new + 1 tokens) − t(1 token). Each time is the best of "
        f"{meta['settings']['repeats']} runs after a warm-up, the two systems' runs interleaved. "
        "Foreign load: the share of the cores other processes kept busy while the row was measured.",
        "- Roofline = min(compute-bound, memory-bound) tokens/s for the same tokens, from the probes above: "
        "FLOPs = 2 × active params + attention (window, HCA rows, CSA indexer scan + top-k rows); bytes = "
        "weights read once per step (routed experts as touched under uniform routing) + embedding rows + KV read. "
        "Activations, sampling and Python are not counted.",
        "- At this size (hidden 64, 6 layers) neither FLOPs nor bytes set the pace: a step is thousands of "
        "tiny eager torch ops, each costing microseconds of dispatch, so both systems reach only a few % of "
        "the roofline. The aten-op count (views included; counted separately, not timed) × the tiny-op probe "
        "is the dispatch floor in brackets; it is load-independent and says where a gap between the two "
        "systems comes from.",
    ]
    if max(r.other_load for r in rows) > BUSY:
        lines.append(
            f"- **Warning:** other processes kept more than {100 * BUSY:.0f}% of the cores busy during some rows. "
            "With as many torch threads as cores, a parallel op then waits for a descheduled thread, so the "
            "figures are pessimistic and noisy (ops on tiny tensors such as `index_add_` took milliseconds "
            "instead of microseconds in such runs); distrust the rows with a high foreign load. Re-run on a quiet "
            "machine (`--wait-idle`)."
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, fewer tokens, one repeat")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--repeats", type=int, help="timed runs per measurement, best taken (default 5; --quick 1)")
    ap.add_argument("--retries", type=int, default=3, help="re-measure a row disturbed by other processes (default 3)")
    ap.add_argument("--threads", type=int, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for other processes to leave the cores idle")  # fmt: skip
    ap.add_argument("--model-dir", help="an existing tiny checkpoint (default: a fresh make_tiny_model)")
    add_common_args(ap, out_help="write DIR/<date>-cpu-throughput.json")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        raise SystemExit("cpu_throughput measures the CPU: run it with --device cpu (or no --device)")
    args.quick = args.quick or args.tiny
    if args.tiny:
        args.retries = 0
    meta, rows = run(args)
    print(render(meta, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    if args.out:
        res = {**meta, "command": command_line(), "git": git_commit(), "rows": [asdict(r) for r in rows]}
        write_json(args.out / f"{time.strftime('%Y-%m-%d')}-cpu-throughput.json", res)


if __name__ == "__main__":
    main()
