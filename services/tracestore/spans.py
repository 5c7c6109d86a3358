"""OTLP trace export requests as plain span records (no gRPC, no HTTP here).

Both receivers (OTLP/gRPC and OTLP/HTTP protobuf) hand the decoded
``ExportTraceServiceRequest`` here; the store keeps what comes out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

MODEL_ATTRIBUTES = ("meshserve.model", "gen_ai.request.model")
"""Span attributes that name the model a span served, in order of preference."""
STATUS_ERROR = 2
"""OTLP ``Status.code`` of a failed span."""


@dataclass(frozen=True)
class SpanRecord:
    """One span as the store keeps it: ids in lowercase hex, times in microseconds."""

    trace_id: str
    span_id: str
    parent_id: str
    service: str
    name: str
    kind: int
    """OTLP ``SpanKind``: 1 internal, 2 server, 3 client, 4 producer, 5 consumer."""
    start_us: int
    duration_us: int
    error: bool
    status_message: str
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    resource: dict[str, Any]
    scope: str

    @property
    def model(self) -> str | None:
        """The model this span served, where an attribute says so."""
        for key in MODEL_ATTRIBUTES:
            value = self.attributes.get(key)
            if isinstance(value, str) and value:
                return value
        return None


def value_of(value: AnyValue) -> Any:
    """A protobuf ``AnyValue`` as a plain Python value."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value_of(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


_SCALARS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def attributes_of(pairs: Any) -> dict[str, Any]:
    """Repeated ``KeyValue`` as a dict."""
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        value = pair.value
        which = value.WhichOneof("value")
        # Nearly every attribute is a scalar: read it here, without a call per value.
        found[pair.key] = getattr(value, which) if which in _SCALARS else value_of(value)
    return found


def records(request: ExportTraceServiceRequest) -> Iterator[SpanRecord]:
    """Every span of an export request, with its resource's service name."""
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        service = str(resource.get("service.name") or "unknown_service")
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                trace_id, span_id = span.trace_id, span.span_id
                if len(trace_id) != 16 or len(span_id) != 8:
                    continue  # not a valid span: nothing could find it again
                start_us = span.start_time_unix_nano // 1000
                status = span.status
                yield SpanRecord(
                    trace_id=trace_id.hex(),
                    span_id=span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    service=service,
                    name=span.name,
                    kind=span.kind,
                    start_us=start_us,
                    duration_us=max(0, span.end_time_unix_nano // 1000 - start_us),
                    error=status.code == STATUS_ERROR,
                    status_message=status.message,
                    attributes=attributes_of(span.attributes),
                    events=_events(span.events) if span.events else [],
                    resource=resource,
                    scope=scope,
                )


def _events(events: Any) -> list[dict[str, Any]]:
    return [
        {
            "time_us": event.time_unix_nano // 1000,
            "name": event.name,
            "attributes": attributes_of(event.attributes),
        }
        for event in events
    ]
