"""Build the pieces of an engine from a model directory: shared by the offline ``LLM`` and the services."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.backends import platform_for
from deepinfer.chat.tokens import THINK_END
from deepinfer.engine.constraints import ConstraintSet
from deepinfer.engine.determinism import Determinism, describe
from deepinfer.engine.model_api import ModelConfig, ModelFamily, ServedModel
from deepinfer.engine.model_dir import resolve_model_dir
from deepinfer.engine.models import family_of, model_type_of
from deepinfer.engine.pages import PagePool
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import config_from_env
from deepinfer.engine.worker import ModelRunner, min_replay
from deepinfer.ops import get_ops
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
    model: ServedModel
    runner: ModelRunner
    num_pages: int
    page_size: int
    max_model_len: int
    determinism: Determinism
    fingerprint: str  # identifies the KV state this worker computes (prefix-cache hashes include it)
    family: ModelFamily  # the model's family (engine.models), by its config's model_type


def build_worker(
    model: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    accelerator: str | None = None,
    max_model_len: int | None = None,
    num_pages: int | None = None,
    page_size: int | None = None,
    quant_sim: bool | None = None,
    batch_invariant: bool | None = None,
    num_speculative_tokens: int | None = None,
    ep: object = None,
) -> EngineParts:
    """Load the model on the accelerator and size its paged KV cache. ``batch_invariant`` (default
    ``DEEPINFER_BATCH_INVARIANT``) selects the batch-invariant ops (docs/determinism.md). ``quant_sim``: the
    model's quantisation simulation, None for its family's default (``ModelFamily.build``). ``ep``: this rank's
    expert-parallel group (``parallel.expert_parallel.ExpertParallel``): the MoE layers hold its experts only; decode
    and verify steps replay graphs only with fixed buffers (``DEEPINFER_EP_FIXED_BUFFER_TOKENS``), captured in the
    warm-up, which every rank of the group runs alike (``expert_parallel.ReplayGate``); prefill steps run eagerly.
    ``num_speculative_tokens`` (default ``DEEPINFER_USE_NEXTN_DECODE``): drafts per sequence and step, 0 for none
    (docs/speculative_decoding.md)."""
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
    family = family_of(config)
    if ep is not None:  # prefill steps exchange row counts, read on the host: no graph holds them
        for flag in ("prefill_graphs",) if ep.fixed is not None else ("cuda_graphs", "prefill_graphs"):
            if hasattr(ops, flag):
                setattr(ops, flag, False)
    net = family.build(path, config, ops, torch_dtype, device, quant_sim, **({} if ep is None else {"ep": ep}))
    page_size = page_size or envs.DEEPINFER_PAGE_SIZE
    limit = max_model_len or envs.DEEPINFER_MAX_MODEL_LEN or config.max_position_embeddings
    if limit > config.max_position_embeddings:
        raise ValueError(f"max_model_len={limit} exceeds the model's {config.max_position_embeddings} positions")
    if num_pages is None:
        per_page = family.new_cache(config, 1, page_size, torch_dtype, "meta").bytes_per_page()
        num_pages = envs.DEEPINFER_NUM_PAGES or max(16, min(65536, _KV_BUDGET_BYTES // max(per_page, 1)))
    cache = family.new_cache(config, num_pages, page_size, torch_dtype, device)
    log.info(
        "model_loaded", path=str(path), model_type=config.model_type, dtype=str(torch_dtype), pages=num_pages,
        page_size=page_size, batch_invariant=ops.batch_invariant,
    )  # fmt: skip
    runner = ModelRunner(net, cache, device, family=family)
    runner.sampler, runner.constraints = Sampler(invariant=ops.batch_invariant), constraint_set(path, config)
    if num_speculative_tokens is None:
        num_speculative_tokens = envs.DEEPINFER_USE_NEXTN_DECODE
    if envs.DEEPINFER_ENABLE_MTP_VARLEN and not num_speculative_tokens:
        raise ValueError(
            "DEEPINFER_ENABLE_MTP_VARLEN sets how many drafts each sequence verifies; speculation is off: set "
            "DEEPINFER_USE_NEXTN_DECODE (or num_speculative_tokens) to the drafts per step, e.g. 5"
        )
    if num_speculative_tokens:  # speculative decoding: the family's drafter (ValueError: none)
        runner.spec = family.speculator(net, num_speculative_tokens)
    runner.compact_replay = envs.DEEPINFER_COMPACT_REPLAY_TOKENS
    if 0 < runner.compact_replay < min_replay(config):
        raise ValueError(
            f"DEEPINFER_COMPACT_REPLAY_TOKENS={runner.compact_replay} is too short for this model: a replay must "
            f"rebuild the compressors' pending tokens, at least {min_replay(config)}"
        )
    tp = getattr(getattr(ep, "tp", None), "size", 1)
    determinism = describe(ops, accelerator, torch_dtype, ep.a2a.size if ep is not None else 1, tp)
    facts = family.fingerprint_facts(net)  # e.g. w8a8, V4.1's bounded decoder replay
    if tp > 1:  # (the attention's output summed over the heads' ranks: other roundings than one rank's)
        facts.append(f"tp={tp}")
    fp = model_fingerprint(path, torch_dtype, page_size, net_quant_sim(net), ops.batch_invariant, facts)
    if envs.DEEPINFER_KVSTORE_URL:  # resume points evicted from the device move to the kvstore
        from deepinfer.kvstore.remote import RemoteResumeStore

        runner.remote = RemoteResumeStore(envs.DEEPINFER_KVSTORE_URL, fp, family.decode_resume, family.resume_layout)
    if accelerator == "nvidia" and envs.DEEPINFER_WARMUP:  # compiles and graph captures before serving
        _warm_up(runner, family, ops, num_pages, page_size, limit, config.vocab_size)
    return EngineParts(
        path, config, torch_dtype, accelerator, net, runner, num_pages, page_size, limit, determinism, fp, family
    )


def _warm_up(runner: ModelRunner, family: Any, ops: Any, num_pages: int, page_size: int, limit: int, vocab: int
             ) -> None:  # fmt: skip
    """The worker's compiles and graph captures before it serves (``engine.warmup``): the decode buckets, the long
    prefill tiles, and the verify steps of the batches that may draft. A rank of a sharded model runs it as every
    other rank does, step for step, and captures only here (``capturing`` of its ``replay_gate``)."""
    from deepinfer.engine.warmup import FixedDrafts, decode_sizes, warm_up
    from deepinfer.runtime.piecewise_graphs import prefill_buckets

    graphed = decode_sizes(envs.DEEPINFER_MAX_NUM_SEQS, envs.DEEPINFER_CUDA_GRAPH_MAX_BATCH, family.decode_buckets)
    graphs = getattr(ops, "cuda_graphs", False) and not ops.invariant_by_sequence and family.decode_buckets
    batches = graphed if graphs else [1]
    prefill = [2048, envs.DEEPINFER_MAX_NUM_BATCHED_TOKENS]  # the long-prefill tiles (warm_up clips and dedupes)
    if graphs and getattr(ops, "prefill_graphs", False) and getattr(runner.model, "piecewise_prefill", True):
        # every token bucket a prefill or mixed step may run in: a bucket first met while serving is captured then,
        # stalling every running request (seconds where its kernels compile)
        prefill += prefill_buckets(envs.DEEPINFER_PREFILL_GRAPH_MAX_TOKENS, envs.DEEPINFER_MAX_NUM_BATCHED_TOKENS)
    verifier, verify = None, []
    if runner.spec is not None:  # the verify steps' shapes too, for the batches that may draft
        verifier = family.speculator(runner.model, runner.spec.max_drafts, FixedDrafts())
        verify = [b for b in batches if b <= envs.DEEPINFER_SPEC_DECODE_MAX_BATCH]
    gate = getattr(runner.model, "replay_gate", None)
    if gate is not None:
        gate.capturing = True
    try:
        warm_up(runner, num_pages, page_size, limit, vocab, batches, prefill, verifier, verify)
    finally:
        if gate is not None:
            gate.capturing = False


def constraint_set(path: Path, config: ModelConfig) -> ConstraintSet:
    """The worker's structured-output matchers, against the model's tokenizer (loaded on first use)."""
    from deepinfer.grammar import build_tokenizer_info, control_token_ids, tokenizer_fingerprint
    from deepinfer.grammar.llg import build_llg_tokenizer

    controls = control_token_ids(path)
    by_text = {text: i for i, text in controls.items()}
    return ConstraintSet(
        lambda: build_tokenizer_info(path),
        controls,
        config.vocab_size,
        config.eos_token_id,
        by_text.get(THINK_END),
        tokenizer_fingerprint(path),
        llg_tokenizer=lambda: build_llg_tokenizer(path),
    )


def net_quant_sim(net: ServedModel) -> bool:
    return any(getattr(m, "quant_sim", False) for m in net.modules())


def model_fingerprint(
    path: Path,
    dtype: torch.dtype,
    page_size: int,
    quant_sim: bool,
    invariant: bool,
    facts: Sequence[str] = (),
) -> str:
    """What makes two workers' KV state interchangeable: the architecture, the checkpoint (its config and the
    names and sizes of its weight files), the dtype, the page size and the numerics switches: the engine's, then
    the model family's ``facts`` (``ModelFamily.fingerprint_facts``, e.g. ``w8a8``; none: the hash of a model
    without them is unchanged)."""
    h = hashlib.blake2b(digest_size=16)
    raw = (path / "config.json").read_bytes()
    h.update(f"{model_type_of(json.loads(raw))}|".encode())
    h.update(raw)
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    h.update(f"{dtype}|{page_size}|{quant_sim}|{invariant}".encode())
    for fact in facts:
        h.update(f"|{fact}".encode())
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
    num_speculative_tokens: int = 0,
) -> Scheduler:
    return Scheduler(config_from_env(
        page_size, max_model_len, config.eos_token_id, max_num_seqs, max_num_batched_tokens, fingerprint,
        prefix_caching, remote_store, num_speculative_tokens,
    ), PagePool(num_pages))  # fmt: skip
