"""Tests for deepinfer.telemetry: structured logging and OpenTelemetry tracing.

Anything that configures process-global state (structlog, the root logger, the global tracer provider)
runs in a subprocess so the rest of the test session is unaffected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deepinfer import envs, telemetry

REPO = Path(__file__).resolve().parents[2]
OTLP_MODULE = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


def run_python(code: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "libs"), os.environ.get("PYTHONPATH")]))
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in list(os.environ):
        if name.startswith("DEEPINFER_") or name == "OTEL_EXPORTER_OTLP_ENDPOINT":
            monkeypatch.delenv(name)
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()


LOGGING_SCRIPT = """
    import json, logging
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from deepinfer import telemetry

    telemetry.configure_logging()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = telemetry.get_logger("test.logger")
    log.info("before")
    with telemetry.request_context("req-1", user="alice"):
        log.info("in-request", n=1)
        with provider.get_tracer("test").start_as_current_span("handle"):
            log.info("in-span", n=2)
            logging.getLogger("some.library").warning("stdlib %s line", "formatted")
            log.debug("hidden at info")
            with telemetry.request_context("req-2"):
                log.info("nested")
        log.info("after-span")
    log.info("after-request")
    spans = [
        {"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
         "span_id": format(s.context.span_id, "016x"), "attributes": dict(s.attributes)}
        for s in exporter.get_finished_spans()
    ]
    print(json.dumps(spans))
"""


def test_json_lines_carry_request_id_and_trace_ids():
    out = run_python(LOGGING_SCRIPT)
    spans = json.loads(out.stdout)
    assert [s["name"] for s in spans] == ["handle"], "the span must actually be recorded"
    span = spans[0]
    # request_context entered while a span records tags that span (here the nested "req-2" context)
    assert span["attributes"] == {"deepinfer.request_id": "req-2"}
    lines = {line["event"]: line for line in json_lines(out.stderr)}
    assert set(lines) == {
        "before",
        "in-request",
        "in-span",
        "stdlib formatted line",
        "nested",
        "after-span",
        "after-request",
    }
    for line in lines.values():
        assert line["level"] in {"info", "warning"}
        assert datetime.fromisoformat(line["timestamp"]).utcoffset().total_seconds() == 0
    for event in ("before", "after-request"):
        assert not {"request_id", "trace_id", "span_id", "user"} & set(lines[event])
    for event in ("in-request", "after-span"):
        assert lines[event]["request_id"] == "req-1" and lines[event]["user"] == "alice"
        assert "trace_id" not in lines[event]
    for event in ("in-span", "stdlib formatted line", "nested"):
        assert lines[event]["trace_id"] == span["trace_id"]
        assert lines[event]["span_id"] == span["span_id"]
    assert lines["in-span"]["request_id"] == "req-1" and lines["in-span"]["n"] == 2
    assert lines["in-span"]["logger"] == "test.logger"
    assert lines["stdlib formatted line"]["request_id"] == "req-1"
    assert lines["stdlib formatted line"]["logger"] == "some.library"
    assert lines["stdlib formatted line"]["level"] == "warning"
    assert lines["nested"]["request_id"] == "req-2" and lines["nested"]["user"] == "alice"


def test_configure_logging_is_idempotent():
    out = run_python(
        """
        import logging
        from deepinfer import telemetry
        telemetry.configure_logging()
        telemetry.configure_logging(level="info", fmt="json")
        print(len(logging.getLogger().handlers))
        telemetry.get_logger("x").info("once")
        logging.getLogger("lib").info("also once")
        """
    )
    assert out.stdout.strip() == "1"
    assert [line["event"] for line in json_lines(out.stderr)] == ["once", "also once"]


def test_level_and_console_format_from_the_environment():
    out = run_python(
        """
        import logging
        from deepinfer import telemetry
        telemetry.configure_logging()
        log = telemetry.get_logger("x")
        with telemetry.request_context("req-9"):
            log.info("quiet")
            log.warning("loud", k=3)
            logging.getLogger("lib").error("library error")
        """,
        DEEPINFER_LOG_LEVEL="WARNING",
        DEEPINFER_LOG_FORMAT="console",
    )
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, out.stderr
    assert "loud" in lines[0] and "request_id=req-9" in lines[0] and "k=3" in lines[0]
    assert "library error" in lines[1] and "request_id=req-9" in lines[1]
    assert "quiet" not in out.stderr
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0])


def test_exceptions_are_rendered_into_the_json_line():
    out = run_python(
        """
        from deepinfer import telemetry
        telemetry.configure_logging()
        try:
            1 / 0
        except ZeroDivisionError:
            telemetry.get_logger("x").exception("failed")
        """
    )
    (line,) = json_lines(out.stderr)
    assert line["event"] == "failed" and line["level"] == "error"
    assert "ZeroDivisionError" in line["exception"]


def test_bad_logging_settings_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="'verbose' is not allowed: expected one of debug, info"):
        telemetry.configure_logging(level="verbose")
    with pytest.raises(ValueError, match="'xml'"):
        telemetry.configure_logging(fmt="xml")
    monkeypatch.setenv("DEEPINFER_LOG_FORMAT", "xml")
    with pytest.raises(envs.EnvError, match="DEEPINFER_LOG_FORMAT='xml'"):
        telemetry.configure_logging()


def test_request_context_binds_and_restores():
    assert structlog.contextvars.get_contextvars() == {}
    with telemetry.request_context("r1", tenant="t"):
        assert structlog.contextvars.get_contextvars() == {"request_id": "r1", "tenant": "t"}
        with telemetry.request_context("r2"):
            assert structlog.contextvars.get_contextvars() == {"request_id": "r2", "tenant": "t"}
        assert structlog.contextvars.get_contextvars() == {"request_id": "r1", "tenant": "t"}
    assert structlog.contextvars.get_contextvars() == {}
    tokens = telemetry.bind_request("r3", stage="prefill")
    assert structlog.contextvars.get_contextvars() == {"request_id": "r3", "stage": "prefill"}
    structlog.contextvars.reset_contextvars(**tokens)
    assert structlog.contextvars.get_contextvars() == {}


def test_trace_processor_uses_the_active_span():
    assert telemetry.add_trace_context(None, "info", {"event": "x"}) == {"event": "x"}
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("outer") as span:
        ctx = span.get_span_context()
        event = telemetry.add_trace_context(None, "info", {"event": "x"})
    assert event["trace_id"] == f"{ctx.trace_id:032x}" and event["span_id"] == f"{ctx.span_id:016x}"
    (finished,) = exporter.get_finished_spans()
    assert finished.context.trace_id == ctx.trace_id and finished.context.span_id == ctx.span_id


TRACING_SCRIPT = """
    import json, sys, types
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class FakeOTLP(SpanExporter):
        instances = []
        def __init__(self, endpoint=None):
            self.endpoint, self.spans = endpoint, []
            FakeOTLP.instances.append(self)
        def export(self, spans):
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS
        def shutdown(self):
            pass

    if sys.argv[1] == "fake":
        module = types.ModuleType(sys.argv[2])
        module.OTLPSpanExporter = FakeOTLP
        sys.modules[module.__name__] = module
    from deepinfer import telemetry
    a = telemetry.configure_tracing("svc-a")
    again = telemetry.configure_tracing("svc-a")
    b = telemetry.configure_tracing("svc-b")
    with trace.get_tracer("t").start_as_current_span("work"):
        pass
    a.force_flush()
    print(json.dumps({
        "same": a is again, "a_global": trace.get_tracer_provider() is a, "b_distinct": b is not a,
        "services": [p.resource.attributes["service.name"] for p in (a, b)],
        "processors": [type(p).__name__ for p in a._active_span_processor._span_processors],
        "endpoints": [f.endpoint for f in FakeOTLP.instances],
        "exported": [s.name for s in FakeOTLP.instances[0].spans] if FakeOTLP.instances else [],
    }))
