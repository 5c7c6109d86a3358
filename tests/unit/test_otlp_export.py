"""The mesh's OTLP encoder writes the same messages as the OpenTelemetry SDK's."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from shared.otlp_export import SpanEncoder


def _spans() -> list[ReadableSpan]:
    """Spans of two services and two scopes with every kind of field set."""
    exporter = InMemorySpanExporter()
    for service in ("orchestrator", "inference"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        remote = SpanContext(
            0x4BF92F3577B34DA6A3CE929D0E0E4736,
            0x00F067AA0BA902B7,
            is_remote=True,
            trace_flags=TraceFlags(1),
            trace_state=TraceState([("vendor", "x1")]),
        )
        server = provider.get_tracer("meshserve.server", "1.2")
        root = server.start_span(
            "inference.GRPCInferenceService/ModelInfer",
            context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "meshserve.queue_us": 1234, "neg": -5},
        )
        root.set_attribute("ratio", 0.25)
        root.set_attribute("ok", True)
        root.set_attribute("shape", [1, 3, 224, 224])
        root.set_attribute("names", ["a", "b"])
        root.add_event("first token", {"tokens": 1, "text": "héllo"})
        root.set_status(Status(StatusCode.ERROR, "model 'x' is not ready"))
        child = provider.get_tracer("meshserve.orchestrator").start_span(
            "ensemble step 0 minilm",
            context=trace.set_span_in_context(root),
            kind=SpanKind.CLIENT,
            links=[Link(remote, {"why": "retry"})],
        )
        child.end()
        root.end()
        provider.get_tracer("other").start_span("bare").end()
    return list(exporter.get_finished_spans())


def test_the_bytes_decode_to_the_sdk_encoders_message() -> None:
    spans = _spans()
    ours = ExportTraceServiceRequest.FromString(SpanEncoder().encode(spans))
    assert ours == encode_spans(spans)
    assert sum(len(s.spans) for r in ours.resource_spans for s in r.scope_spans) == 6


def test_cached_attributes_encode_the_same_on_every_batch() -> None:
    encoder = SpanEncoder()
    spans = _spans()
    first = encoder.encode(spans)
    assert encoder.encode(spans) == first
    assert ExportTraceServiceRequest.FromString(first) == encode_spans(spans)
