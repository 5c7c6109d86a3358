"""The mesh's span recorder records what the OpenTelemetry SDK records: the same
OTLP messages for the same calls, the same sampling decisions, batches sent on
time and on shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from shared.otlp_export import SpanEncoder
from shared.span_recorder import SpanRecorder

REMOTE = SpanContext(
    0x4BF92F3577B34DA6A3CE929D0E0E4736,
    0x00F067AA0BA902B7,
    is_remote=True,
    trace_flags=TraceFlags(1),
    trace_state=TraceState([("vendor", "x1")]),
)


class Batches(SpanExporter):
    """Keeps each exported batch as the OTLP message the mesh sends."""

    def __init__(self) -> None:
        self.batches: list[ExportTraceServiceRequest] = []
        self.sizes: list[int] = []
        self.shut = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(spans))
        self.batches.append(ExportTraceServiceRequest.FromString(SpanEncoder().encode(spans)))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut.set()


def _record(provider: trace.TracerProvider) -> None:
    """A server span continuing a remote trace, a step span in it that fails, and a
    new trace: every field the mesh's spans use."""
    server = provider.get_tracer("meshserve.server", "1.2")
    root = server.start_span(
        "inference.GRPCInferenceService/ModelInfer",
        context=trace.set_span_in_context(trace.NonRecordingSpan(REMOTE)),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "meshserve.queue_us": 1234, "neg": -5},
    )
    root.set_attribute("ratio", 0.25)
    root.set_attribute("ok", True)
    root.set_attribute("shape", [1, 3, 224, 224])
    root.add_event("first token", {"tokens": 1, "text": "héllo"})
    root.set_status(Status(StatusCode.ERROR, "model 'x' is not ready"))
    steps = provider.get_tracer("meshserve.orchestrator")
    with (
        pytest.raises(ValueError),
        trace.use_span(root),
        steps.start_as_current_span(
            "ensemble step 0 minilm",
            kind=SpanKind.CLIENT,
            attributes={"meshserve.step": 0},
            links=[Link(REMOTE, {"why": "retry"})],
        ),
    ):
        raise ValueError("input 'X' is missing")
    root.end()
    root.set_attribute("late", 1)  # after the end: not recorded
    provider.get_tracer("other").start_span("bare").end()


def _normalised(message: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """Ids numbered in order of appearance, times zeroed, stack traces blanked:
    what differs between two recordings of the same calls."""
    ids: dict[bytes, bytes] = {REMOTE.span_id.to_bytes(8, "big"): b"remote"}
    out = ExportTraceServiceRequest()
    out.CopyFrom(message)
    for resource_spans in out.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            scope_spans.spans.sort(key=lambda s: s.name)
            for span in scope_spans.spans:
                for field in ("span_id", "parent_span_id"):
                    value = getattr(span, field)
                    if value:
                        setattr(span, field, ids.setdefault(value, str(len(ids)).encode()))
                if span.trace_id != REMOTE.trace_id.to_bytes(16, "big"):
                    span.trace_id = b"new"
                span.start_time_unix_nano = span.end_time_unix_nano = 0
                for event in span.events:
                    event.time_unix_nano = 0
                    for pair in event.attributes:
                        if pair.key == "exception.stacktrace":
                            pair.value.string_value = "..."
    return out


def test_the_spans_recorded_are_the_messages_the_sdk_records() -> None:
    sdk_spans = InMemorySpanExporter()
    sdk = TracerProvider(resource=Resource.create({"service.name": "orchestrator"}))
    sdk.add_span_processor(SimpleSpanProcessor(sdk_spans))
    _record(sdk)
    expected = encode_spans(sdk_spans.get_finished_spans())

    exporter = Batches()
    recorder = SpanRecorder(Resource.create({"service.name": "orchestrator"}), exporter)
    _record(recorder)
    recorder.shutdown()
    assert exporter.shut.is_set()
    (ours,) = exporter.batches
    assert _normalised(ours) == _normalised(expected)
    spans = [s for r in ours.resource_spans for g in r.scope_spans for s in g.spans]
    assert len(spans) == 3


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_sampling_decides_as_the_sdk_does(ratio: float) -> None:
    recorder = SpanRecorder(Resource.create({}), Batches(), sample_ratio=ratio)
    tracer = recorder.get_tracer("test")
    sdk_sampler = TraceIdRatioBased(ratio)
    for _ in range(200):
        root = tracer.start_span("root")
        context = root.get_span_context()
        decided = sdk_sampler.should_sample(None, context.trace_id, "root").decision
        assert root.is_recording() == decided.is_sampled()
        assert context.trace_flags.sampled == root.is_recording()
    for flags in (0, 1):
        caller = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(flags))
        child = tracer.start_span(
            "child", trace.set_span_in_context(trace.NonRecordingSpan(caller))
        )
        # The caller's decision whatever the ratio; its trace, a span id of its own.
        assert child.is_recording() == bool(flags)
        assert child.get_span_context().trace_id == 1
        assert child.get_span_context().span_id not in (0, 2)
    recorder.shutdown()


def test_spans_go_out_in_batches_on_time_and_on_shutdown() -> None:
    exporter = Batches()
    recorder = SpanRecorder(Resource.create({}), exporter, delay_s=0.05, max_batch=4)
    tracer = recorder.get_tracer("test")
    for index in range(10):
        span = tracer.start_span(f"span {index}")
        span.set_attribute("dropped", {"a mapping": "is no attribute value"})  # type: ignore[arg-type]
        span.end()
    deadline = time.monotonic() + 5
    while sum(exporter.sizes) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(exporter.sizes) == 10 and max(exporter.sizes) <= 4
    spans = [
        s
        for b in exporter.batches
        for r in b.resource_spans
        for g in r.scope_spans
        for s in g.spans
    ]
    assert all(not s.attributes for s in spans)
    tracer.start_span("last").end()
    recorder.shutdown()
    assert sum(exporter.sizes) == 11
