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
subtracted, for both systems alike. Every timing is the median of ``--repeats`` runs after a warm-up.

Run (about 5 minutes on 2 cores; ``--quick`` about 1)::

    PYTHONPATH=libs:tests python bench/cpu_throughput.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "libs", ROOT / "tests"):  # so that a plain `python bench/cpu_throughput.py` works too
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

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


def median_time(fn, repeats):
    fn()  # warm-up at the same shape
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


class Engine:
    name = "deepinfer"

    def __init__(self, model_dir, num_pages, max_batched):
        from deepinfer import LLM

        self.llm = LLM(model=model_dir, dtype="float32", num_pages=num_pages, max_num_batched_tokens=max_batched)

    def run(self, ids, max_tokens, repeats):
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
        t, outs = median_time(lambda: self.llm.generate(prompts, params), repeats)
        return t, [o.outputs[0].token_ids for o in outs]


class Peer:
    name = "transformers"

    def __init__(self, model):
        from models.hf_reference import build_hf_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.hf = build_hf_model(model)
        self.hf.generation_config.pad_token_id = 0  # no padding happens: all prompts have equal length

    @torch.no_grad()
    def prefill(self, ids, repeats):
        mask = torch.ones_like(ids)
        t, _ = median_time(lambda: self.hf(ids, attention_mask=mask, use_cache=True, logits_to_keep=1), repeats)
        return t

    @torch.no_grad()
    def run(self, ids, max_tokens, repeats):
        kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, use_cache=True)
        mask = torch.ones_like(ids)
        t, out = median_time(lambda: self.hf.generate(ids, attention_mask=mask, **kw), repeats)
        return t, out[:, ids.shape[1] :].tolist()


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
    ours_ms: float  # ms per step (decode) or per batch (prefill)
    peer_ms: float
    roof_ms: float
    match: str = ""
    extra: dict = field(default_factory=dict)


def token_match(a, b):
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    return f"{same}/{total}"


