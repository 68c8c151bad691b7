"""Build the pieces of an engine from a model directory: shared by the offline ``LLM`` and the services."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.backends import platform_for
from deepinfer.chat.tokens import THINK_END
from deepinfer.checkpoint.hub import check_architecture, resolve_model
from deepinfer.engine import resume_format
from deepinfer.engine.constraints import ConstraintSet
from deepinfer.engine.determinism import Determinism, describe
from deepinfer.engine.models import Model, ModelConfig, build_model, is_v41, model_type_of, parse_config
from deepinfer.engine.pages import PagePool
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import config_from_env
from deepinfer.engine.worker import ModelRunner, min_replay
from deepinfer.models.deepseek_v4.layers import uses_w8a8
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.ops import get_ops
from deepinfer.quant.w4a8 import uses_w4a8
from deepinfer.telemetry import get_logger

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_KV_BUDGET_BYTES = 1 << 30  # default KV page budget when DEEPINFER_NUM_PAGES is unset
log = get_logger(__name__)


def parse_dtype(dtype: str | torch.dtype, accelerator: str) -> torch.dtype:
    """``auto`` is float32 on the cpu backend, bfloat16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if accelerator == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class EngineParts:
    path: Path
    config: ModelConfig
    dtype: torch.dtype
    accelerator: str
    model: Model
    runner: ModelRunner
    num_pages: int
    page_size: int
    max_model_len: int
    determinism: Determinism
    fingerprint: str  # identifies the KV state this worker computes (prefix-cache hashes include it)


def resolve_model_dir(model: str | Path | None) -> tuple[Path, ModelConfig]:
    """The model's local directory (downloading if ``model`` is a hub id) and its parsed config (DeepSeek-V4 or
    V4.1, by config.json's ``model_type``)."""
    if model is None and envs.DEEPINFER_HF_MODEL_DIR is None:
        model = envs.DEEPINFER_MODEL
    path = resolve_model(model, envs.DEEPINFER_HF_MODEL_DIR, envs.DEEPINFER_CACHE_DIR)
    return path, parse_config(check_architecture(path))


