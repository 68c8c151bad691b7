"""Structured logging (structlog) and tracing (OpenTelemetry) for every deepinfer service.

::

    from deepinfer import telemetry

    telemetry.configure_logging()  # once at start-up; reads DEEPINFER_LOG_LEVEL / DEEPINFER_LOG_FORMAT
    telemetry.configure_tracing("scheduler")  # exports over OTLP only when an endpoint is configured
    log = telemetry.get_logger(__name__)
    with telemetry.request_context("req-42", model="v4"):
        log.info("admitted", prompt_tokens=17)  # carries request_id, model and, in a span, trace_id/span_id

Standard-library loggers (grpc, urllib3, ...) are routed through the same processors, so every line a
process writes has one format: one JSON object per line by default, or human-readable console lines.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Iterator, Mapping
from contextvars import Token
from typing import Any, TextIO

import structlog
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from structlog.typing import EventDict, Processor

from deepinfer import envs

__all__ = [
    "MissingExtra",
    "add_trace_context",
    "bind_request",
    "configure_logging",
    "configure_tracing",
    "get_logger",
    "request_context",
    "tracing_exported",
]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_OTLP_MODULE = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
_OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
_HANDLER_MARK = "_deepinfer_handler"
_lock = threading.Lock()
_providers: dict[str, TracerProvider] = {}  # by service name; the first one is the global provider
_exported: set[str] = set()  # the services whose provider exports its spans


class MissingExtra(RuntimeError):
    """A setting needs an optional dependency that is not installed; the message names the package and the
    ``pip install 'deepinfer[EXTRA]'`` that brings it. Services print it and exit with status 2."""

    def __init__(self, what: str, package: str, extra: str) -> None:
        self.package, self.extra = package, extra
        super().__init__(f"{what} needs the package {package}, not installed: pip install 'deepinfer[{extra}]'")


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted.

    Resolving the stream late keeps output correct when ``sys.stderr`` is replaced after configuration
    (pytest's capture, redirection in tools).
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        setattr(self, _HANDLER_MARK, True)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.setStream; the stream is always sys.stderr
        pass


def add_trace_context(logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: add the active OpenTelemetry span's ``trace_id`` and ``span_id`` (hex)."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", trace.format_trace_id(ctx.trace_id))
        event_dict.setdefault("span_id", trace.format_span_id(ctx.span_id))
    return event_dict


def _choice(name: str, explicit: str | None) -> str:
    """The value of enum variable ``name``, or ``explicit`` (validated against the same choices)."""
    if explicit is None:
        return envs.get(name)
    var = envs.registry()[name]
    value = explicit.strip().lower()
    if value not in var.choices:
        what = name.removeprefix(envs.PREFIX).lower().replace("_", " ")
        raise ValueError(f"{what} {explicit!r} is not allowed: expected {var.allowed()}")
    return value


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog and the standard-library root logger; safe to call again (reconfigures).

    ``level`` (debug/info/warning/error) and ``fmt`` (json/console) default to ``DEEPINFER_LOG_LEVEL`` and
    ``DEEPINFER_LOG_FORMAT``. Every line carries an ISO-8601 UTC timestamp, the level, the logger name, any
    context bound with :func:`request_context`/:func:`bind_request` and, inside an active span, the
    OpenTelemetry ``trace_id``/``span_id``. Lines go to standard error through a single root handler:
    calling this again replaces that handler instead of adding a second one. Other handlers already on the
    root logger are left alone.
    """
    level_name = _choice("DEEPINFER_LOG_LEVEL", level)
    fmt_name = _choice("DEEPINFER_LOG_FORMAT", fmt)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Processor]
    if fmt_name == "json":
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=_isatty(sys.stderr))]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    with _lock:
        structlog.configure(
            processors=[
                structlog.stdlib.filter_by_level,
                *shared,
                structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
            ],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=False,  # loggers made before (re)configuration follow the new one
        )
        root = logging.getLogger()
        for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
            root.removeHandler(old)
            old.close()
        root.addHandler(handler)
        root.setLevel(_LEVELS[level_name])


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name`` (use ``__name__``); it follows the latest configuration."""
    return structlog.stdlib.get_logger(name)


def bind_request(request_id: str, **kw: Any) -> Mapping[str, Token[Any]]:
    """Bind ``request_id`` (and ``kw``) into the logging context of the current task or thread.

    Every log line emitted afterwards in this context carries them. Returns the tokens to undo the binding
    with ``structlog.contextvars.reset_contextvars(**tokens)``; prefer :func:`request_context`.
    """
    return structlog.contextvars.bind_contextvars(request_id=request_id, **kw)


@contextlib.contextmanager
def request_context(request_id: str, **kw: Any) -> Iterator[None]:
    """Within the block, every log line carries ``request_id`` (and ``kw``); the previous context is
    restored on exit. If a span is recording, it gets the attribute ``deepinfer.request_id``."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("deepinfer.request_id", request_id)
    with structlog.contextvars.bound_contextvars(request_id=request_id, **kw):
        yield


def _otlp_exporter(endpoint: str) -> Any:
    try:
        module = importlib.import_module(_OTLP_MODULE)
    except ImportError as exc:
        raise MissingExtra(
            f"tracing to {endpoint!r} (DEEPINFER_OTEL_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)", _OTLP_PACKAGE, "otlp"
        ) from exc
    return module.OTLPSpanExporter(endpoint=endpoint)


def tracing_exported() -> bool:
    """Whether this process exports spans (an OTLP endpoint is configured); without an exporter spans only
    correlate log lines, and optional detail spans (the worker's per-request step spans) are not worth making."""
    return bool(_exported)


def configure_tracing(service_name: str) -> TracerProvider:
    """An OpenTelemetry SDK tracer provider for ``service_name``; idempotent per service name.

    The provider's resource has ``service.name`` set. If ``DEEPINFER_OTEL_ENDPOINT`` (or, when that is
    unset, ``OTEL_EXPORTER_OTLP_ENDPOINT``) is set, spans are exported over OTLP/gRPC through a
    ``BatchSpanProcessor``; this needs the ``deepinfer[otlp]`` extra and raises :class:`MissingExtra` (a
    ``RuntimeError`` naming the package and the extra) without it. Otherwise no exporter is installed: spans
    still get ids (and so correlate log lines) but go nowhere.

    The first provider made in a process becomes the global one (``opentelemetry.trace``). Calling again
    with the same name returns the same provider, with no processor added twice. A different name (several
    services in one test process) gets its own provider, which is not made global: use
    ``provider.get_tracer(...)`` with it.
    """
    with _lock:
        if service_name in _providers:
            return _providers[service_name]
        endpoint = envs.get("DEEPINFER_OTEL_ENDPOINT")
        exporter = _otlp_exporter(endpoint) if endpoint else None
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
            _exported.add(service_name)
        first = not _providers
        _providers[service_name] = provider
    if first:
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is not provider:
            logging.getLogger(__name__).warning(
                "another OpenTelemetry tracer provider is already global; spans of service %r are only "
                "recorded through tracers from the provider that configure_tracing returned",
                service_name,
            )
    else:
        logging.getLogger(__name__).warning(
            "tracing is already configured for service %r; the provider for %r is not made global",
            next(iter(_providers)),
            service_name,
        )
    return provider
