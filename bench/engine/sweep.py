"""Baseline sweep of one GPU: decode and prefill of a V4-Flash-width model against the roofline and a peer.

What it measures, in one run:

* **ceilings** of the device: a large device-to-device copy (HBM GB/s, read + write counted), bf16 and FP8
  (``torch._scaled_mm``, e4m3 operands) matmul TFLOP/s at 8192³;
* **ours**: ``DeepseekV4Model`` with the op set of ``get_ops("nvidia")`` (``cpu`` on ``--device cpu``), built
  directly on the device in bf16 with random weights (``N`` layers of V4-Flash width: SWA, SWA, CSA, HCA, ...;
  the first 2 MoE layers hash-routed; no MTP block). Decode: ``--contexts`` sequences get a ``--context``-token
  prompt through ``forward`` with a ``PagedKVCache`` (chunked by ``--chunk``); a batch of ``B`` sequences is
  cloned from them (own short-term state, own copies of the cache pages), then single-token steps of the whole
  batch are timed (``model(ForwardBatch, cache)`` + ``model.logits`` of every row; random next tokens; the state
  advances each step). Prefill: one fresh sequence of ``L`` tokens (chunked by ``--chunk``) + the logits of its
  last row;
* **peer**: transformers' ``DeepseekV4ForCausalLM`` on the device in bf16 (same config, its own random weights,
  ``_keep_in_fp32_modules_strict`` kept fp32 as ``from_pretrained`` would). Decode: one ``--context``-token
  prefill, its ``DynamicCache`` replicated to ``B`` rows (``reorder_cache``), then single-token forwards with
  ``logits_to_keep=1``. Prefill: one forward of ``L`` tokens with a cache;
* **roofline** of the same work in the checkpoint's native formats (docs/deepseek_v4.md, "Checkpoint format" and
  "Inference state per layer"): FP8 e4m3 linears with 128×128 UE8M0 scales, bf16 where the checkpoint keeps bf16,
  fp32 mHC/APE/sinks/router bias, routed experts MXFP4 incl. scales; a decode step of ``B`` sequences reads the dense
  weights once, ``E·(1−(1−k/E)^B)`` distinct
  experts per MoE layer and each sequence's KV at the context length (window rows, CSA top-k rows + indexer keys,
  HCA rows, 583 B per row and 68 B per indexer key). ``roofline_ms = max(bytes / copy GB/s, FLOPs / FP8 TFLOP/s)``
  with the ceilings measured above; prefill also reports ``fraction_of_fp8_peak`` = (FLOPs / measured FP8 peak) /
  measured time, FLOPs = 2 × active params × tokens (head on the last token) + attention FLOPs.

Optional: ``--profile B,...`` splits one decode step of those batch sizes into regions (attention, its compressors,
indexer selection and sparse attention; MoE, its router and routed experts; device synchronised at each region's
edges) and runs ``torch.profiler`` over another step (op tables, kernel-launch and host-sync counts, into the JSON);
``--moe-bench`` times one layer's routed experts alone at the model's width (reference loop, ``torch._grouped_mm``,
the Triton kernels) against the time to read the touched experts; ``--moe-backend`` forces ``NvidiaOps``' MoE path;
``--name`` sets the output stem.

Every timing is the median of up to ``--repeats`` runs after ``--warmup`` runs, with device synchronisation around
each. Every section (ours decode, ours prefill, peer decode, peer prefill) has a time budget (``--budget-s``); a shape
whose estimated cost does not fit what is left is skipped with a note, as is one that runs out of memory, and no new
work starts after ``--deadline-s`` (counted from the start of the script).

Run on one GPU (≈ 6–8 min)::

    PYTHONPATH=libs:. python bench/engine/sweep.py --out bench/results

Smoke test on CPU (≈ 1–2 min)::

    PYTHONPATH=libs:. python bench/engine/sweep.py --tiny --device cpu --out /tmp/sweep

Imports from deepinfer only ``deepinfer`` (package init), ``deepinfer.models.deepseek_v4.{config,model,state}``,
``deepinfer.ops`` (→ ``deepinfer.backends.reference``, ``deepinfer.quant.formats``); with ``--tiny`` also
``deepinfer.checkpoint.tiny`` (→ safetensors); for the peer ``deepinfer.checkpoint.references`` (→ transformers,
``deepinfer.checkpoint.names``). No structlog, OpenTelemetry or tokenizer package is needed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine import decode_ab
from bench.engine.weight_sets import OrderSets, WeightSets
from bench.harness import device_name as gpu_name
from bench.harness import sync, timed, versions
from bench.host.device_gaps import device_gaps
from bench.host.host_ops import chunk_issue, decode_spans, host_op_times, issue_timeline
from deepinfer.engine.heap import freeze_heap, thaw_heap  # noqa: E402
from deepinfer.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from deepinfer.models.deepseek_v4.family import FAMILY as V4_FAMILY  # noqa: E402
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from deepinfer.models.deepseek_v4.layers import set_w8a8  # noqa: E402
from deepinfer.models.deepseek_v4.model import DeepseekV4Model  # noqa: E402
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache  # noqa: E402
from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState  # noqa: E402
from deepinfer.ops import get_ops  # noqa: E402
from deepinfer.quant.native import prepare_native  # noqa: E402
from deepinfer.quant.w4a8 import set_w4a8  # noqa: E402

T0 = time.monotonic()

# H200 SXM datasheet figures, for reference next to the measured ceilings
H200_DATASHEET = {"hbm_GBps": 4800.0, "bf16_TFLOPs": 989.0, "fp8_TFLOPs": 1979.0}

# parameters our engine keeps in fp32 whatever the model dtype (as deepinfer.checkpoint.loader._FP32; the
# compressors' projections stay bf16, as the checkpoint stores them, and run in fp32 through ops.linear_fp32)
OURS_FP32 = re.compile(r"(hc_\w+_(fn|base|scale)|\.ape|attn_sink|gate\.bias|norm\.weight)$")
# native checkpoint formats (docs/deepseek_v4.md, "Official quantization points" and "Checkpoint format"), by
# internal parameter name
NATIVE_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|ffn\.shared_w[123])\.weight$")
NATIVE_FP32 = re.compile(r"(hc_\w+_(fn|base|scale)|\.ape|attn_sink|gate\.bias)$")
# transformers' _keep_in_fp32_modules_strict of DeepseekV4 (used when the class does not carry it)
HF_FP32_DEFAULT = (
    "attn_hc ffn_hc hc_head sinks position_bias e_score_correction_bias q_a_norm kv_norm input_layernorm "
    "post_attention_layernorm norm"
).split()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# -- configuration ----------------------------------------------------------------------------------


def flash_ratios(n: int, hca: int = 128) -> tuple[int, ...]:
    """V4-Flash's layer pattern (docs/deepseek_v4.md, "Layer schedule"): SWA, SWA, then CSA / HCA alternating."""
    return tuple(([0, 0] + [4 if i % 2 == 0 else hca for i in range(max(n - 2, 0))])[:n])


def build_config(args: argparse.Namespace) -> DeepseekV4Config:
    if args.tiny:
        from deepinfer.checkpoint.tiny import TINY_V4

        raw = {**TINY_V4, "num_nextn_predict_layers": 0}
        if args.layers:
            raw["num_hidden_layers"] = args.layers
            raw["compress_ratios"] = list(flash_ratios(args.layers, hca=8))
        return DeepseekV4Config.from_dict(raw)
    n = args.layers or 4
    # defaults of DeepseekV4Config are V4-Flash's (hidden 4096, 64 heads × 512, q_lora 1024, 8 × 1024 output
    # groups, window 128, indexer 64 × 128 top-512, 256 experts top-6 width 2048 + 1 shared, hc 4, YaRN)
    return DeepseekV4Config(
        num_hidden_layers=n,
        compress_ratios=flash_ratios(n),
        num_hash_layers=min(args.hash_layers, n),
        num_nextn_predict_layers=0,
    )


# -- the roofline -----------------------------------------------------------------------------------


