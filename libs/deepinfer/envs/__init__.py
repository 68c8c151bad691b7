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
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.envs import engine_settings, service_settings  # noqa: F401 - the declarations, in this order
from deepinfer.envs.registry import (
    _REGISTRY,
    PREFIX,
    EnvError,
    EnvVar,
    UnknownEnvWarning,
    get,
    is_set,
    override,
    parse,
    registry,
    render_markdown,
    snapshot,
    to_env_text,
    validate_all,
)

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
    DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT: int
    DEEPINFER_USE_NEXTN_DECODE: int
    DEEPINFER_ENABLE_MTP_VARLEN: bool
    DEEPINFER_SPEC_DECODE_MIN_SURVIVAL: float
    DEEPINFER_SPEC_DECODE_MAX_BATCH: int
    DEEPINFER_SPEC_DECODE_EXPLORE_STEPS: int
    DEEPINFER_SPEC_EARLY_DRAFTS: bool
    DEEPINFER_PREFIX_CACHE_RESUME_POINTS: int
    DEEPINFER_RESUME_INTERVAL: int
    DEEPINFER_COMPACT_REPLAY_TOKENS: int
    DEEPINFER_DECODER_REPLAY_TOKENS: int
    DEEPINFER_BATCH_INVARIANT: bool
    DEEPINFER_CUDA_GRAPHS: bool
    DEEPINFER_CUDA_GRAPH_MAX_BATCH: int
    DEEPINFER_PREFILL_GRAPHS: bool
    DEEPINFER_PREFILL_GRAPH_MAX_TOKENS: int
    DEEPINFER_WARMUP: bool
    DEEPINFER_PINNED_POOL_BYTES: int
    DEEPINFER_GC_FREEZE: bool
    DEEPINFER_IMAGE_FEATURE_CACHE_BYTES: int
    DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES: int
    DEEPINFER_STREAM_OVERLAP: bool
    DEEPINFER_PDL: bool
    DEEPINFER_NATIVE_WEIGHTS: bool
    DEEPINFER_MOE_PREFILL: str
    DEEPINFER_ATTN_PREFILL: str
    DEEPINFER_QUANT_SIM: bool
    DEEPINFER_W8A8: bool
    DEEPINFER_W4A8: bool
    DEEPINFER_ENGRAM_TABLES: str
    DEEPINFER_EP: int
    DEEPINFER_TP: int
    DEEPINFER_CP: int
    DEEPINFER_EPLB_INTERVAL_STEPS: int
    DEEPINFER_EPLB_EXTRA_SLOTS: int
    DEEPINFER_EXPERT_LOAD_REPORT_PERIOD_S: float
    DEEPINFER_EP_FIXED_BUFFER_TOKENS: int
    DEEPINFER_RANK_TIMEOUT_S: float
    DEEPINFER_TORCH_THREADS: int | None
    DEEPINFER_LOG_LEVEL: str
    DEEPINFER_LOG_FORMAT: str
    DEEPINFER_TORCH_PROFILER_DIR: Path | None
    DEEPINFER_PROFILE_SKIP_STEPS: int
    DEEPINFER_PROFILE_STEPS: int
    DEEPINFER_OTEL_ENDPOINT: str | None
    DEEPINFER_NATS_URL: str | None
    DEEPINFER_PRESENCE_TTL_S: int
    DEEPINFER_KVSTORE_URL: str | None
    DEEPINFER_KVSTORE_HOST_BYTES: int
    DEEPINFER_KVSTORE_DIR: Path | None
    DEEPINFER_KVSTORE_DISK_BYTES: int
    DEEPINFER_KVSTORE_RETENTION_S: int
    DEEPINFER_KVSTORE_MAX_BLOB_BYTES: int
    DEEPINFER_KVSTORE_SHARED_DIR: str
    DEEPINFER_GRAMMAR_URL: str | None
    DEEPINFER_UP_GRAMMAR: bool
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
    DEEPINFER_GRAMMAR_JSON_INDENT: int
    DEEPINFER_GRAMMAR_BACKEND: str
    DEEPINFER_GRPC_KEEPALIVE_S: float
    DEEPINFER_SWITCH_INTERVAL_S: float
    DEEPINFER_WORKER_UNIX_SOCKET: Path | None
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
    DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH: Path | None
    DEEPINFER_MAX_TEMPERATURE: float
    DEEPINFER_DEFAULT_MAX_TOKENS: int
    DEEPINFER_MIGRATION_LIMIT: int
    DEEPINFER_MIGRATION_WAIT_S: float
    DEEPINFER_REBALANCE_INTERVAL_S: float
    DEEPINFER_REBALANCE_MIN_GAP: int
    DEEPINFER_REPLICA_PROBE_S: float
    DEEPINFER_REPLICA_SESSIONS: bool
    DEEPINFER_ROUTER_LOAD_TOKENS: int
    DEEPINFER_ROUTER_POLICY: str
    DEEPINFER_RESTART_MAX_BACKOFF_S: float


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_REGISTRY])


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
        print(f"{name}={'' if value is None else to_env_text(value)}")
    return 0


__all__ = [
    "PREFIX",
    "EnvError",
    "EnvVar",
    "UnknownEnvWarning",
    "get",
    "is_set",
    "main",
    "override",
    "parse",
    "registry",
    "render_markdown",
    "snapshot",
    "validate_all",
]
