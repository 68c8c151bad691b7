"""Who may do what on NATS: one user per service kind, with the subjects each kind may publish and subscribe to.

**Credentials.** A service finds its user and password in its URL: ``DEEPINFER_NATS_URL=nats://scheduler:<password>
@host:4222`` (nats-py reads them from the URL, on every reconnect too). The NATS server deepinfer starts
(:class:`~deepinfer.events.server.NatsServer`) generates a random password per kind (:class:`Credentials`) and an
``admin`` user with every right, for the process that owns the server (the launcher, tests, tools);
``NatsServer.url_for(kind)`` is the URL to hand to a service of that kind and ``deepinfer up`` passes each service
its own. Clients without valid credentials are refused. An external NATS server gets the same protection from the
``authorization`` block :func:`authorization_config` writes (its users, with passwords of the operator's choosing).
URLs are logged with the password masked (:func:`redact`).

**Permissions** (:func:`permissions`; everything not listed is denied):

================  =====================================================  ==================================
kind              publish                                                subscribe
================  =====================================================  ==================================
every kind        ``$KV.deepinfer_registry.<kind>.>`` (its own           ``_INBOX.<kind>.>`` (its replies:
                  registry keys), ``$JS.API.STREAM.INFO.KV_deepinfer_    each connection's inbox prefix is
                  registry``, ``deepinfer.load.<kind>.>``                ``_INBOX.<user>``, see :func:`inbox_prefix`)
balancer          consumer create / delete / info on the registry        ``deepinfer.load.>``,
                  stream, its flow control (``$JS.FC.KV_deepinfer_       ``deepinfer.experts.*``,
                  registry.>``): watching the registry                   ``deepinfer.kv.scheduler.>``
scheduler         ``deepinfer.kv.scheduler.>``, ``deepinfer.experts.*``  ``deepinfer.kv.>``,
                                                                         ``deepinfer.experts.*``
kvstore           ``deepinfer.kv.kvstore.>``
worker            ``deepinfer.experts.*``
================  =====================================================  ==================================

So only schedulers can write scheduler registry keys (a fake scheduler needs the scheduler password), only the
kvstore publishes kvstore KV events and only schedulers read them (a balancer reads the schedulers' device-tier
ones, to route by cache). What remains broad: the JetStream API is limited to the registry stream (stream info
for all; consumer create/delete/info for balancers), but a balancer may create any consumer on it (e.g. a
durable one, or one delivering elsewhere) and anyone may publish a
``Nats-Rollup`` header on its own key subject, which can purge the bucket (instances re-register within a third
of their TTL): registration is authenticated, not tamper-proof between services. ``deepinfer.experts.*`` carries
no kind token, so any worker or scheduler may publish for any replica. The registry bucket itself is created by
the server's owner (``NatsServer.start``); services are not allowed to create or delete streams.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from deepinfer.events import subjects

__all__ = [
    "ADMIN",
    "Credentials",
    "authorization_config",
    "inbox_prefix",
    "permissions",
    "redact",
    "url_user",
    "with_credentials",
]

ADMIN = "admin"
_STREAM = f"KV_{subjects.REGISTRY_BUCKET}"
_API = "$JS.API"


def permissions(kind: str) -> dict[str, dict[str, list[str]]]:
    """The publish / subscribe allow lists of one service kind (see the module docstring)."""
    subjects.validate_kind(kind)
    pub = [f"$KV.{subjects.REGISTRY_BUCKET}.{kind}.>", f"{_API}.STREAM.INFO.{_STREAM}", f"{subjects.LOAD}.{kind}.>"]
    sub = [f"_INBOX.{kind}.>"]
    if kind == "balancer":  # RegistryView: an ordered consumer per watch
        consumer = f"{_API}.CONSUMER"
        pub += [f"{consumer}.CREATE.{_STREAM}", f"{consumer}.CREATE.{_STREAM}.>", f"{consumer}.DELETE.{_STREAM}.>",
                f"{consumer}.INFO.{_STREAM}.>", f"$JS.FC.{_STREAM}.>"]  # fmt: skip
        sub += [f"{subjects.LOAD}.>", f"{subjects.KV}.scheduler.>"]  # loads; the replicas' resume points (routing)
    if kind in ("scheduler", "kvstore"):  # KV events: kvstore tiers, a scheduler's device cache
        pub.append(f"{subjects.KV}.{kind}.>")
    if kind == "scheduler":
        sub.append(f"{subjects.KV}.>")
    if kind in ("scheduler", "worker"):
        pub.append(subjects.experts_wildcard())
    if kind in ("balancer", "scheduler"):
        sub.append(subjects.experts_wildcard())
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub}}


@dataclass(frozen=True)
class Credentials:
    """A password per service kind and for :data:`ADMIN` (random unless given)."""

    passwords: dict[str, str] = field(
        default_factory=lambda: {user: secrets.token_urlsafe(24) for user in (*subjects.KINDS, ADMIN)}
    )


def authorization_config(creds: Credentials) -> dict[str, Any]:
    """The ``authorization`` block of a nats-server configuration (JSON is valid nats-server config)."""
    users: list[dict[str, Any]] = []
    for user, password in creds.passwords.items():
        entry: dict[str, Any] = {"user": user, "password": password}
        if user != ADMIN:
            entry["permissions"] = permissions(user)
        users.append(entry)
    return {"authorization": {"users": users}}


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password@`` (percent-encoded) in front of its host."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def url_user(url: str) -> str | None:
    """The user named in ``url``, if any."""
    try:
        user = urlsplit(url).username
    except ValueError:
        return None
    return unquote(user) if user else None


def redact(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***`` (for log lines and printed endpoints)."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparsable url>"
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rpartition('@')[2]}"))


def inbox_prefix(url: str) -> str | None:
    """``_INBOX.<user>`` for a URL naming a user that is a valid subject token (its replies then only reach
    connections of the same user), else ``None`` (nats-py's default ``_INBOX``)."""
    user = url_user(url)
    if user is None:
        return None
    try:
        return f"_INBOX.{subjects.validate_token(user, 'user')}"
    except ValueError:
        return None