@dataclass
class Work:
    """Bytes (checkpoint-native formats) and FLOPs of the model, from its parameter shapes."""

    layers: int
    dense_bytes: float = 0.0  # non-expert weights a step reads once (head included, embedding excluded)
    expert_bytes: float = 0.0  # one routed expert, MXFP4 incl. UE8M0 scales
    expert_params: int = 0
    moe_layers: int = 0
    per_token_bytes: float = 0.0  # embedding row + hash-table rows
    matmul_params: int = 0  # weights every token multiplies by (attention, indexer, compressors, mHC, gates, shared)
    head_params: int = 0
    total_params: int = 0
    config: Any = None

    @classmethod
    def of(cls, config: DeepseekV4Config) -> Work:
        with torch.device("meta"):
            model = DeepseekV4Model(config, get_ops("cpu"))
        w = cls(layers=config.num_hidden_layers, config=config)
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            n = p.numel()
            if name.endswith("tid2eid"):
                w.per_token_bytes += p.shape[1] * 8  # int64 row per token
                continue
            w.total_params += n
            if name == "embed.weight":
                w.per_token_bytes += p.shape[1] * 2
            elif name.endswith((".ffn.w1", ".ffn.w2", ".ffn.w3")):
                per = p[0].numel()
                w.expert_params += per
                w.expert_bytes += per / 2 + per / 32  # e2m1 nibbles + one e8m0 scale per 32
                w.moe_layers += name.endswith(".w1")
            else:
                if NATIVE_FP8.search(name):
                    out, inp = p.shape
                    w.dense_bytes += n + math.ceil(out / 128) * math.ceil(inp / 128)
                elif NATIVE_FP32.search(name):
                    w.dense_bytes += 4 * n
                else:
                    w.dense_bytes += 2 * n
                if name == "head.weight":
                    w.head_params = n
                elif p.dim() == 2 and not name.endswith(".ape"):
                    w.matmul_params += n
        if w.moe_layers:
            w.expert_params //= w.moe_layers
            w.expert_bytes /= w.moe_layers
        return w

    def unique_experts(self, tokens: int) -> float:
        e, k = self.config.n_routed_experts, self.config.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def _attention(self, pos: int) -> tuple[float, float]:
        """(FLOPs, native KV bytes read) of one query at absolute position ``pos``, all layers."""
        c = self.config
        rd, d = c.qk_rope_head_dim, c.head_dim
        row = (d - rd) + math.ceil((d - rd) / 64) + 2 * rd  # e4m3 nope + UE8M0 scales + bf16 rope (583 B)
        ikey = c.index_head_dim / 2 + math.ceil(c.index_head_dim / 32)  # MXFP4 indexer key (68 B)
        flops = nbytes = 0.0
        for layer in range(c.num_hidden_layers):
            keys = min(pos + 1, c.sliding_window)
            m = c.ratio(layer)
            if m:
                rows = (pos + 1) // m
                if c.layer_kind(layer) == "csa":
                    flops += 2 * c.index_n_heads * c.index_head_dim * rows
                    nbytes += rows * ikey
                    keys += min(rows, c.index_topk)
                else:
                    keys += rows
            flops += 4 * c.num_attention_heads * d * keys  # QKᵀ and PV over shared K = V rows
            nbytes += keys * row
        return flops, nbytes

    def decode(self, batch: int, context: int, bw: float, peak: float, rows: int = 1) -> dict[str, float]:
        """Roofline of one decode step of ``batch`` sequences that hold ``context`` tokens each; ``rows`` > 1: a
        speculative verify step, each sequence ``rows`` rows (its token and its drafts) over the same context."""
        c = self.config
        attn_flops, kv = self._attention(context)
        tokens = batch * rows
        experts = self.moe_layers * self.unique_experts(tokens) * self.expert_bytes
        nbytes = self.dense_bytes + experts + tokens * self.per_token_bytes + batch * kv
        active = self.matmul_params + self.head_params + self.moe_layers * c.num_experts_per_tok * self.expert_params
        flops = tokens * (2 * active + attn_flops)
        t_mem, t_fl = nbytes / bw, flops / peak
        return {
            "roofline_ms": 1e3 * max(t_mem, t_fl),
            "roofline_mem_ms": 1e3 * t_mem,
            "roofline_compute_ms": 1e3 * t_fl,
            "bytes_GB": nbytes / 1e9,
            "expert_GB": experts / 1e9,
            "kv_MB_per_seq": kv / 1e6,
            "unique_experts_per_layer": self.unique_experts(tokens),
        }

    def prefill(self, tokens: int, bw: float, peak: float) -> dict[str, float]:
        """Roofline of one sequence's prefill of ``tokens`` tokens (logits of the last one)."""
        c = self.config
        per_tok = self.matmul_params + self.moe_layers * c.num_experts_per_tok * self.expert_params
        flops = 2.0 * (per_tok * tokens + self.head_params)
        flops += sum(self._attention_flops_sum(tokens))
        nbytes = self.dense_bytes + self.moe_layers * self.unique_experts(tokens) * self.expert_bytes
        nbytes += tokens * self.per_token_bytes
        t_mem, t_fl = nbytes / bw, flops / peak
        return {
            "roofline_ms": 1e3 * max(t_mem, t_fl),
            "fp8_flop_ms": 1e3 * t_fl,
            "roofline_mem_ms": 1e3 * t_mem,
            "TFLOP": flops / 1e12,
        }

    def _attention_flops_sum(self, tokens: int) -> list[float]:
        """Attention FLOPs of queries at positions 0..tokens-1, per layer (closed over positions with torch)."""
        c = self.config
        t = torch.arange(tokens, dtype=torch.float64)
        out = []
        for layer in range(c.num_hidden_layers):
            keys = torch.clamp(t + 1, max=c.sliding_window)
            m = c.ratio(layer)
            extra = 0.0
            if m:
                rows = torch.div(t + 1, m, rounding_mode="floor")
                if c.layer_kind(layer) == "csa":
                    extra = float((2 * c.index_n_heads * c.index_head_dim * rows).sum())
                    keys = keys + torch.clamp(rows, max=c.index_topk)
                else:
                    keys = keys + rows
            out.append(float((4 * c.num_attention_heads * c.head_dim * keys).sum()) + extra)
        return out

    def summary(self) -> dict[str, float]:
        c = self.config
        active = self.matmul_params + self.head_params + self.moe_layers * c.num_experts_per_tok * self.expert_params
        return {
            "layers": self.layers,
            "total_params_B": self.total_params / 1e9,
            "active_params_B": active / 1e9,
            "dense_GB": self.dense_bytes / 1e9,
            "expert_MB": self.expert_bytes / 1e6,
            "decode_b1_GB_at_4k": self.decode(1, 4096, 1.0, 1.0)["bytes_GB"],
        }


# -- timing -----------------------------------------------------------------------------------------


class Skip(Exception):
    pass


class Budget:
    def __init__(self, seconds: float, deadline: float) -> None:
        self.seconds, self.deadline = seconds, deadline
        self.restart()

    def restart(self) -> None:
        """Start the clock now (after a section's setup), still capped by the global deadline."""
        self.end = min(time.monotonic() + self.seconds, self.deadline)

    def left(self) -> float:
        return self.end - time.monotonic()


PIPELINED_STEPS = 8  # host_and_pipelined's back-to-back steps
PREFILL_PIPELINED = 3  # back-to-back prefills (each its own sequence, the same pages)
DECODE_SPANS = 20  # --profile: decode_spans' steps


def run_timed(fn, dev, warmup: int, repeats: int, budget: Budget, estimate: float | None) -> dict[str, Any]:
    """Median of up to ``repeats`` timed runs after ``warmup`` runs, fewer when the budget runs short."""
    if estimate is not None and estimate * (warmup + 1) > budget.left():
        raise Skip(f"skipped: needs ~{estimate * (warmup + 1):.1f} s, {max(budget.left(), 0):.1f} s left in budget")
    last, note = None, None
    for _ in range(warmup):
        last = timed(fn, dev)
    times: list[float] = []
    for _ in range(repeats):
        expect = statistics.median(times) if times else (last or 0.0)
        if times and expect > budget.left():
            break
        if not times and last is not None and last > budget.left():
            times, note = [last], "timed from the warm-up run (budget)"
            break
        times.append(timed(fn, dev))
    out = {"ms": 1e3 * statistics.median(times), "runs": len(times), "min_ms": 1e3 * min(times)}
    if note:
        out["note"] = note
    return out


def host_and_pipelined(fn, dev, steps: int = PIPELINED_STEPS) -> dict[str, float]:
    """``host_ms``: the host's time to queue one step on an idle GPU (median of 3; the part of ``ms`` no kernel
    overlaps when every step waits for the previous one). ``pipelined_ms``: ``steps`` steps queued back to back with
    one wait at the end, per step: what a scheduler that prepares step n+1 while step n runs would see (the step
    never waits for the GPU: ``tests/kernels/test_graphs.py``)."""
    hosts = []
    for _ in range(3):
        sync(dev)
        t = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - t)
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(dev)
    return {"host_ms": 1e3 * statistics.median(hosts), "pipelined_ms": 1e3 * (time.perf_counter() - t) / steps}


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def failure(e: BaseException, dev: torch.device) -> str:
    """The note of a shape that failed: out of memory, or an error (its traceback goes to stderr)."""
    if isinstance(e, torch.OutOfMemoryError):
        note = "skipped: out of memory"
    else:
        traceback.print_exception(e)
        note = f"error: {type(e).__name__}: {e}"[:300]
    free(dev)
    return note