"""


def _tracing(mode: str, **env: str) -> dict:
    return json.loads(run_python(TRACING_SCRIPT, mode, OTLP_MODULE, **env).stdout)


def test_configure_tracing_without_endpoint_adds_no_exporter():
    result = _tracing("fake")
    assert result["processors"] == [] and result["endpoints"] == []
    assert result["same"] and result["a_global"] and result["b_distinct"]
    assert result["services"] == ["svc-a", "svc-b"]


def test_configure_tracing_exports_to_the_configured_endpoint():
    result = _tracing("fake", DEEPINFER_OTEL_ENDPOINT="http://collector:4317")
    assert result["processors"] == ["BatchSpanProcessor"], "configured twice, yet exactly one processor"
    assert result["endpoints"] == ["http://collector:4317"] * 2  # svc-a and svc-b
    assert result["exported"] == ["work"] and result["same"] and result["a_global"]


def test_configure_tracing_falls_back_to_the_standard_endpoint_variable():
    result = _tracing("fake", OTEL_EXPORTER_OTLP_ENDPOINT="http://standard:4317")
    assert result["endpoints"] == ["http://standard:4317"] * 2


def test_configure_tracing_without_the_otlp_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, OTLP_MODULE, None)  # importing it now raises ImportError
    monkeypatch.setenv("DEEPINFER_OTEL_ENDPOINT", "http://collector:4317")
    with pytest.raises(RuntimeError, match=r"deepinfer\[otlp\]"):
        telemetry.configure_tracing("svc-without-otlp-package")