def run(args):
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(threads)
    quick = args.quick
    prefill_shapes = [(1, 128), (8, 128)] if quick else [(1, 128), (8, 128), (1, 512), (8, 512)]
    decode_batches = [1, 8] if quick else [1, 8, 32]
    decode_prompt, decode_new = 32, 8 if quick else 32
    repeats = 1 if quick else 3
    if args.wait_idle:
        log(f"waiting up to {args.wait_idle:.0f} s for the other processes to go quiet ...")
        wait_until_idle(args.wait_idle)
    other = OtherLoad().start()
    t_start = time.perf_counter()

    log(f"probing the machine ({threads} threads) ...")
    flops_per_s = probe_matmul(reps=3 if quick else 5)
    bytes_per_s = probe_copy_bandwidth(mib=256 if quick else 512, reps=3 if quick else 5)
    log(f"  fp32 matmul 2048^3: {flops_per_s / 1e9:.1f} GFLOP/s; copy: {bytes_per_s / 1e9:.2f} GB/s")

    from deepinfer import telemetry
    from deepinfer.checkpoint.tiny import make_tiny_model

    telemetry.configure_logging(level="warning")  # keep stdout for the table

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

    rows = []
    for batch, length in prefill_shapes:
        log(f"prefill batch={batch} prompt={length} ...")
        ids = torch.randint(2, vocab, (batch, length), generator=gen)
        t_ours, _ = engine.run(ids, 1, repeats)
        t_peer = peer.prefill(ids, repeats)
        t_roof, bound = roofline(prefill_steps(batch, length), work, flops_per_s, bytes_per_s)
        n = batch * length
        rows.append(Row("prefill", batch, length, 1, n / t_ours, n / t_peer, n / t_roof, bound,
                        t_ours * 1e3, t_peer * 1e3, t_roof * 1e3))  # fmt: skip

    for batch in decode_batches:
        log(f"decode batch={batch} prompt={decode_prompt} new={decode_new} ...")
        ids = torch.randint(2, vocab, (batch, decode_prompt), generator=gen)
        t1_ours, _ = engine.run(ids, 1, repeats)
        tn_ours, toks_ours = engine.run(ids, decode_new + 1, repeats)
        t1_peer, _ = peer.run(ids, 1, repeats)
        tn_peer, toks_peer = peer.run(ids, decode_new + 1, repeats)
        t_ours, t_peer = tn_ours - t1_ours, tn_peer - t1_peer
        t_roof, bound = roofline(decode_steps(batch, decode_prompt, decode_new), work, flops_per_s, bytes_per_s)
        n = batch * decode_new
        rows.append(Row("decode", batch, decode_prompt, decode_new, n / t_ours, n / t_peer, n / t_roof, bound,
                        t_ours / decode_new * 1e3, t_peer / decode_new * 1e3, t_roof / decode_new * 1e3,
                        match=token_match(toks_ours, toks_peer),
                        extra={"ours_prefill_s": t1_ours, "peer_prefill_s": t1_peer}))  # fmt: skip

    other_share, elapsed = other.share(), time.perf_counter() - t_start
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "threads": threads,
            "cpu": cpu_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers_version(),
            "other_processes_cpu_share": other_share,
        },
        "probes": {"fp32_matmul_flops_per_s": flops_per_s, "copy_bytes_per_s": bytes_per_s},
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
    lines = [
        f"Machine: {m['cpu']}, nproc {m['nproc']}, torch threads {m['threads']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}.",
        f"Probes (this run): fp32 matmul 2048³ **{pr['fp32_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s**; "
        f"tensor copy (read+write) **{pr['copy_bytes_per_s'] / 1e9:.2f} GB/s**. "
        f"Other processes kept {100 * m['other_processes_cpu_share']:.0f}% of the cores busy during the run "
        f"({meta['elapsed_s']:.0f} s).",
        f"Model (tiny, fp32, MTP not run): {mo['total_params_without_mtp'] / 1e6:.2f} M params; "
        f"per token {mo['active_trunk_params_per_token'] / 1e3:.0f} K active trunk params "
        f"+ head {mo['head_params'] / 1e6:.2f} M (decode only; prefill runs the head on the last row). "
        f"Weights read per step: trunk {mo['trunk_weight_bytes_per_step'] / 1e6:.2f} MB + "
        f"head {mo['head_bytes'] / 1e6:.1f} MB + {mo['expert_bytes'] / 1e3:.0f} KB per routed expert touched.",
        "",
        "| phase | batch | prompt | new | deepinfer tok/s | transformers tok/s | deepinfer / transformers "
        "| roofline tok/s | bound | deepinfer % roof | transformers % roof | ms per step: deepinfer / transformers "
        "/ roofline | greedy tokens equal |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.batch} | {r.prompt} | {r.new} | {r.ours:,.1f} | {r.peer:,.1f} | "
            f"{r.ours / r.peer:.2f}× | {r.roof:,.0f} | {r.bound} | {100 * r.ours / r.roof:.2f}% | "
            f"{100 * r.peer / r.roof:.2f}% | {r.ours_ms:,.1f} / {r.peer_ms:,.1f} / {r.roof_ms:.2f} | "
            f"{r.match or '—'} |"
        )
    lines += [
        "",
        "Prefill: one step of `batch × prompt` tokens (ms per step = the whole batch). Decode: the `new` tokens "
        "after the first, `batch` sequences per step (ms per step = one decode step).",
        "Roofline = min(FLOPs / matmul probe, bytes / copy probe) for the same tokens: FLOPs = 2 × active params "
        "+ attention (window, HCA rows, CSA indexer scan + top-k); bytes = weights read once per step (routed "
        "experts as touched under uniform routing) + embedding rows + KV read. Activations, sampling and "
        "Python are not counted, so at these tiny sizes (a 64-wide model) both systems sit far below it: "
        "the step time is dominated by per-op dispatch (thousands of small torch ops per step), not by FLOPs "
        "or bytes.",
    ]
    if m["other_processes_cpu_share"] > 0.1:
        lines.append(
            f"**Warning:** other processes kept {100 * m['other_processes_cpu_share']:.0f}% of the cores busy "
            "during the run. With as many torch threads as cores, every parallel op then waits for a thread "
            "that has been descheduled, so the figures are pessimistic and noisy (torch ops on tiny tensors, "
            "e.g. `index_add_`, can take milliseconds instead of microseconds). Re-run on a quiet machine "
            "(`--wait-idle`)."
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, fewer tokens, one repeat (~1 min)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--threads", type=int, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="S",
                    help="first wait up to S seconds for other processes to leave the cores idle")  # fmt: skip
    ap.add_argument("--model-dir", help="an existing tiny checkpoint (default: a fresh make_tiny_model)")
    args = ap.parse_args(argv)
    meta, rows = run(args)
    print(render(meta, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