# -- device ceilings --------------------------------------------------------------------------------


def _best_loop(fn, dev, reps: int, rounds: int = 3) -> float:
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(rounds):
        t = timed(lambda: [fn() for _ in range(reps)], dev) / reps
        best = min(best, t)
    return best


def _probe_bandwidth(dev: torch.device, nbytes: int, reps: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, read GB/s) of a ``nbytes`` bf16 tensor."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    copy_s = _best_loop(lambda: y.copy_(x), dev, reps)
    read_s = _best_loop(lambda: x.sum(), dev, reps)
    return 2 * nbytes / copy_s / 1e9, nbytes / read_s / 1e9


def _probe_matmul(
    dev: torch.device, n: int, reps: int, n8: int | None = None
) -> tuple[float, float | None, str | None]:
    """(bf16 TFLOP/s, FP8 TFLOP/s or None, why FP8 failed) of an n³ matmul (FP8: n8³, default n)."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / _best_loop(lambda: torch.mm(a, b, out=c), dev, reps) / 1e12
    n8 = n if n8 is None else n8
    try:
        a8 = a[:n8, :n8].to(torch.float8_e4m3fn)
        b8 = b[:n8, :n8].to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device=dev, dtype=torch.float32)
        t = _best_loop(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), dev, reps)
        return bf16, 2 * n8**3 / t / 1e12, None
    except Exception as e:  # noqa: BLE001 - any failure means "no FP8 matmul here"
        return bf16, None, f"{type(e).__name__}: {e}"[:300]


@torch.no_grad()
def probe_ceilings(dev: torch.device) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    n, nbytes, reps = (8192, 4 << 30, 10) if cuda else (512, 256 << 20, 3)
    # (a CPU's FP8 matmul is emulated, thousands of times slower than bf16: 512³ takes seconds a call, 128³ does)
    n8 = n if cuda else 128
    out: dict[str, Any] = {"matmul_n": n, "fp8_matmul_n": n8, "copy_bytes": nbytes}
    out["hbm_copy_GBps"], out["hbm_read_GBps"] = _probe_bandwidth(dev, nbytes, reps)
    free(dev)
    out["bf16_TFLOPs"], out["fp8_TFLOPs"], err = _probe_matmul(dev, n, reps, n8)
    if err:
        out["fp8_error"] = err
    free(dev)
    return out


# -- random weights ---------------------------------------------------------------------------------


def distinct_ids(rows: int, experts: int, k: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``rows`` rows of ``k`` distinct expert ids (a random hash table)."""
    out = torch.empty(rows, k, dtype=torch.long, device=dev)
    step = 16384
    for s in range(0, rows, step):
        r = min(step, rows - s)
        out[s : s + r] = torch.rand(r, experts, generator=gen, device=dev).argsort(dim=1)[:, :k]
    return out


