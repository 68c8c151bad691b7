"""Every NATS subject and JetStream bucket name deepinfer uses, defined once.

Layout (docs/architecture.md, "Events and discovery (NATS)"); every subject starts with ``deepinfer.``::

    deepinfer.load.<kind>.<instance_id>   periodic load reports (queue depth, running, free KV pages, ...)
    deepinfer.kv.<kind>.<instance_id>     KV-cache events: blocks stored / removed (hashes only, batched)
    deepinfer.experts.<replica>           per-expert token counts for EPLB
    KV bucket ``deepinfer_registry``      one key ``<kind>.<instance_id>`` per live service instance

The kind is a subject token of its own wherever a permission depends on it (``events/auth.py``): only a
scheduler may publish ``deepinfer.kv.scheduler.>`` or write ``$KV.deepinfer_registry.scheduler.>``.

Contract: the variable parts (kinds, instance ids, replica ids) are single *tokens*: non-empty, at most
:data:`MAX_TOKEN_LEN` characters from ``[A-Za-z0-9_=-]``. Dots, spaces, wildcards (``*``, ``>``) and
anything a JetStream KV key cannot hold are rejected with ``ValueError`` before anything reaches NATS,
so an id can never widen a subscription or address another instance's key.
"""

from __future__ import annotations

import re
from typing import Final, Literal, get_args

__all__ = [
    "EXPERTS",
    "KINDS",
    "KV",
    "LOAD",
    "PREFIX",
    "REGISTRY_BUCKET",
    "Kind",
    "experts_subject",
    "experts_wildcard",
    "kv_subject",
    "kv_wildcard",
    "load_subject",
    "load_wildcard",
    "parse_load_subject",
    "parse_registry_key",
    "registry_key",
    "validate_kind",
    "validate_token",
]

Kind = Literal["balancer", "scheduler", "worker", "kvstore", "grammar"]
KINDS: Final[tuple[str, ...]] = get_args(Kind)

PREFIX: Final = "deepinfer"
LOAD: Final = f"{PREFIX}.load"
KV: Final = f"{PREFIX}.kv"
EXPERTS: Final = f"{PREFIX}.experts"
REGISTRY_BUCKET: Final = "deepinfer_registry"  # JetStream bucket names may not contain dots

MAX_TOKEN_LEN: Final = 128
_TOKEN_RE = re.compile(r"[A-Za-z0-9_=-]+")


def validate_token(value: str, what: str = "id") -> str:
    """Return ``value`` if it is one valid subject token, else raise ``ValueError`` naming ``what``."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_TOKEN_LEN:
        raise ValueError(f"{what} {value[:32]!r}... is longer than {MAX_TOKEN_LEN} characters")
    if not _TOKEN_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a valid NATS token: use only letters, digits, '_', '-' and '=' "
            "(no dots, spaces or wildcards '*' / '>')"
        )
    return value


def validate_kind(kind: str) -> str:
    """Return ``kind`` if it is one of :data:`KINDS`, else raise ``ValueError``."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    return kind


def load_subject(kind: str, instance_id: str) -> str:
    """``deepinfer.load.<kind>.<instance_id>``: where one instance publishes its load reports."""
    return f"{LOAD}.{validate_kind(kind)}.{validate_token(instance_id, 'instance id')}"


def load_wildcard(kind: str | None = None) -> str:
    """Subscription subject for the load reports of every instance, or of every instance of ``kind``."""
    return f"{LOAD}.>" if kind is None else f"{LOAD}.{validate_kind(kind)}.*"


def parse_load_subject(subject: str) -> tuple[str, str]:
    """The ``(kind, instance_id)`` of a load subject; ``ValueError`` if ``subject`` is not one."""
    parts = subject.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != LOAD:
        raise ValueError(f"{subject!r} is not a load subject ({LOAD}.<kind>.<instance_id>)")
    return validate_kind(parts[2]), validate_token(parts[3], "instance id")


def kv_subject(kind: str, instance_id: str) -> str:
    """``deepinfer.kv.<kind>.<instance_id>``: KV-cache block events (hashes only, batched) of one instance
    (kvstores for their tiers, schedulers for their device caches)."""
    return f"{KV}.{validate_kind(kind)}.{validate_token(instance_id, 'instance id')}"


def kv_wildcard(kind: str | None = None) -> str:
    """Subscription subject for the KV events of every instance, or of every instance of ``kind``."""
    return f"{KV}.>" if kind is None else f"{KV}.{validate_kind(kind)}.*"


def experts_subject(replica: str) -> str:
    """``deepinfer.experts.<replica>``: per-expert token counts of one replica (input to EPLB)."""
    return f"{EXPERTS}.{validate_token(replica, 'replica id')}"


def experts_wildcard() -> str:
    """Subscription subject for the expert-load reports of every replica."""
    return f"{EXPERTS}.*"


def registry_key(kind: str, instance_id: str) -> str:
    """The key ``<kind>.<instance_id>`` of one instance in :data:`REGISTRY_BUCKET`."""
    return f"{validate_kind(kind)}.{validate_token(instance_id, 'instance id')}"


def parse_registry_key(key: str) -> tuple[str, str]:
    """The ``(kind, instance_id)`` of a registry key; ``ValueError`` if ``key`` is not one."""
    kind, sep, instance_id = key.partition(".")
    if not sep:
        raise ValueError(f"{key!r} is not a registry key (<kind>.<instance_id>)")
    return validate_kind(kind), validate_token(instance_id, "instance id")