def build_worker(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    accelerator: str | None = None,
    max_model_len: int | None = None,
    num_pages: int | None = None,
    page_size: int | None = None,
    quant_sim: bool | None = None,
    batch_invariant: bool | None = None,
) -> EngineParts:
    """Load the model on the accelerator and size its paged KV cache. ``batch_invariant`` (default
    ``DEEPINFER_BATCH_INVARIANT``) selects the batch-invariant ops (docs/determinism.md). ``quant_sim``: V4's
    quantisation simulation (default ``DEEPINFER_QUANT_SIM``); V4.1 keeps its cache formats on unless it is False
    (:func:`~deepinfer.engine.models.build_model`)."""
    envs.validate_all()
    if envs.DEEPINFER_TORCH_THREADS is not None:
        torch.set_num_threads(envs.DEEPINFER_TORCH_THREADS)
    accelerator = accelerator or envs.DEEPINFER_ACCELERATOR
    if batch_invariant is None:
        batch_invariant = envs.DEEPINFER_BATCH_INVARIANT
    ops = get_ops(accelerator, batch_invariant)  # refuses what this host cannot run, before any loading
    path, config = resolve_model_dir(model)
    torch_dtype = parse_dtype(dtype, accelerator)
    device = platform_for(accelerator).device()
    net = build_model(path, config, ops, torch_dtype, device, quant_sim)
    page_size = page_size or envs.DEEPINFER_PAGE_SIZE
    limit = max_model_len or envs.DEEPINFER_MAX_MODEL_LEN or config.max_position_embeddings
    if limit > config.max_position_embeddings:
        raise ValueError(f"max_model_len={limit} exceeds the model's {config.max_position_embeddings} positions")
    if num_pages is None:
        per_page = PagedKVCache(config, 1, page_size, torch_dtype, "meta").bytes_per_page()
        num_pages = envs.DEEPINFER_NUM_PAGES or max(16, min(65536, _KV_BUDGET_BYTES // max(per_page, 1)))
    cache = PagedKVCache(config, num_pages, page_size, torch_dtype, device)
    log.info(
        "model_loaded", path=str(path), model_type=config.model_type, dtype=str(torch_dtype), pages=num_pages,
        page_size=page_size, batch_invariant=ops.batch_invariant,
    )  # fmt: skip
    runner = ModelRunner(net, cache, device)
    runner.constraints = constraint_set(path, config)
    runner.compact_replay = envs.DEEPINFER_COMPACT_REPLAY_TOKENS
    if 0 < runner.compact_replay < min_replay(config):
        raise ValueError(
            f"DEEPINFER_COMPACT_REPLAY_TOKENS={runner.compact_replay} is too short for this model: a replay must "
            f"rebuild the compressors' pending tokens, at least {min_replay(config)}"
        )
    determinism = describe(ops, accelerator, torch_dtype)
    # V4.1's bounded decoder replay changes the decoder layers' window state that resume points hold
    replay = envs.DEEPINFER_DECODER_REPLAY_TOKENS if is_v41(config) else 0
    fp = model_fingerprint(
        path, torch_dtype, page_size, net_quant_sim(net), ops.batch_invariant, replay, uses_w8a8(net), uses_w4a8(net)
    )
    if envs.DEEPINFER_KVSTORE_URL:  # resume points evicted from the device move to the kvstore
        from deepinfer.kvstore.remote import RemoteResumeStore

        runner.remote = RemoteResumeStore(envs.DEEPINFER_KVSTORE_URL, fp, resume_format.decode, resume_format.LAYOUT)
    if accelerator == "nvidia" and envs.DEEPINFER_WARMUP:  # compiles and graph captures before serving
        from deepinfer.engine.warmup import decode_sizes, warm_up

        graphed = decode_sizes(envs.DEEPINFER_MAX_NUM_SEQS, envs.DEEPINFER_CUDA_GRAPH_MAX_BATCH)
        batches = graphed if getattr(ops, "cuda_graphs", False) and not ops.batch_invariant else [1]
        prefill = (2048, envs.DEEPINFER_MAX_NUM_BATCHED_TOKENS)  # the long-prefill tiles (warm_up clips and dedupes)
        warm_up(runner, num_pages, page_size, limit, config.vocab_size, batches, prefill)
    return EngineParts(
        path, config, torch_dtype, accelerator, net, runner, num_pages, page_size, limit, determinism, fp
    )


def constraint_set(path: Path, config: ModelConfig) -> ConstraintSet:
    """The worker's structured-output matchers, against the model's tokenizer (loaded on first use)."""
    from deepinfer.grammar import build_tokenizer_info, control_token_ids, tokenizer_fingerprint

    controls = control_token_ids(path)
    by_text = {text: i for i, text in controls.items()}
    return ConstraintSet(
        lambda: build_tokenizer_info(path),
        controls,
        config.vocab_size,
        config.eos_token_id,
        by_text.get(THINK_END),
        tokenizer_fingerprint(path),
    )


def net_quant_sim(net: Model) -> bool:
    return any(getattr(m, "quant_sim", False) for m in net.modules())


def model_fingerprint(
    path: Path,
    dtype: torch.dtype,
    page_size: int,
    quant_sim: bool,
    invariant: bool,
    decoder_replay: int = 0,
    w8a8: bool = False,
    w4a8: bool = False,
) -> str:
    """What makes two workers' KV state interchangeable: the architecture, the checkpoint (its config and the
    names and sizes of its weight files), the dtype, the page size and the numerics switches (V4.1: also the
    bounded decoder replay, which changes the decoder layers' window state)."""
    h = hashlib.blake2b(digest_size=16)
    raw = (path / "config.json").read_bytes()
    h.update(f"{model_type_of(json.loads(raw))}|".encode())
    h.update(raw)
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    h.update(f"{dtype}|{page_size}|{quant_sim}|{invariant}".encode())
    if decoder_replay:
        h.update(f"|decoder_replay={decoder_replay}".encode())
    if w8a8:  # FP8 activations in the linears (DEEPINFER_W8A8): other KV state; unchanged without them
        h.update(b"|w8a8")
    if w4a8:  # FP8 activations in the routed experts (DEEPINFER_W4A8)
        h.update(b"|w4a8")
    return h.hexdigest()


def build_scheduler(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    max_model_len: int,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    fingerprint: str = "",
    prefix_caching: bool | None = None,
    remote_store: bool = False,
) -> Scheduler:
    return Scheduler(config_from_env(
        page_size, max_model_len, config.eos_token_id, max_num_seqs, max_num_batched_tokens, fingerprint,
        prefix_caching, remote_store,
    ), PagePool(num_pages))  # fmt: skip