@torch.no_grad()
def fill_ours(model: DeepseekV4Model, seed: int, dev: torch.device) -> None:
    """Random weights with sensible scales in place; fp32 where the engine keeps fp32 (loader._FP32)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if OURS_FP32.search(name) and p.dtype != torch.float32:
            p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        t, fan_in = p.data, p.shape[-1]
        if name.endswith("norm.weight") or name.endswith("_scale"):
            t.normal_(1.0, 0.1, generator=g)
        elif name.endswith(("_base", "gate.bias")):
            t.normal_(0.0, 0.1, generator=g)
        elif name.endswith(("attn_sink", ".ape")):
            t.normal_(0.0, 0.5, generator=g)
        elif name.endswith("_fn"):
            t.normal_(0.0, 0.5 * fan_in**-0.5, generator=g)
        elif name == "embed.weight":
            t.normal_(0.0, 1.0, generator=g)
        else:
            t.normal_(0.0, fan_in**-0.5, generator=g)
    c = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(distinct_ids(b.shape[0], c.n_routed_experts, b.shape[1], g, dev))


@torch.no_grad()
def fill_peer(hf, seed: int, dev: torch.device) -> None:
    keep = set(getattr(hf, "_keep_in_fp32_modules_strict", None) or HF_FP32_DEFAULT)
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in hf.named_parameters():
        if keep & set(name.split(".")) and p.dtype != torch.float32:
            p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        t = p.data
        if p.dim() == 1:
            if "norm" in name or name.endswith("scale"):
                t.normal_(1.0, 0.1, generator=g)
            else:  # biases, hc base, sinks
                t.normal_(0.0, 0.1, generator=g)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0, generator=g)
        else:
            t.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    cfg = hf.config
    for name, b in hf.named_buffers():
        if keep & set(name.split(".")) and b.is_floating_point() and b.dtype != torch.float32:
            b.data = b.data.float()
        if name.endswith("tid2eid"):
            b.copy_(distinct_ids(b.shape[0], cfg.n_routed_experts, b.shape[1], g, dev))


@torch.no_grad()
def build_ours(config: DeepseekV4Config, dev: torch.device, seed: int, moe_backend: str = "auto") -> DeepseekV4Model:
    ops = get_ops("nvidia" if dev.type == "cuda" else "cpu")
    if hasattr(ops, "moe_backend"):
        ops.moe_backend = moe_backend
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with dev:
            model = DeepseekV4Model(config, ops).eval()
    finally:
        torch.set_default_dtype(prev)
    model.step_graphs = V4_FAMILY.step_graphs()  # as the engine's build: graphs where the op set allows them
    fill_ours(model, seed, dev)
    return model


# -- ours -------------------------------------------------------------------------------------------


def clone_state(src: SequenceState) -> SequenceState:
    st = SequenceState(num_tokens=src.num_tokens, mtp_tokens=src.mtp_tokens)
    st.windows = {k: v.clone() for k, v in src.windows.items()}
    st.buffers = {k: CompressorBuffer(b.kv.clone(), b.score.clone(), b.start) for k, b in src.buffers.items()}
    return st


def copy_pages(cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    for store in list(cache.rows.values()) + list(cache.index_keys.values()):
        store[dst] = store[src]


def profile_step(model: DeepseekV4Model, step, dev: torch.device) -> dict[str, Any]:
    """Where one decode step's time goes: wall time per region (device synchronised at each region's edges, so
    regions add up to the step plus the syncs; an eager step), then ``torch.profiler`` over one more step as the op set
    runs it (CUDA graphs included: op table, launch counts); on a GPU who waits for whom (``issue_timeline``) and the
    host's time in each part of the step's host path, from an idle device (``decode_spans``)."""
    spans: dict[str, float] = {}
    open_: dict[str, float] = {}
    hooks = []

    def enter(name):
        def f(*_):
            sync(dev)
            open_[name] = time.perf_counter()

        return f

    def leave(name):
        def f(*_):
            sync(dev)
            spans[name] = spans.get(name, 0.0) + time.perf_counter() - open_.pop(name)

        return f

    def wrap(obj, attr, name):
        fn = getattr(obj, attr)

        def wrapped(*a, **k):
            enter(name)()
            try:
                return fn(*a, **k)
            finally:
                leave(name)()

        setattr(obj, attr, wrapped)
        return lambda: delattr(obj, attr)

    undo = []
    for layer in model.layers:
        for mod, name in ((layer.attn, "attention"), (layer.ffn, "moe"), (layer.ffn.gate, "moe.router")):
            hooks += [mod.register_forward_pre_hook(enter(name)), mod.register_forward_hook(leave(name))]
        comps = [layer.attn.compressor] if layer.attn.compressor is not None else []
        if layer.attn.indexer is not None:
            comps.append(layer.attn.indexer.compressor)
            for attr in ("select", "select_ranges"):
                if hasattr(layer.attn.indexer, attr):
                    undo.append(wrap(layer.attn.indexer, attr, "attention.indexer_select"))
        for c in comps:
            hooks += [c.register_forward_pre_hook(enter("attention.compressors")),
                      c.register_forward_hook(leave("attention.compressors"))]  # fmt: skip
            if hasattr(c, "forward_many"):
                undo.append(wrap(c, "forward_many", "attention.compressors"))
    ops = model.ops
    graphs = getattr(ops, "cuda_graphs", False)
    ops.cuda_graphs = False  # the regions' hooks and wrappers run only where the modules run: eagerly
    undo.append(wrap(ops, "moe", "moe.routed_experts"))
    undo.append(wrap(ops, "sparse_attention", "attention.sparse_attention"))
    if hasattr(ops, "sparse_attention_lists"):
        undo.append(wrap(ops, "sparse_attention_lists", "attention.sparse_attention"))
    try:
        total = timed(step, dev)
    finally:
        ops.cuda_graphs = graphs
        for h in hooks:
            h.remove()
        for u in undo:
            u()
    regions = {k: round(1e3 * v, 3) for k, v in sorted(spans.items())}
    regions["step (with region syncs)"] = round(1e3 * total, 3)
    out: dict[str, Any] = {"regions_ms": regions}
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync(dev)
        ka = prof.key_averages()
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        try:
            out["table_by_device_time"] = ka.table(sort_by=key, row_limit=60, max_name_column_width=60)
        except Exception:  # noqa: BLE001 - older sort keys
            out["table_by_device_time"] = ka.table(sort_by="self_cuda_time_total", row_limit=30)
        out["table_by_cpu_time"] = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        counts: dict[str, int] = {}
        for e in ka:
            for tag in ("LaunchKernel", "cudaGraphLaunch", "_local_scalar_dense", "cudaStreamSynchronize",
                        "cudaMemcpyAsync", "aten::"):  # fmt: skip
                if tag in e.key:
                    counts[tag] = counts.get(tag, 0) + e.count
        out["counts"] = counts
        out["kernels_us"] = kernel_times(ka, key)
        dev_total = sum(getattr(e, "self_device_time_total", 0.0) for e in ka)
        out["device_busy_ms"] = round(dev_total / 1e3, 3)
    except Exception as e:  # noqa: BLE001 - the profile is informative only
        out["profiler_error"] = f"{type(e).__name__}: {e}"[:300]
    if dev.type == "cuda":
        try:
            out["timeline"] = issue_timeline(model, step)
        except Exception as e:  # noqa: BLE001 - the profile is informative only
            out["timeline_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        out["host_spans"] = decode_spans(model, step, lambda: sync(dev), DECODE_SPANS)
    except Exception as e:  # noqa: BLE001 - the profile is informative only
        out["host_spans_error"] = f"{type(e).__name__}: {e}"[:300]
    out["host_python"] = host_profile(step, dev)
    return out


def kernel_times(ka, key: str = "self_device_time_total", limit: int = 60) -> dict[str, float]:
    """The profiled ops by their own ``key`` time (on a GPU the device's: the kernels, those replayed by CUDA graphs
    included; on the CPU the ops' own CPU time), µs each summed over its calls, longest first: the per-kernel account
    that two runs compare."""
    times = {e.key: float(getattr(e, key, 0.0)) for e in ka}
    top = sorted(((k, v) for k, v in times.items() if v > 0), key=lambda kv: -kv[1])[:limit]
    return {k: round(v, 1) for k, v in top}


def issue_time(run, dev: torch.device) -> dict[str, float]:
    """One more run from an idle device: ``issue_ms``, the host's time until ``run`` returns (the work queued), and
    ``ms``, until the device finishes it. ``issue_ms`` close to ``ms`` means the host sets the pace (launches or
    syncs); far below, the device does."""
    sync(dev)
    t0 = time.perf_counter()
    run()
    t1 = time.perf_counter()
    sync(dev)
    t2 = time.perf_counter()
    return {"issue_ms": round((t1 - t0) * 1e3, 3), "ms": round((t2 - t0) * 1e3, 3)}


def profile_prefill(run, dev: torch.device, shapes: bool = False, model: Any = None) -> dict[str, Any]:
    """``torch.profiler`` over one more prefill: the kernels by device time, the device's busy time and its idle
    gaps (``device_gaps``); with ``shapes`` also the ops grouped by their input shapes (which copy, which GEMM).
    Then, unprofiled, the host's issue time of one prefill (``issue_time``), the host's time per op of the model's ops
    (``host_ops``), who waits for whom at each layer (``issue_timeline``) and cProfile's view of its Python
    (``host_profile``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    ops = getattr(model, "ops", None)
    views = {"issue": lambda: issue_time(run, dev), "host_python": lambda: host_profile(run, dev, steps=1)}
    if ops is not None:
        views["host_ops"] = lambda: host_op_times(ops, run, lambda: sync(dev))
    if model is not None and dev.type == "cuda":
        views["timeline"] = lambda: issue_timeline(model, run)
    host: dict[str, Any] = {}
    for name, view in views.items():
        try:
            host[name] = view()
        except Exception as e:  # noqa: BLE001 - the profile is informative only: one view failing loses none else
            host[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    if "timeline" in host:  # per chunk: the host's time beside how far ahead of the device it ran
        host["chunks"] = chunk_issue(host["timeline"])
    try:
        with profile(activities=acts, record_shapes=shapes) as prof:
            run()
            sync(dev)
        ka = prof.key_averages()
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        busy = sum(getattr(e, "self_device_time_total", 0.0) for e in ka)
        table = ka.table(sort_by=key, row_limit=60, max_name_column_width=60)
        out = {"table_by_device_time": table, "device_busy_ms": round(busy / 1e3, 3), **host}
        if dev.type == "cuda":
            out["device_gaps"] = device_gaps(prof)
        if shapes:
            by_shape = prof.key_averages(group_by_input_shape=True)
            out["table_by_input_shape"] = by_shape.table(
                sort_by=key, row_limit=60, max_name_column_width=40, max_shapes_column_width=90
            )
        return out
    except Exception as e:  # noqa: BLE001 - the profile is informative only
        return {"profiler_error": f"{type(e).__name__}: {e}"[:300], **host}


def host_profile(step, dev: torch.device, steps: int = 3) -> str:
    """Where the host's time goes in ``steps`` runs of ``step`` (decode steps as the op set runs them, graphs
    included, or a prefill): cProfile's
    top functions by own time, then by cumulative time (the Python side that torch.profiler does not show)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync(dev)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).strip_dirs()
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    return buf.getvalue()[-24000:]


class Ours:
    def __init__(
        self,
        model: DeepseekV4Model,
        args: argparse.Namespace,
        dev: torch.device,
        batches: list[int],
        weight_sets: WeightSets | None = None,
        order_sets: OrderSets | None = None,
    ):
        c = model.config
        self.model, self.args, self.dev, self.c = model, args, dev, c
        ps = args.page_size
        # + the routing probe, two profiled steps, a timeline, three host-profiled ones, a spare, host_and_pipelined's
        # and decode_spans'
        self.steps = args.warmup + args.repeats + 8 + 3 + PIPELINED_STEPS + DECODE_SPANS
        self.profiles: dict[int, dict] = {}
        self.ab: list[dict] = []  # --ab: before/after rows (decode_ab)
        self.pages_per_seq = -(-(args.context + self.steps) // ps)
        self.n_tpl = args.contexts
        max_prefill = max(args.prefill_tokens, default=0)
        self.weight_sets, self.order_sets = weight_sets, order_sets
        self.lanes = len(decode_ab.variants_of(self)) if args.ab else 1  # --ab: one set of batch pages per variant
        n_dec = (self.n_tpl + self.lanes * max(batches, default=0)) * self.pages_per_seq
        num_pages = n_dec + -(-max_prefill // ps)
        self.cache = PagedKVCache(c, num_pages, ps, torch.bfloat16, dev)
        pages = torch.arange(num_pages, device=dev)
        # templates first, then the batch; a matrix of its own, as the worker's (a batch's rows are then a view of it:
        # state_pool.stacked_rows)
        self.tables = pages[:n_dec].view(-1, self.pages_per_seq).clone()
        self.prefill_table = pages[n_dec:]
        self.rng = random.Random(args.seed)
        log(f"  paged cache: {num_pages} pages of {ps} tokens, {self.cache.bytes_per_page() * num_pages / 1e9:.2f} GB")

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(2, self.c.vocab_size) for _ in range(n)]

    def _prefill(self, st: SequenceState, table: torch.Tensor, ids: list[int]) -> torch.Tensor:
        h = None
        for s in range(0, len(ids), self.args.chunk):
            part = ids[s : s + self.args.chunk]
            batch = ForwardBatch.build([SeqChunk(st, s, len(part), table)], [part], self.dev)
            h = self.model(batch, self.cache)
        return self.model.logits(h[-1:])

    def make_step(self, b: int, n_steps: int, tokens: list[list[int]] | None = None, lane: int = 0):
        """A decode step of ``b`` fresh copies of the templates (own states, own cache pages: the batch's pages of
        ``lane``): each call advances every sequence by one token (the next of ``tokens``, else random) and returns
        the logits of every row."""
        tables = self.tables[self.n_tpl + lane * b : self.n_tpl + (lane + 1) * b]
        states = [clone_state(self.templates[j % self.n_tpl]) for j in range(b)]
        src = self.tables[torch.arange(b, device=self.dev) % self.n_tpl]
        copy_pages(self.cache, src.flatten(), tables.flatten())
        it = iter(tokens if tokens is not None else [self._ids(b) for _ in range(n_steps)])

        def step():
            ids = next(it)
            chunks = [SeqChunk(s, s.num_tokens, 1, tb) for s, tb in zip(states, tables)]
            batch = ForwardBatch.build(chunks, [[i] for i in ids], self.dev)
            return self.model.logits(self.model(batch, self.cache))

        return step

    def decode(self, batches: list[int], budget: Budget) -> tuple[list[dict], dict]:
        rows: list[dict] = []
        info: dict[str, Any] = {"contexts": self.n_tpl, "context": self.args.context}
        t = time.perf_counter()
        try:
            self.templates = []
            for i in range(self.n_tpl):
                st = SequenceState()
                self._prefill(st, self.tables[i], self._ids(self.args.context))
                self.templates.append(st)
            sync(self.dev)
        except Exception as e:  # noqa: BLE001 - record it and go on
            note = failure(e, self.dev)
            return [{"batch": b, "ms": None, "note": f"context prefill: {note}"} for b in batches], info
        info["context_prefill_s"] = time.perf_counter() - t
        n, secs = self.n_tpl, info["context_prefill_s"]
        log(f"  ours: {n} context(s) of {self.args.context} tokens prefilled in {secs:.1f} s")
        budget.restart()
        prev: tuple[int, float] | None = None
        for b in batches:
            est = prev[1] * b / prev[0] if prev else None
            row: dict[str, Any] = {"batch": b}
            step = None
            try:
                if budget.left() <= 0:
                    raise Skip("skipped: section budget spent")
                step = self.make_step(b, self.steps)
                row.update(run_timed(step, self.dev, self.args.warmup, self.args.repeats, budget, est))
                if budget.left() > row["ms"] * (PIPELINED_STEPS + 3) / 1e3:
                    row.update(host_and_pipelined(step, self.dev))
                row["distinct_experts"] = self._probe_routing(step)
                prev = (b, row["ms"] / 1e3)
                timing = {k: round(row[k], 2) for k in ("host_ms", "pipelined_ms") if k in row}
                log(f"  ours decode B={b}: {row['ms']:.2f} ms/step ({row['runs']} runs); {timing}")
                if b in self.args.profile:
                    self.profiles[b] = profile_step(self.model, step, self.dev)
                    log(f"  ours decode B={b} profiled: {self.profiles[b]['regions_ms']}")
                if self.args.ab and hasattr(self.model.ops, "cuda_graphs"):
                    del step
                    step = None
                    ab = decode_ab.ab_decode(self, b, timed, Budget(self.args.budget_s, budget.deadline))
                    self.ab.append(ab)
                    log(
                        f"  ours decode B={b} before/after: "
                        + ", ".join(
                            f"{k} {v['ms']:.1f} ms, {v['counts']['LaunchKernel']} launches"
                            for k, v in ab.items()
                            if isinstance(v, dict) and "ms" in v
                        )
                        + f"; {ab.get('exactness')}"
                    )
            except Skip as e:
                row.update(ms=None, note=str(e))
                log(f"  ours decode B={b}: {e}")
            except Exception as e:  # noqa: BLE001 - one failed shape must not lose the run
                row.update(ms=None, note=failure(e, self.dev))
                log(f"  ours decode B={b}: {row['note']}")
            finally:
                step = None
                free(self.dev)
            rows.append(row)
        self.templates = []
        return rows, info

    def _probe_routing(self, step) -> float | None:
        """Mean number of distinct routed experts per MoE layer in one more step."""
        seen: list[int] = []
        hooks = [
            layer.ffn.gate.register_forward_hook(lambda m, i, o: seen.append(int(torch.unique(o[0]).numel())))
            for layer in self.model.layers
        ]
        ops = self.model.ops
        graphs = getattr(ops, "cuda_graphs", False)
        ops.cuda_graphs = False  # module hooks run only where the modules run: eagerly
        try:
            step()
        finally:
            ops.cuda_graphs = graphs
            for h in hooks:
                h.remove()
        return statistics.mean(seen) if seen else None

    def prefill(self, tokens: list[int], budget: Budget) -> list[dict]:
        rows: list[dict] = []
        prev: tuple[int, float] | None = None
        for n in tokens:
            est = prev[1] * (n / prev[0]) ** 1.5 if prev else None
            row: dict[str, Any] = {"tokens": n, "chunk": min(n, self.args.chunk)}
            try:
                if budget.left() <= 0:
                    raise Skip("skipped: section budget spent")
                ids = self._ids(n)
                table = self.prefill_table

                def run(ids=ids, table=table):
                    return self._prefill(SequenceState(), table, ids)

                row.update(run_timed(run, self.dev, 1, self.args.prefill_repeats, budget, est))
                prev = (n, row["ms"] / 1e3)
                if budget.left() > row["ms"] * (PREFILL_PIPELINED + 3) / 1e3:
                    row.update(host_and_pipelined(run, self.dev, PREFILL_PIPELINED))
                timing = {k: round(row[k], 2) for k in ("host_ms", "pipelined_ms") if k in row}
                log(f"  ours prefill {n}: {row['ms']:.1f} ms ({row['runs']} runs); {timing}")
                if n in self.args.profile_prefill:
                    self.profiles[f"prefill_{n}"] = profile_prefill(run, self.dev, self.args.profile_shapes,
                                                                    self.model)  # fmt: skip
            except Skip as e:
                row.update(ms=None, note=str(e))
                log(f"  ours prefill {n}: {e}")
            except Exception as e:  # noqa: BLE001 - one failed shape must not lose the run
                row.update(ms=None, note=failure(e, self.dev))
                log(f"  ours prefill {n}: {row['note']}")
            finally:
                free(self.dev)
            rows.append(row)
        return rows

    def prefill_ab(self, n: int, budget: Budget) -> dict[str, Any]:
        """Prefill of ``n`` tokens on each weight set, interleaved: ``bf16``, ``native`` (bf16 activations: the FP8
        linears run W8A16), ``native_w8a8`` (``DEEPINFER_W8A8``: FP8 activations in the FP8 linears only, W8A8 on
        the FP8 tensor cores) and ``native_fp8_act`` (the official FP8 activation rounding of the quantised linears
        and experts, ``quant_sim`` on those modules only). Eager prefills: the variants switch the activation
        rounding in place, which piecewise prefill graphs captured for one variant would not see."""
        sets, ids = self.weight_sets, self._ids(n)
        ops = self.model.ops
        piecewise = getattr(ops, "prefill_graphs", False)
        ops.prefill_graphs = False
        act_modules = [m for m in self.model.modules() if hasattr(m, "quant_sim") and (
            getattr(m, "keeps_fp8", False) or hasattr(m, "w1_scale"))]  # fmt: skip
        variants = {"bf16": ("bf16", False, False), "native": ("native", False, False),
                    "native_w8a8": ("native", False, True), "native_fp8_act": ("native", True, False)}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in variants}
        w8a8 = self.args.w8a8

        def use(name: str) -> None:
            weights, act, linears_fp8 = variants[name]
            sets.use(weights)
            for m in act_modules:
                m.quant_sim = act
            set_w8a8(self.model, linears_fp8 or w8a8)

        def run() -> torch.Tensor:
            return self._prefill(SequenceState(), self.prefill_table, ids)

        prev = sets.current
        try:
            for name in variants:
                use(name)
                run()
            for _ in range(self.args.prefill_repeats):
                if budget.left() <= 0:
                    break
                for name in variants:
                    use(name)
                    times[name].append(timed(run, self.dev))
        finally:
            use("native" if prev == "native" else "bf16")
            for m in act_modules:
                m.quant_sim = False
            set_w8a8(self.model, w8a8)
            ops.prefill_graphs = piecewise
        return {"tokens": n, **{k: 1e3 * statistics.median(v) if v else None for k, v in times.items()}}


@torch.no_grad()
def moe_bench(config: DeepseekV4Config, dev: torch.device, bw: float, budget: Budget) -> list[dict]:
    """One layer's routed experts alone at the model's width (bf16 weights, random distinct routing): the reference
    loop, ``torch._grouped_mm`` and the Triton kernels (both tile configs), timed, with the relative error against
    the reference and the time to read the touched experts' bf16 bytes at the measured copy bandwidth."""
    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.kernels import moe as kmoe

    e, i, d, k = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size, config.num_experts_per_tok
    g = torch.Generator(device=dev).manual_seed(7)
    bf = torch.bfloat16
    w1 = (torch.randn(e, i, d, generator=g, device=dev) * d**-0.5).to(bf)
    w3 = (torch.randn(e, i, d, generator=g, device=dev) * d**-0.5).to(bf)
    w2 = (torch.randn(e, d, i, generator=g, device=dev) * i**-0.5).to(bf)
    impls = {
        "reference": lambda *a: ReferenceOps("nvidia").moe(*a),
        "grouped_mm": kmoe.moe_grouped_mm,
        "triton_small": lambda *a: kmoe.moe_triton(*a, config=kmoe.MOE_SMALL),
        "triton_large": lambda *a: kmoe.moe_triton(*a, config=kmoe.MOE_LARGE),
    }
    rows = []
    for t in (1, 16, 64, 256, 1024, 4096):
        x = torch.randn(t, d, generator=g, device=dev).to(bf)
        idx = distinct_ids(t, e, k, g, dev)
        w = torch.rand(t, k, generator=g, device=dev)
        touched = int(torch.unique(idx).numel())
        row: dict[str, Any] = {"tokens": t, "experts_touched": touched,
                               "bf16_bytes_ms": 1e3 * touched * 3 * i * d * 2 / bw}  # fmt: skip
        ref = None
        for name, fn in impls.items():
            if budget.left() <= 0:
                row[name] = "skipped: budget"
                continue
            try:
                args = (x, idx, w, w1, w2, w3, config.swiglu_limit)
                out = fn(*args)
                sync(dev)
                times = sorted(timed(lambda fn=fn, args=args: fn(*args), dev) for _ in range(7))
                row[f"{name}_ms"] = 1e3 * times[len(times) // 2]
                if name == "reference":
                    ref = out
                elif ref is not None:
                    row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
            except Exception as ex:  # noqa: BLE001 - one failed implementation must not lose the others
                row[name] = f"error: {type(ex).__name__}: {ex}"[:300]
        log(f"  MoE T={t}: " + ", ".join(f"{k_}={v:.3g}" for k_, v in row.items() if isinstance(v, float)))
        rows.append(row)
    del w1, w2, w3
    free(dev)
    return rows


# -- the peer ---------------------------------------------------------------------------------------


class Peer:
    def __init__(self, config: DeepseekV4Config, args: argparse.Namespace, dev: torch.device) -> None:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401 - fails early when the class is missing

        from deepinfer.checkpoint.references import hf_config

        self.args, self.dev = args, dev
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with warnings.catch_warnings(), dev:
                warnings.simplefilter("ignore")
                self.hf = DeepseekV4ForCausalLM(hf_config(config)).eval()
        finally:
            torch.set_default_dtype(prev)
        fill_peer(self.hf, args.seed + 1, dev)
        self.vocab = config.vocab_size
        self.gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
        self.experts_impl = getattr(self.hf.config, "_experts_implementation", None)

    def _ids(self, *shape: int) -> torch.Tensor:
        return torch.randint(2, self.vocab, shape, generator=self.gen, device=self.dev)

    def _forward(self, ids: torch.Tensor, cache=None):
        return self.hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def decode(self, batches: list[int], budget: Budget) -> tuple[list[dict], dict]:
        args, rows = self.args, []
        info: dict[str, Any] = {"contexts": 1, "context": args.context}
        t = time.perf_counter()
        try:
            ctx_ids = self._ids(1, args.context)
            base = self._forward(ctx_ids).past_key_values
            sync(self.dev)
        except Exception as e:  # noqa: BLE001 - record it and go on
            note = failure(e, self.dev)
            return [{"batch": b, "ms": None, "note": f"context prefill: {note}"} for b in batches], info
        info["context_prefill_s"] = time.perf_counter() - t
        log(f"  peer: context of {args.context} tokens prefilled in {info['context_prefill_s']:.1f} s")
        budget.restart()
        prev: tuple[int, float] | None = None
        steps = args.warmup + args.repeats + 2
        for b in batches:
            est = prev[1] * b / prev[0] if prev else None
            row: dict[str, Any] = {"batch": b}
            cache = None
            try:
                if budget.left() <= 0:
                    raise Skip("skipped: section budget spent")
                try:
                    cache = copy.deepcopy(base)
                except Exception:  # noqa: BLE001 - a cache that cannot be copied is prefilled again
                    cache = self._forward(ctx_ids).past_key_values
                if b > 1:
                    cache.reorder_cache(torch.zeros(b, dtype=torch.long, device=self.dev))
                toks = self._ids(steps, b, 1)
                it = iter(range(steps))

                def step(cache=cache, toks=toks, it=it):
                    return self._forward(toks[next(it)], cache).logits

                row.update(run_timed(step, self.dev, args.warmup, args.repeats, budget, est))
                row["distinct_experts"] = self._probe_routing(step)
                prev = (b, row["ms"] / 1e3)
                log(f"  peer decode B={b}: {row['ms']:.1f} ms/step ({row['runs']} runs)")
            except Skip as e:
                row.update(ms=None, note=str(e))
                log(f"  peer decode B={b}: {e}")
            except Exception as e:  # noqa: BLE001 - one failed shape must not lose the run
                row.update(ms=None, note=failure(e, self.dev))
                log(f"  peer decode B={b}: {row['note']}")
            finally:
                del cache
                free(self.dev)
            rows.append(row)
        del base
        free(self.dev)
        return rows, info

    def _probe_routing(self, step) -> float | None:
        seen: list[int] = []
        gates = [m for n, m in self.hf.named_modules() if n.endswith("mlp.gate")]
        hooks = [g.register_forward_hook(lambda m, i, o: seen.append(int(torch.unique(o[2]).numel()))) for g in gates]
        try:
            step()
        except Exception:  # noqa: BLE001 - the probe is informative only
            return None
        finally:
            for h in hooks:
                h.remove()
        return statistics.mean(seen) if seen else None

    def prefill(self, tokens: list[int], budget: Budget) -> list[dict]:
        rows: list[dict] = []
        prev: tuple[int, float] | None = None
        for n in tokens:
            est = prev[1] * (n / prev[0]) ** 1.5 if prev else None
            row: dict[str, Any] = {"tokens": n}
            try:
                if budget.left() <= 0:
                    raise Skip("skipped: section budget spent")
                ids = self._ids(1, n)
                run = lambda ids=ids: self._forward(ids)  # noqa: E731
                row.update(run_timed(run, self.dev, 1, self.args.prefill_repeats, budget, est))
                prev = (n, row["ms"] / 1e3)
                log(f"  peer prefill {n}: {row['ms']:.1f} ms ({row['runs']} runs)")
            except Skip as e:
                row.update(ms=None, note=str(e))
                log(f"  peer prefill {n}: {e}")
            except Exception as e:  # noqa: BLE001 - one failed shape must not lose the run
                row.update(ms=None, note=failure(e, self.dev))
                log(f"  peer prefill {n}: {row['note']}")
            finally:
                free(self.dev)
            rows.append(row)
        return rows


# -- report -----------------------------------------------------------------------------------------


def add_roofline(work: Work, decode: list[dict], prefill: list[dict], context: int, bw: float, peak: float) -> None:
    for r in decode:
        r.update(work.decode(r["batch"], context, bw, peak))
        ms = r.get("ms")
        r["x_roofline"] = ms / r["roofline_ms"] if ms else None
        r["tok_s"] = 1e3 * r["batch"] / ms if ms else None
    for r in prefill:
        roof = work.prefill(r["tokens"], bw, peak)
        r.update(roof)
        ms = r.get("ms")
        r["fraction_of_fp8_peak"] = roof["fp8_flop_ms"] / ms if ms else None
        b2b = r.get("pipelined_ms")  # prefills queued back to back, as an async scheduler issues chunks
        r["fraction_of_fp8_peak_pipelined"] = roof["fp8_flop_ms"] / b2b if b2b else None
        r["x_roofline"] = ms / roof["roofline_ms"] if ms else None
        r["TFLOPs"] = roof["TFLOP"] / (ms / 1e3) if ms else None
        r["tok_s"] = 1e3 * r["tokens"] / ms if ms else None


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(res: dict[str, Any]) -> str:
    peer = res.get("peer") or {}
    pd = {r["batch"]: r for r in peer.get("decode", [])}
    pp = {r["tokens"]: r for r in peer.get("prefill", [])}
    ce = res["ceilings"]
    fp8 = ce.get("fp8_TFLOPs")
    lines = [
        f"**{res['gpu']}** — {res['model']['layers']} layers of V4-{'tiny' if res['tiny'] else 'Flash'} width; "
        f"ceilings measured: copy {ce['hbm_copy_GBps']:.0f} GB/s, bf16 {ce['bf16_TFLOPs']:.3g} TFLOP/s, "
        f"FP8 {_f(fp8, '.3g')} TFLOP/s. Peer: {peer.get('name', 'unavailable: ' + str(res.get('peer_reason')))}",
        "",
        f"Decode (context {res['decode_context']} tokens per sequence; ms per step of the whole batch)",
        "",
        "| batch | ours ms | peer ms | roofline ms | ours × roofline | peer × roofline | ours tok/s | peer tok/s | "
        "experts/layer (model / ours / peer) | ours host ms | ours back to back ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    notes = []
    for r in res["decode"]:
        p = pd.get(r["batch"], {})
        lines.append(
            f"| {r['batch']} | {_f(r.get('ms'), '.1f')} | {_f(p.get('ms'), '.1f')} | {r['roofline_ms']:.3f} | "
            f"{_f(r.get('x_roofline'), '.1f')} | {_f(p.get('x_roofline'), '.1f')} | {_f(r.get('tok_s'), '.1f')} | "
            f"{_f(p.get('tok_s'), '.1f')} | {r['unique_experts_per_layer']:.1f} / "
            f"{_f(r.get('distinct_experts'), '.1f')} / {_f(p.get('distinct_experts'), '.1f')} | "
            f"{_f(r.get('host_ms'), '.2f')} | {_f(r.get('pipelined_ms'), '.2f')} |"
        )
        for who, x in (("ours", r), ("peer", p)):
            if x.get("note"):
                notes.append(f"decode B={r['batch']} {who}: {x['note']}")
    lines += [
        "",
        "Prefill (one sequence; ours chunked by --chunk, peer one forward)",
        "",
        "| tokens | ours ms | peer ms | FP8 FLOP roofline ms | roofline ms | ours frac. of FP8 peak | "
        "peer frac. of FP8 peak | ours TFLOP/s | peer TFLOP/s | ours host ms | ours back to back ms | "
        "ours frac. back to back |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["prefill"]:
        p = pp.get(r["tokens"], {})
        lines.append(
            f"| {r['tokens']} | {_f(r.get('ms'), '.1f')} | {_f(p.get('ms'), '.1f')} | {r['fp8_flop_ms']:.3f} | "
            f"{r['roofline_ms']:.3f} | {_f(r.get('fraction_of_fp8_peak'), '.4f')} | "
            f"{_f(p.get('fraction_of_fp8_peak'), '.4f')} | {_f(r.get('TFLOPs'), '.3g')} | "
            f"{_f(p.get('TFLOPs'), '.3g')} | {_f(r.get('host_ms'), '.1f')} | {_f(r.get('pipelined_ms'), '.1f')} | "
            f"{_f(r.get('fraction_of_fp8_peak_pipelined'), '.4f')} |"
        )
        for who, x in (("ours", r), ("peer", p)):
            if x.get("note"):
                notes.append(f"prefill {r['tokens']} {who}: {x['note']}")
    if res.get("decode_ab"):
        lines += ["", "Decode before/after (--ab; decode_ab.py)", "", decode_ab.markdown(res["decode_ab"])]
    if res.get("prefill_ab"):
        head = ("| tokens | bf16 weights | native (W8A16) | native, FP8 linear activations (W8A8) | native, FP8 "
                "activations of linears and experts |")  # fmt: skip
        lines += ["", "Prefill A/B (--ab-weights; median ms, interleaved)", "", head, "|---:|---:|---:|---:|---:|"]
        for r in res["prefill_ab"]:
            cells = " | ".join(_f(r.get(k), ".1f") for k in ("bf16", "native", "native_w8a8", "native_fp8_act"))
            lines.append(f"| {r['tokens']} | {cells} |" + (f" {r['note']}" if r.get("note") else ""))
    if res.get("weight_bytes"):
        lines += ["", f"Bytes of the swapped weights: {res['weight_bytes']}"]
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peer = res.get("peer") or {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, x, title in (
        (ax1, "decode", "batch", f"decode step, {res['decode_context']}-token context"),
        (ax2, "prefill", "tokens", "prefill, one sequence"),
    ):
        rows = res[key]
        xs = [r[x] for r in rows]
        ax.plot(xs, [r["roofline_ms"] for r in rows], "k--", label="roofline (native formats, measured ceilings)")
        if key == "prefill":
            ax.plot(xs, [r["fp8_flop_ms"] for r in rows], "k:", label="FP8 FLOP roofline")
        for name, data, style in (("ours", rows, "o-"), ("peer (transformers)", peer.get(key, []), "s-")):
            pts = [(r[x], r["ms"]) for r in data if r.get("ms")]
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['gpu']} — {res['model']['layers']} layers, {res['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--tiny", action="store_true", help="the tiny config of deepinfer.checkpoint.tiny (smoke test)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 4; tiny: its own 6)")
    ap.add_argument("--hash-layers", type=int, default=2, help="hash-routed MoE layers first (V4-Flash width)")
    ap.add_argument("--context", type=int, default=None, help="context tokens per decoding sequence (4096; tiny 1024)")
    ap.add_argument("--contexts", type=int, default=1, help="distinct prefilled contexts the batch is cloned from")
    ap.add_argument("--batches", type=ints, default=[1, 16, 64, 256])
    ap.add_argument("--prefill-tokens", type=ints, default=None, help="default 1024,4096,16384; tiny 256,1024,4096")
    ap.add_argument("--chunk", type=int, default=4096, help="our prefill chunk (bounds the reference's memory)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="decode warm-up steps per batch size")
    ap.add_argument("--repeats", type=int, default=5, help="timed decode steps per batch size")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=None, help="seconds per section (default 60; tiny 15)")
    ap.add_argument("--deadline-s", type=float, default=None, help="no new work after this (default 420; tiny 150)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--profile", type=ints, default=[], help="decode batch sizes to profile (regions + torch.profiler)")
    ap.add_argument("--profile-prefill", type=ints, default=[], help="prefill lengths to profile (torch.profiler)")
    ap.add_argument("--profile-shapes", action="store_true", help="--profile-prefill: also group the ops by shape")
    ap.add_argument("--moe-backend", default="auto", help="NvidiaOps' MoE: auto | grouped_mm | triton")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="before/after of the decode step: eager unfused / eager fused / CUDA graphs (decode_ab.py)",
    )
    ap.add_argument(
        "--weights",
        choices=["auto", "native", "bf16"],
        default="auto",
        help="FP8 linears and MXFP4 experts as stored (native) or dequantised to bf16; auto: ops.native_weights",
    )
    ap.add_argument(
        "--ab-weights",
        action="store_true",
        help="keep both weight sets and make --ab compare bf16 / native eager / native graphs (weight_sets.py)",
    )
    ap.add_argument(
        "--ab-pool",
        action="store_true",
        help="make --ab compare the decode state per sequence against the pooled state (state_pool.py), with graphs",
    )
    ap.add_argument(
        "--ab-h2d",
        action="store_true",
        help="make --ab compare the step's host-to-device copies synchronous against asynchronous (host_copy.py)",
    )
    ap.add_argument(
        "--ab-order",
        action="store_true",
        help="make --ab compare the MXFP4 experts' codes as stored against their shift and rotate orders",
    )
    ap.add_argument("--ab-prefill", type=ints, default=[4096], help="prefill lengths of the --ab-weights prefill A/B")
    ap.add_argument(
        "--quant-sim",
        action="store_true",
        help="our model with the official numerics (DEEPINFER_QUANT_SIM): FP8 activations in the FP8 linears and "
        "the experts (the FP8 linears W8A8 on the FP8 tensor cores), FP8 / FP4 cache round trips",
    )
    ap.add_argument(
        "--w8a8",
        action="store_true",
        help="our model with FP8 activations in the FP8 linears only (DEEPINFER_W8A8): W8A8 on the FP8 tensor cores",
    )
    ap.add_argument(
        "--w4a8",
        action="store_true",
        help="our model with FP8 activations in the routed experts (DEEPINFER_W4A8): W4A8 prefill tiles on the FP8 "
        "tensor cores",
    )
    ap.add_argument("--moe-bench", action="store_true", help="time the MoE implementations alone at V4-Flash width")
    ap.add_argument("--name", default=None, help="output stem (default <date>-sweep)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write DIR/<date>-sweep.json and .png")
    args = ap.parse_args(argv)
    if args.context is None:
        args.context = 1024 if args.tiny else 4096
    if args.prefill_tokens is None:
        args.prefill_tokens = [256, 1024, 4096] if args.tiny else [1024, 4096, 16384]
    if args.budget_s is None:
        args.budget_s = 15.0 if args.tiny else 60.0
    if args.deadline_s is None:
        args.deadline_s = 150.0 if args.tiny else 420.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    deadline = T0 + args.deadline_s
    torch.manual_seed(args.seed)
    config = build_config(args)
    work = Work.of(config)
    full = Work.of(DeepseekV4Config(num_hidden_layers=43, compress_ratios=flash_ratios(43), num_nextn_predict_layers=0))
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_name(dev),
        "versions": versions(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "tiny": args.tiny,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {**work.summary(), "layer_kinds": [config.layer_kind(i) for i in range(config.num_hidden_layers)]},
        "full_v4_flash_reference": full.summary(),
        "decode_context": args.context,
        "notes": [
            "roofline: checkpoint-native formats (FP8 128x128 + bf16 + fp32 + MXFP4 experts), measured copy GB/s and "
            "FP8 TFLOP/s; decode = max(bytes/BW, FLOPs/FP8 peak), prefill fraction_of_fp8_peak = FP8 FLOP time / ms",
            "decode batches are cloned from --contexts prefilled contexts (ours) / one context (peer), "
            "each with its own state and cache pages; next tokens are random and distinct per sequence",
        ],
    }
    log(f"device: {res['gpu']}; torch {torch.__version__}; model: {res['model']}")

    with torch.no_grad():
        log("probing ceilings ...")
        ce = probe_ceilings(dev)
        res["ceilings"] = ce
        if dev.type == "cuda" and "H200" in res["gpu"]:
            res["ceilings"]["h200_datasheet"] = H200_DATASHEET
        bw = ce["hbm_copy_GBps"] * 1e9
        peak = max(ce["fp8_TFLOPs"] or 0.0, ce["bf16_TFLOPs"]) * 1e12
        if peak > (ce["fp8_TFLOPs"] or 0.0) * 1e12:
            res["notes"].append("FP8 matmul missing or slower than bf16 here: the 'FP8 peak' is the bf16 one")
        log(f"  copy {ce['hbm_copy_GBps']:.0f} GB/s, read {ce['hbm_read_GBps']:.0f} GB/s, bf16 {ce['bf16_TFLOPs']:.3g} "
            f"TFLOP/s, FP8 {_f(ce['fp8_TFLOPs'], '.3g')} TFLOP/s")  # fmt: skip

        log(f"building our model ({work.total_params / 1e9:.2f} B params) on {dev} in bf16 ...")
        t = time.perf_counter()
        model = build_ours(config, dev, args.seed, args.moe_backend)
        sets = None
        native = args.weights == "native" or (args.weights == "auto" and getattr(model.ops, "native_weights", False))
        if args.ab_weights:
            sets = WeightSets(model, tuple(config.weight_block_size))
            res["weight_bytes"] = {k: sets.bytes(k) for k in sets.sets}
        elif native:
            prepare_native(model, tuple(config.weight_block_size), quantize=True)
        orders = (
            OrderSets(model) if args.ab_order else None
        )  # --ab: the experts' nibble orders (bench/engine/weight_sets.py)
        set_w8a8(model, args.w8a8)  # before prepare_weights: it joins projections of equal activation roundings
        set_w4a8(model, args.w4a8)  # before prepare_weights: W4A8 experts keep their codes as stored
        if orders is None:
            model.ops.prepare_weights(model)  # the MXFP4 experts in the rotate order on a GPU (quant.nibble_order)
        if args.quant_sim:
            model.set_quant_sim(True)
        res["quant_sim"] = args.quant_sim
        res["w8a8"] = args.w8a8
        res["w4a8"] = args.w4a8
        res["weights"] = "native" if native or args.ab_weights else "bf16"
        sync(dev)
        res["build_s"] = time.perf_counter() - t
        if dev.type == "cuda":
            log(f"  built in {res['build_s']:.1f} s; {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB allocated")
        # as the worker service after its start-up (DEEPINFER_GC_FREEZE): no full collection walks the build's objects
        res["gc_frozen"] = freeze_heap()["frozen"]
        ours = Ours(model, args, dev, args.batches, sets, orders)
        log("ours: decode ...")
        res["decode"], res["decode_info"] = ours.decode(args.batches, Budget(args.budget_s, deadline))
        log("ours: prefill ...")
        res["prefill"] = ours.prefill(args.prefill_tokens, Budget(args.budget_s, deadline))
        if sets is not None:
            res["prefill_ab"] = []
            for n in args.ab_prefill:
                try:
                    res["prefill_ab"].append(ours.prefill_ab(n, Budget(args.budget_s, deadline)))
                    log(f"  ours prefill A/B: {res['prefill_ab'][-1]}")
                except Exception as e:  # noqa: BLE001 - one failed shape must not lose the run
                    res["prefill_ab"].append({"tokens": n, "note": failure(e, dev)})
                finally:
                    free(dev)
        add_roofline(work, res["decode"], res["prefill"], args.context, bw, peak)
        res["ops"] = {"class": type(model.ops).__name__, "moe_backend": getattr(model.ops, "moe_backend", None)}
        res["ops"]["fused"] = getattr(model.ops, "fused", None)
        res["ops"]["cuda_graphs"] = getattr(model.ops, "cuda_graphs", None)
        res["ops"]["prefill_graphs"] = getattr(model.ops, "prefill_graphs", None)
        pg = getattr(model, "prefill_graphs", None)
        if pg is not None:  # piecewise prefill graphs: replayed steps and buckets whose capture failed (run eagerly)
            res["ops"]["prefill_graph_replays"], res["ops"]["prefill_graph_failures"] = pg.replays, dict(pg.failures)
        if ours.profiles:
            res["profile"] = {str(b): p for b, p in ours.profiles.items()}
        if ours.ab:
            res["decode_ab"] = ours.ab
        if dev.type == "cuda":
            res["peak_mem_GiB"] = torch.cuda.max_memory_allocated(dev) / 2**30
        thaw_heap()  # our model's reference cycles (its CUDA graphs) collectible again, so that its memory goes
        del ours, model
        free(dev)
        if args.moe_bench:
            log("MoE alone ...")
            res["moe_bench"] = moe_bench(config, dev, bw, Budget(args.budget_s, deadline))
        free(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            log(f"our model freed; {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB still allocated")

        res["peer"], res["peer_reason"] = None, None
        if args.no_peer:
            res["peer_reason"] = "--no-peer"
        elif deadline - time.monotonic() < 0.25 * args.budget_s:
            res["peer_reason"] = "skipped: deadline reached before the peer"
        else:
            peer = None
            try:
                log("building the peer (transformers DeepseekV4ForCausalLM) ...")
                t = time.perf_counter()
                peer = Peer(config, args, dev)
                sync(dev)
                log(f"  built in {time.perf_counter() - t:.1f} s (experts implementation: {peer.experts_impl})")
                p: dict[str, Any] = {
                    "name": f"transformers {res['versions']['transformers']} DeepseekV4ForCausalLM (eager, bf16)",
                    "experts_implementation": peer.experts_impl,
                    "build_s": time.perf_counter() - t,
                }
                log("peer: decode ...")
                p["decode"], p["decode_info"] = peer.decode(args.batches, Budget(args.budget_s, deadline))
                log("peer: prefill ...")
                p["prefill"] = peer.prefill(args.prefill_tokens, Budget(args.budget_s, deadline))
                add_roofline(work, p["decode"], p["prefill"], args.context, bw, peak)
                if dev.type == "cuda":
                    p["peak_mem_GiB"] = torch.cuda.max_memory_allocated(dev) / 2**30
                res["peer"] = p
            except Exception as e:  # noqa: BLE001 - the peer is optional; say why it is missing
                res["peer_reason"] = f"{type(e).__name__}: {e}"[:500]
                log(f"  peer unavailable: {res['peer_reason']}")
            finally:
                del peer
                free(dev)

    res["wall_s"] = time.monotonic() - T0
    table = markdown(res)
    print("\n" + table + "\n", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / (args.name or f"{res['date']}-sweep")
        with open(f"{stem}.json", "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
        log(f"wrote {stem}.json")
        try:
            plot(res, Path(f"{stem}.png"))
            log(f"wrote {stem}.png")
        except Exception as e:  # noqa: BLE001 - the JSON is the record; the plot is a convenience
            log(f"plot failed: {type(e).__name__}: {e}")
    return res


if __name__ == "__main__":
    main()
