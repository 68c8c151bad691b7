"""Traces across balancer → scheduler → worker, exported over OTLP/gRPC to a collector in the test."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from serving.mesh import Mesh, free_port
from serving.test_mesh import collect, gen_request, stub

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as (service name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                self.spans += [(service, s) for ss in rs.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def test_one_request_is_one_trace_across_the_services(tmp_path: Path) -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    model = make_tiny_model(tmp_path / "model", seed=5)
    m = Mesh(model, tmp_path, extra_env={"DEEPINFER_OTEL_ENDPOINT": f"http://127.0.0.1:{port}"})
    try:
        m.up(http=False)

        async def run():
            return await collect(stub(m), gen_request([0, 4, 5, 6], temperature=0.5, top_p=0.9, max_tokens=6))

        _, toks, _ = asyncio.run(run())
        assert len(toks) == 6
    finally:
        m.down()  # SIGTERM: each service flushes its batched spans on the way out
        server.stop(grace=1)
    assert all(p.returncode == 0 for p in m.procs.values()), {n: p.returncode for n, p in m.procs.items()}

    by_service: dict[str, list] = {}
    for service, span in collector.spans:
        by_service.setdefault(service, []).append(span)
    assert set(by_service) == {"deepinfer-balancer", "deepinfer-scheduler", "deepinfer-worker"}

    name = model.name  # the served model name: the model directory's base name
    (root,) = [s for s in by_service["deepinfer-balancer"] if s.name == f"text_completion {name}"]
    a = attrs(root)
    assert root.kind == root.SPAN_KIND_SERVER and not root.parent_span_id
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == name
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (4, 6)
    assert a["gen_ai.response.finish_reasons"] == ["length"]

    phases = {s.name: s for s in by_service["deepinfer-scheduler"] if s.trace_id == root.trace_id}
    assert set(phases) == {"queue", "prefill", "decode"}
    assert all(s.parent_span_id == root.span_id for s in phases.values())
    q, p, d = phases["queue"], phases["prefill"], phases["decode"]
    assert q.start_time_unix_nano <= q.end_time_unix_nano <= p.start_time_unix_nano + 1
    assert p.end_time_unix_nano <= d.start_time_unix_nano + 1 and d.end_time_unix_nano <= root.end_time_unix_nano
    assert attrs(d)["gen_ai.usage.output_tokens"] == 6

    steps = [s for s in by_service["deepinfer-worker"] if s.name == "step"]
    assert len(steps) >= 6 and sum(attrs(s)["deepinfer.step.num_tokens"] for s in steps) >= 4 + 5
    # every step that served the request links to the request's trace (context sent with its first chunk)
    served = [s for s in steps if attrs(s)["deepinfer.step.num_seqs"] > 0]
    assert served and all(any(link.trace_id == root.trace_id for link in s.links) for s in served)

    # and the request's own trace holds its steps: per step that ran its tokens, a "forward" span under its span
    in_trace = {s.span_id: s for _, s in collector.spans if s.trace_id == root.trace_id}
    forwards = [s for s in in_trace.values() if s.name == "forward"]
    assert forwards and all(root.span_id in ancestors(s, in_trace) for s in forwards)
    assert sum(attrs(s)["deepinfer.step.num_tokens"] for s in forwards) >= 4 + 5
    by_step = {attrs(s)["deepinfer.step_id"]: s for s in steps}
    for f in forwards:  # each one links to its batch's step span, and lies within it
        (link,) = f.links
        batch = by_step[attrs(f)["deepinfer.step_id"]]
        assert link.span_id == batch.span_id and attrs(f)["deepinfer.request_id"]
        assert batch.start_time_unix_nano <= f.start_time_unix_nano <= f.end_time_unix_nano <= batch.end_time_unix_nano


def ancestors(span, spans: dict) -> list[bytes]:
    """The span ids above ``span`` within ``spans`` (by span id), nearest first."""
    out = []
    while span.parent_span_id:
        out.append(span.parent_span_id)
        span = spans.get(span.parent_span_id)
        if span is None:
            break
    return out
