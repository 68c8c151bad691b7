"""DeepSeek-V4.1 on one GPU: decode and prefill of a V4.1-Flash-width model against the roofline and a peer.

The V4.1 counterpart of ``bench/engine/sweep.py`` (whose timing, budget and ceiling helpers it uses):

* **ours**: ``DeepseekV41Model`` with ``get_ops("nvidia")`` (``cpu`` on ``--device cpu``), bf16, random weights,
  ``N`` layers of V4.1-Flash width (default 4: SWA + Engram, Full ratio 2, Full ratio 1 = candidate source,
  Reindex ratio 1; layers ``0 .. N/2-1`` encoder), the released cache formats on (FP8 window, NVFP4 rows, MXFP4
  index keys, simulated). Engram tables are small (the lookup reads 24 rows per token whatever their size); the
  Engram map is synthetic (the hash needs no tokenizer to be timed). No DSpark stages. Decode: ``--contexts``
  sequences get a ``--context``-token prompt, a batch of ``B`` is cloned from them (own state, own pages), then
  single-token steps of the whole batch are timed (forward + logits of every row). Prefill: one sequence of ``L``
  tokens (chunked by ``--chunk``) + the logits of its last row; exact (the decoder sees every token).
* **peer**: NeMo AutoModel 0.7.0's ``DeepseekV41ForCausalLM`` (the public reference port; eager attention,
  torch experts) on the same config, bf16, its own random weights: **prefill only** — it has no KV cache, so it has
  no decode step to compare with (a decode "step" there would be a full forward).
* **roofline** of the same work in the released formats (``checkpoint.names_v41.expected_tensors``): FP8 32×32
  dense tensors with their scales, MXFP4 experts with scales, bf16 / fp32 where the release keeps them; a decode
  step reads the dense weights once, ``E·(1−(1−k/E)^B)`` distinct experts per layer, per sequence the Engram rows
  (24 × 264 B per Engram layer), the window rows (528 B), the selected compressed rows (≤ index_topk × 288 B) and
  the index keys the index sources score (68 B each; Reindex layers at most the candidate pool).
  ``roofline_ms = max(bytes / copy GB/s, FLOPs / FP8 TFLOP/s)`` with the ceilings measured in the same run.

``--ab`` adds, per decode batch, the interleaved A/B of ``bench/engine/decode_ab.py`` (eager unfused / eager fused /
CUDA
graphs, each on its own copy of the states and pages; one ``torch.profiler`` step each: host kernel launches, graph
launches, host-to-device copies, host syncs, device busy time) and checks the graphs against eager bit for bit; the
plain decode rows run the op set's default (graphs on with ``DEEPINFER_CUDA_GRAPHS``) and record the graph replays
and any capture failure.

Run on one GPU::

    PYTHONPATH=libs:. python bench/engine/sweep_v41.py --out bench/results

Smoke test on CPU::

    PYTHONPATH=libs:. python bench/engine/sweep_v41.py --tiny --device cpu --no-peer --out /tmp/sweep
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import decode_ab
from bench.engine.sweep import (
    PIPELINED_STEPS,
    Budget,
    Skip,
    failure,
    free,
    host_and_pipelined,
    log,
    probe_ceilings,
    profile_prefill,
    run_timed,
)
from bench.engine.weight_sets import OrderSets, WeightSets
from bench.harness import device_name as gpu_name
from bench.harness import sync, timed, versions
from deepinfer.checkpoint.names_v41 import expected_tensors  # noqa: E402
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import SequenceState  # noqa: E402
from deepinfer.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from deepinfer.models.deepseek_v41.engram import bucket_primes  # noqa: E402
from deepinfer.models.deepseek_v41.family import FAMILY as V41_FAMILY  # noqa: E402
from deepinfer.models.deepseek_v41.layout import layer_specs  # noqa: E402
from deepinfer.models.deepseek_v41.model import DeepseekV41Model  # noqa: E402
from deepinfer.ops import get_ops  # noqa: E402
from deepinfer.quant.native import prepare_native  # noqa: E402

COMPRESSED_VOCAB = 99092


def build_config(args: argparse.Namespace, dspark: int = 0) -> DeepseekV41Config:
    """N layers: SWA (+Engram), Full 2, Full 1 (candidate source), then Reindex 1 / Reuse 1 alternating; ``dspark``
    DSpark stages (the released 3 read the last 3 layers' features; default none)."""
    n = args.layers
    if n < 4:
        raise SystemExit("--layers must be >= 4 (SWA, Full 2, Full 1, Reindex 1)")
    ratios = [0, 2] + [1] * (n - 2)
    dec = n // 2
    kv = [1, dec]  # the decoder's KV source is its first layer (bounded replay needs that)
    if ratios[dec] != 1:
        raise SystemExit("internal: the first decoder layer must be ratio 1")
    idx = sorted({1, dec} | set(range(dec + 1, n, 2)))
    vocab, heads, ngram = 401, 8, 4
    rows = [sum(p) for p in bucket_primes([0], vocab, heads, ngram)]
    text = dict(
        num_hidden_layers=n,
        compress_ratios=ratios + [0] * dspark,  # (the DSpark stages: SWA only)
        kv_source_layer_ids=kv,
        index_source_layer_ids=idx,
        candidate_source_layer_id=dec,
        engram_layer_ids=[0],
        engram_num_embeddings=rows,
        engram_vocab_size=vocab,
        engram_n_heads=heads,
        engram_max_ngram_size=ngram,
        engram_compressed_vocab_size=COMPRESSED_VOCAB,
        num_nextn_predict_layers=dspark,
        dspark_target_layer_ids=list(range(max(n - 3, 0), n)) if dspark else [n - 1],
    )
    if args.tiny:
        text.update(hidden_size=256, moe_intermediate_size=128, num_attention_heads=8, head_dim=128, q_lora_rank=128,
                    o_lora_rank=64, o_groups=2, n_routed_experts=16, num_experts_per_tok=2, index_n_heads=4,
                    index_head_dim=64, engram_head_dim=32, vocab_size=129280)  # fmt: skip
    raw = {"model_type": "deepseek_v41", "text_config": text, "vision_config": {"num_hidden_layers": 0}}
    return DeepseekV41Config.from_dict(raw)


class Work:
    """Bytes (released formats) and FLOPs of the bench model."""

    def __init__(self, config: DeepseekV41Config) -> None:
        self.c = c = config.text_config
        self.specs = layer_specs(c)[: c.num_hidden_layers]
        self.dense = self.expert = self.per_token = 0.0
        self.matmul = self.head = self.expert_params = 0
        for name, spec in expected_tensors(config).items():
            n = math.prod(spec.shape)
            if name == "embed.weight":
                self.per_token += 2 * spec.shape[1]
            elif ".ffn.experts." in name:
                if name.startswith("layers.0."):
                    self.expert += n / 2 + n / 32 if spec.kind == "mxfp4" else 2 * n
                    self.expert_params += n
            elif spec.kind == "fp8_row":  # Engram tables: the rows a token reads
                self.per_token += c.num_engram_hashes * (spec.shape[1] + spec.shape[1] / 32)
            else:
                if spec.kind == "fp8":
                    self.dense += n + math.ceil(spec.shape[0] / 32) * math.ceil(spec.shape[1] / 32)
                else:
                    self.dense += (4 if spec.kind == "fp32" else 2) * n
                if name == "head.weight":
                    self.head = n
                elif len(spec.shape) == 2:
                    self.matmul += n
        self.expert /= c.n_routed_experts  # layer 0's w1, w2, w3 of every expert → one expert's bytes
        self.expert_params //= c.n_routed_experts

    def unique_experts(self, tokens: int) -> float:
        e, k = self.c.n_routed_experts, self.c.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def attention(self, pos: int) -> tuple[float, float]:
        """(FLOPs, bytes read) of one query at position ``pos``, all layers."""
        c = self.c
        flops = nbytes = 0.0
        pool = c.candidate_topk_blocks * c.candidate_block_size
        for s in self.specs:
            keys = min(pos + 1, c.sliding_window)
            nbytes += keys * (c.head_dim + c.head_dim / 32)  # FP8 window rows, 528 B at Flash width
            if s.ratio:
                rows = (pos + 1) // s.ratio
                sel = min(rows, c.index_topk)
                keys += sel
                nbytes += sel * (c.head_dim / 2 + c.head_dim / 16)  # NVFP4 rows, 288 B
                if s.is_index_source:
                    scored = min(rows, pool) if s.uses_candidates else rows
                    flops += 2 * c.index_n_heads * c.index_head_dim * scored
                    nbytes += scored * (c.index_head_dim / 2 + c.index_head_dim / 32)  # MXFP4 keys, 68 B
            flops += 4 * c.num_attention_heads * c.head_dim * keys
        return flops, nbytes

    def active(self) -> float:
        layers = self.c.num_hidden_layers
        return self.matmul + self.head + layers * self.c.num_experts_per_tok * self.expert_params

    def decode(self, batch: int, context: int, bw: float, peak: float, rows: int = 1) -> dict[str, float]:
        """One decode step of ``batch`` sequences at ``context``; ``rows`` > 1: a speculative verify step, each
        sequence ``rows`` rows (its token and its drafts) over the same context."""
        attn_flops, kv = self.attention(context)
        tokens = batch * rows
        experts = self.c.num_hidden_layers * self.unique_experts(tokens) * self.expert
        nbytes = self.dense + experts + tokens * self.per_token + batch * kv
        flops = tokens * (2 * self.active() + attn_flops)
        t_mem, t_fl = nbytes / bw, flops / peak
        return {"roofline_ms": 1e3 * max(t_mem, t_fl), "roofline_mem_ms": 1e3 * t_mem, "bytes_GB": nbytes / 1e9,
                "kv_MB_per_seq": kv / 1e6, "unique_experts_per_layer": self.unique_experts(batch)}  # fmt: skip

    def prefill(self, tokens: int, bw: float, peak: float) -> dict[str, float]:
        per_tok = self.active() - self.head
        flops = 2.0 * (per_tok * tokens + self.head)
        flops += sum(self.attention(p)[0] for p in range(0, tokens, max(1, tokens // 256))) * max(1, tokens // 256)
        nbytes = self.dense + self.c.num_hidden_layers * self.unique_experts(tokens) * self.expert
        nbytes += tokens * self.per_token
        t_mem, t_fl = nbytes / bw, flops / peak
        return {"roofline_ms": 1e3 * max(t_mem, t_fl), "fp8_flop_ms": 1e3 * t_fl, "TFLOP": flops / 1e12}


@torch.no_grad()
def build_ours(
    config: DeepseekV41Config, dev: torch.device, seed: int, quantize: tuple[int, int] | None = None
) -> DeepseekV41Model:
    """Built on the device in bf16 (a V4.1-Flash layer holds ~27 GB of bf16 experts), random weights, fp32 where
    the engine keeps fp32. ``quantize`` (the FP8 block): each part (the embedding, each layer, each DSpark stage, ...)
    is made, filled and switched to the stored formats (``prepare_native``) before the next is made, so only one
    part is ever held in bf16 (4 layers and 3 DSpark stages at Flash width do not fit the H200 in bf16 at once)."""
    ops = get_ops("nvidia" if dev.type == "cuda" else "cpu")
    token_map = [i % COMPRESSED_VOCAB for i in range(config.vocab_size)]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta") if quantize else dev:
            model = DeepseekV41Model(config, ops, token_map)
    finally:
        torch.set_default_dtype(prev)
    model.step_graphs = V41_FAMILY.step_graphs()  # as the engine's build: graphs where the op set allows them
    g = torch.Generator(device=dev).manual_seed(seed)
    if quantize is None:
        for name, p in model.named_parameters():
            _fill(name, p, g)
        return model.eval()
    parts = [
        (f"{n}.{i}", m) if isinstance(c, torch.nn.ModuleList) else (n, c)
        for n, c in model.named_children()
        for i, m in (enumerate(c) if isinstance(c, torch.nn.ModuleList) else [(None, c)])
    ]  # each layer and each DSpark stage alone
    for cname, child in parts:
        if not any(t.is_meta for t in (*child.parameters(), *child.buffers())):
            continue  # (made off the meta device: the Engram hasher's host tables)
        child.to_empty(device=dev)
        for name, p in child.named_parameters(prefix=cname):
            _fill(name, p, g)
        prepare_native(child, quantize, quantize=True)
        free(dev)
    for name, p in list(model.named_parameters(recurse=False)):
        model._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=dev), requires_grad=False)
        _fill(name, model._parameters[name], g)
    return model.eval()


def _fill(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    keep32 = ("hc_", "attn_sink", "gate.bias", "head.weight", "compressor.w", "norm")
    if any(k in name for k in keep32) and "markov_head" not in name:  # (the Markov head is bf16, as released)
        p.data = p.data.float()
    if name.endswith(("norm.weight", "q_weight", "k_weight")) or name.endswith("scale"):
        p.fill_(1.0)
    elif p.dim() == 1 or name.endswith(".fn"):
        p.normal_(0, 0.02, generator=g)
    else:
        p.normal_(0, p.shape[-1] ** -0.5, generator=g)
    if name == "head.weight":  # stored in bf16 and widened by the loader (checkpoint.names_v41): bf16 values
        p.copy_(p.to(torch.bfloat16).float())


class Ours:
    def __init__(
        self,
        model: DeepseekV41Model,
        args: argparse.Namespace,
        dev: torch.device,
        batches: list[int],
        weight_sets: WeightSets | None = None,
        order_sets: OrderSets | None = None,
    ):
        self.model, self.args, self.dev, self.c = model, args, dev, model.config
        self.weight_sets, self.order_sets = weight_sets, order_sets
        ps = args.page_size
        # + the profiled step (--ab), one spare, host_and_pipelined's
        self.steps = args.warmup + args.repeats + 2 + 3 + PIPELINED_STEPS + 1  # + the --profile step
        self.profiles: dict[int, dict] = {}  # --profile: torch.profiler over one decode step per batch
        self.pages_per_seq = -(-(args.context + self.steps) // ps)
        self.n_tpl = args.contexts
        self.lanes = len(decode_ab.variants_of(self)) if args.ab else 1  # --ab: one set of batch pages per variant
        self.ab: list[dict] = []  # --ab: eager / graphs rows (decode_ab)
        n_dec = (self.n_tpl + self.lanes * max(batches, default=0)) * self.pages_per_seq
        num_pages = n_dec + -(-max(args.prefill_tokens, default=0) // ps)
        self.cache = PagedKVCache(self.c, num_pages, ps, torch.bfloat16, dev)
        pages = torch.arange(num_pages, device=dev)
        self.tables = pages[:n_dec].view(-1, self.pages_per_seq)  # templates first, then the batch lanes
        self.prefill_table = pages[n_dec:]
        self.rng = random.Random(args.seed)
        self.templates: list[SequenceState] = []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.c.vocab_size) for _ in range(n)]

    def _prefill(self, st: SequenceState, table: torch.Tensor, ids: list[int]) -> torch.Tensor:
        h = None
        for s in range(0, len(ids), self.args.chunk):
            part = ids[s : s + self.args.chunk]
            h = self.model(ForwardBatch.build([SeqChunk(st, s, len(part), table)], [part], self.dev), self.cache)
        return self.model.logits(h[-1:])

    def make_step(self, b: int, n_steps: int, tokens: list[list[int]] | None = None, lane: int = 0):
        """A decode step of ``b`` fresh copies of the templates (own states, own cache pages: the batch's pages of
        ``lane``): each call advances every sequence by one token (the next of ``tokens``, else random) and returns
        the logits of every row. The interface of ``bench/engine/decode_ab.py``."""
        n = self.n_tpl
        tables = self.tables[n + lane * b : n + (lane + 1) * b]
        states = [self.templates[j % n].clone() for j in range(b)]
        src = self.tables[torch.arange(b, device=self.dev) % n]
        for store in list(self.cache.rows.values()) + list(self.cache.index_keys.values()):
            store[tables.flatten()] = store[src.flatten()]
        it = iter(tokens if tokens is not None else [self._ids(b) for _ in range(n_steps)])

        def step() -> torch.Tensor:
            chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
            batch = ForwardBatch.build(chunks, [[i] for i in next(it)], self.dev)
            return self.model.logits(self.model(batch, self.cache))

        return step

    def _graphs(self) -> dict[str, Any]:
        g = self.model.decode_graphs
        return {} if g is None else {"graph_replays": g.replays, "graph_failures": dict(g.failures)}

    def decode(self, batches: list[int], budget: Budget) -> list[dict]:
        rows: list[dict] = []
        try:
            self.templates = []
            for i in range(self.n_tpl):
                st = SequenceState()
                self._prefill(st, self.tables[i], self._ids(self.args.context))
                self.templates.append(st)
            sync(self.dev)
        except Exception as e:  # noqa: BLE001
            note = failure(e, self.dev)
            return [{"batch": b, "ms": None, "note": f"context prefill: {note}"} for b in batches]
        budget.restart()
        for b in batches:
            row: dict[str, Any] = {"batch": b}
            try:
                if budget.left() <= 0:
                    raise Skip("skipped: section budget spent")
                step = self.make_step(b, self.steps)
                row.update(run_timed(step, self.dev, self.args.warmup, self.args.repeats, budget, None))
                if budget.left() > row["ms"] * (PIPELINED_STEPS + 3) / 1e3:
                    row.update(host_and_pipelined(step, self.dev))
                row.update(self._graphs())
                timing = {k: round(row[k], 2) for k in ("host_ms", "pipelined_ms") if k in row}
                log(f"  ours decode B={b}: {row['ms']:.2f} ms/step {timing} {self._graphs()}")
                if b in self.args.profile:  # the graphed step as it runs (kernels by device time)
                    self.profiles[b] = profile_prefill(step, self.dev)
                    log(f"  ours decode B={b} profiled: {self.profiles[b].get('device_busy_ms')} ms busy")
                del step
                if self.args.ab and hasattr(self.model.ops, "cuda_graphs"):
                    ab = decode_ab.ab_decode(self, b, timed, Budget(self.args.budget_s, budget.deadline))
                    ab.update(self._graphs())
                    self.ab.append(ab)
                    summary = ", ".join(f"{k} {v['ms']:.2f} ms, {v['counts']['LaunchKernel']} launches"
                                        for k, v in ab.items() if isinstance(v, dict) and "ms" in v)  # fmt: skip
                    log(f"  ours decode B={b} A/B: {summary}; {ab.get('exactness')}")
            except Skip as e:
                row.update(ms=None, note=str(e))
            except Exception as e:  # noqa: BLE001
                row.update(ms=None, note=failure(e, self.dev))
            free(self.dev)
            rows.append(row)
        self.templates = []
        return rows

    def prefill(self, tokens: list[int], budget: Budget) -> list[dict]:
        rows = []
        budget.restart()
        for n in tokens:
            row: dict[str, Any] = {"tokens": n}
            try:
                ids = self._ids(n)
                row.update(run_timed(lambda ids=ids: self._prefill(SequenceState(), self.prefill_table, ids),
                                     self.dev, 1, self.args.prefill_repeats, budget, None))  # fmt: skip
                log(f"  ours prefill {n}: {row['ms']:.1f} ms")
            except Skip as e:
                row.update(ms=None, note=str(e))
            except Exception as e:  # noqa: BLE001
                row.update(ms=None, note=failure(e, self.dev))
            free(self.dev)
            rows.append(row)
        return rows


def peer_prefill(config: DeepseekV41Config, args: argparse.Namespace, dev: torch.device, budget: Budget) -> dict:
    """NeMo AutoModel's model (eager attention, torch experts), bf16, own random weights: prefill forwards."""
    try:
        from bench.harness import NEMO_DIR
        from deepinfer.checkpoint.references import ensure_nemo
        from deepinfer.checkpoint.references import nemo_backend as backend

        ensure_nemo(NEMO_DIR)
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config as NemoConfig
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
        from transformers import PreTrainedTokenizerFast

        from deepinfer.checkpoint.tiny_v41 import v41_tokenizer_json

        text = dict(config.text_config.to_dict(), dtype="bfloat16")
        text.pop("model_type", None)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=__import__("tokenizers").Tokenizer.from_str(v41_tokenizer_json())
        )
        ncfg = NemoConfig(text_config=text, vision_config={"num_hidden_layers": 0})
        with dev:
            peer = DeepseekV41ForCausalLM(ncfg, backend=backend(), tokenizer=tok)
            peer.initialize_weights(buffer_device=dev, dtype=torch.bfloat16)
        peer.eval()
    except Exception as e:  # noqa: BLE001
        return {"name": None, "reason": f"{type(e).__name__}: {e}"[:300], "prefill": []}
    rows = []
    budget.restart()
    for n in args.prefill_tokens:
        row: dict[str, Any] = {"tokens": n}
        try:
            ids = torch.randint(3, config.vocab_size, (1, n), device=dev)
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                row.update(run_timed(lambda ids=ids: peer(ids, logits_to_keep=1), dev, 1, args.prefill_repeats,
                                     budget, None))  # fmt: skip
            log(f"  peer prefill {n}: {row['ms']:.1f} ms")
        except Exception as e:  # noqa: BLE001
            row.update(ms=None, note=failure(e, dev))
        free(dev)
        rows.append(row)
    return {"name": "NeMo AutoModel 0.7.0 DeepseekV41ForCausalLM (eager, bf16)", "prefill": rows}


def markdown(res: dict[str, Any]) -> str:
    ce = res["ceilings"]
    f = lambda x, fmt: "—" if x is None else format(x, fmt)  # noqa: E731
    peer = {r["tokens"]: r for r in res["peer"].get("prefill", [])}
    lines = [
        f"**{res['gpu']}** — {res['layers']} layers of V4.1-{'tiny' if res['tiny'] else 'Flash'} width; ceilings "
        f"measured: copy {ce['hbm_copy_GBps']:.0f} GB/s, FP8 {f(ce.get('fp8_TFLOPs'), '.3g')} TFLOP/s. Peer: "
        f"{res['peer'].get('name') or 'unavailable: ' + str(res['peer'].get('reason'))} (prefill only: no KV cache)",
        "",
        f"Decode (context {res['context']} tokens per sequence; ms per step of the whole batch)",
        "",
        "| batch | ours ms | roofline ms | × roofline | tok/s | experts/layer (model) | host ms | back to back ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["decode"]:
        lines.append(f"| {r['batch']} | {f(r.get('ms'), '.1f')} | {r['roofline_ms']:.3f} | "
                     f"{f(r.get('x_roofline'), '.1f')} | {f(r.get('tok_s'), '.1f')} | "
                     f"{r['unique_experts_per_layer']:.1f} | {f(r.get('host_ms'), '.2f')} | "
                     f"{f(r.get('pipelined_ms'), '.2f')} |")  # fmt: skip
    lines += ["", "Prefill (one sequence, exact)", "", "| tokens | ours ms | peer ms | FP8 FLOP roofline ms | "
              "ours frac. of FP8 peak | peer frac. of FP8 peak |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["prefill"]:
        p = peer.get(r["tokens"], {})
        pf = r["fp8_flop_ms"] / p["ms"] if p.get("ms") else None
        frac = f(r.get("fraction_of_fp8_peak"), ".4f")
        lines.append(f"| {r['tokens']} | {f(r.get('ms'), '.1f')} | {f(p.get('ms'), '.1f')} | "
                     f"{r['fp8_flop_ms']:.3f} | {frac} | {f(pf, '.4f')} |")  # fmt: skip
    notes = [f"{k} {r.get('batch', r.get('tokens'))}: {r['note']}" for k in ("decode", "prefill") for r in res[k]
             if r.get("note")]  # fmt: skip
    notes += [f"peer prefill {r['tokens']}: {r['note']}" for r in res["peer"].get("prefill", []) if r.get("note")]
    notes += res.get("notes", [])
    notes += [f"decode {r['batch']}: CUDA graph capture failed: {r['graph_failures']}" for r in res["decode"]
              if r.get("graph_failures")]  # fmt: skip
    if res.get("decode_ab"):
        lines += ["", "Decode A/B (--ab; decode_ab.py: interleaved rounds, median ms; one profiled step each)", "",
                  decode_ab.markdown(res["decode_ab"])]  # fmt: skip
    return "\n".join(lines + (["", "Notes:"] + [f"- {n}" for n in notes] if notes else []))


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--contexts", type=int, default=1)
    ap.add_argument("--batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--prefill-tokens", type=ints, default=None)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=60)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="decode A/B per batch: eager unfused / eager fused / CUDA graphs, interleaved (decode_ab.py)",
    )
    ap.add_argument(
        "--weights",
        choices=["auto", "native", "bf16"],
        default="auto",
        help="FP8 linears and MXFP4 experts as stored (native) or bf16; auto: ops.native_weights",
    )
    ap.add_argument(
        "--ab-weights",
        action="store_true",
        help="keep both weight sets; --ab then compares bf16 / native eager / native graphs",
    )
    ap.add_argument(
        "--ab-order",
        action="store_true",
        help="--ab compares the MXFP4 experts' codes as stored against their shift and rotate orders (nibble_order.py)",
    )
    ap.add_argument(
        "--ab-pool",
        action="store_true",
        help="make --ab compare the decode state per sequence against the pooled state (StatePool), with graphs",
    )
    ap.add_argument(
        "--ab-h2d",
        action="store_true",
        help="make --ab compare the step's host-to-device copies synchronous against asynchronous (host_copy.py)",
    )
    ap.add_argument("--profile", type=ints, default=[], help="decode batch sizes to profile (torch.profiler)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.context = args.context or (256 if args.tiny else 4096)
    if args.prefill_tokens is None:  # --prefill-tokens "": none
        args.prefill_tokens = [256, 1024] if args.tiny else [1024, 4096]
    deadline = time.monotonic() + 10 * args.budget_s
    config = build_config(args)
    work = Work(config)
    ceil = probe_ceilings(dev)
    bw, peak = ceil["hbm_copy_GBps"] * 1e9, (ceil.get("fp8_TFLOPs") or ceil["bf16_TFLOPs"]) * 1e12
    log(f"ceilings: {ceil}")
    model = build_ours(config, dev, args.seed)
    block = tuple(config.weight_block_size)
    native = args.weights == "native" or (args.weights == "auto" and getattr(model.ops, "native_weights", False))
    sets, notes = None, []
    if args.ab_weights:
        try:
            sets = WeightSets(model, block)
        except torch.OutOfMemoryError:
            free(dev)
            notes.append("--ab-weights: the bf16 twin of the weights does not fit beside them; stored formats only")
            log(notes[-1])
            native = True
    if native and sets is None:
        prepare_native(model, block, quantize=True)
    orders = (
        OrderSets(model) if args.ab_order else None
    )  # --ab: the experts' nibble orders (bench/engine/weight_sets.py)
    if orders is None:
        model.ops.prepare_weights(model)  # the MXFP4 experts in the rotate order on a GPU (quant.nibble_order)
    ours = Ours(model, args, dev, args.batches, sets, orders)
    decode = ours.decode(args.batches, Budget(args.budget_s, deadline))
    prefill = ours.prefill(args.prefill_tokens, Budget(args.budget_s, deadline))
    decode_ab_rows, profiles = ours.ab, {str(b): p for b, p in ours.profiles.items()}
    weights = "native" if native or sets is not None else "bf16"
    del ours, model, sets
    free(dev)
    for r in decode:
        r.update(work.decode(r["batch"], args.context, bw, peak))
        r["x_roofline"] = r["ms"] / r["roofline_ms"] if r.get("ms") else None
        r["tok_s"] = 1e3 * r["batch"] / r["ms"] if r.get("ms") else None
    for r in prefill:
        r.update(work.prefill(r["tokens"], bw, peak))
        r["fraction_of_fp8_peak"] = r["fp8_flop_ms"] / r["ms"] if r.get("ms") else None
    peer = {"name": None, "reason": "--no-peer", "prefill": []}
    if not args.no_peer:
        peer = peer_prefill(config, args, dev, Budget(args.budget_s, deadline))
    res = {"date": datetime.date.today().isoformat(), "gpu": gpu_name(dev), "tiny": args.tiny, "layers": args.layers,
           "context": args.context, "ceilings": ceil, "weights": weights, "notes": notes,
           "decode": decode, "decode_ab": decode_ab_rows, "prefill": prefill,
           "profile": profiles,
           "peer": peer,
           "versions": versions(), "command": " ".join(sys.argv)}  # fmt: skip
    md = markdown(res)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.name or f"{res['date']}-sweep-v41"
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str))
        (args.out / f"{name}.md").write_text(md + "\n")
    return res


if __name__ == "__main__":
    main()
