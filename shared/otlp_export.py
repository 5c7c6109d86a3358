"""OTLP/gRPC span export with the protobuf wire format written directly.

The OpenTelemetry SDK's OTLP exporter builds a protobuf object per span, per
attribute and per value before serializing the batch: in a CPU-bound mesh
that costs more than recording the span did. Here each span is written
straight to the bytes of an OTLP ``Span`` message, the attributes that repeat
on every span of a service (``rpc.service``, ``rpc.method``, the model name)
from a cache of their encoded form, and the batch goes out as one
``ExportTraceServiceRequest`` over a plain gRPC call. The bytes are the same
message the SDK's encoder builds (tests/unit/test_otlp_export.py compares them),
so any OTLP collector (the mesh's trace store, an OpenTelemetry Collector,
Jaeger, Tempo, Phoenix) reads them as it reads any exporter's.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext

log = logging.getLogger(__name__)

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
EXPORT_TIMEOUT_S = 10.0
_CACHE_LIMIT = 4096
"""Encoded attributes kept for reuse; beyond this the cache starts afresh."""
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_FIXED32 = struct.Struct("<I")


def _varint_slow(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes it: two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT = [_varint_slow(n) for n in range(1 << 14)]
"""Varints of lengths and counts below 16384 (most of them), ready made."""


def _varint(value: int) -> bytes:
    return _SHORT[value] if 0 <= value < 16384 else _varint_slow(value)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` already holds the wire type)."""
    return _TAGS[tag] + _varint(len(payload)) + payload


_TAGS = [bytes((tag,)) for tag in range(128)]


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message."""
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _any_value(item)) for item in value))
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message."""
    return _field(0x0A, key.encode()) + _field(0x12, _any_value(value))


class SpanEncoder:
    """Spans to the bytes of an ``ExportTraceServiceRequest``."""

    def __init__(self) -> None:
        self._attributes: dict[tuple[int, str, type, Any], bytes] = {}
        self._names: dict[str, bytes] = {}
        self._groups: dict[tuple[int, int], tuple[Any, Any, bytes, bytes]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """One request holding ``spans``, grouped by resource and scope."""
        # By identity: a Resource hashes by serializing its attributes to JSON,
        # and a provider's spans all share one Resource object.
        grouped: dict[int, dict[int, list[bytes]]] = {}
        groups: dict[int, Resource] = {}
        scopes: dict[int, InstrumentationScope | None] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope
            groups[id(resource)] = resource
            scopes[id(scope)] = scope
            by_scope = grouped.setdefault(id(resource), {})
            by_scope.setdefault(id(scope), []).append(self.span(span))
        out = []
        for resource_id, by_scope in grouped.items():
            resource = groups[resource_id]
            parts = []
            for scope_id, encoded in by_scope.items():
                resource_bytes, scope_bytes = self._group(resource, scopes[scope_id])
                parts.append(_field(0x12, scope_bytes + b"".join(_field(0x12, s) for s in encoded)))
            body = resource_bytes + b"".join(parts)
            if resource.schema_url:
                body += _field(0x1A, resource.schema_url.encode())
            out.append(_field(0x0A, body))
        return b"".join(out)

    def _group(self, resource: Resource, scope: InstrumentationScope | None) -> tuple[bytes, bytes]:
        """The encoded resource field and scope field of ``ScopeSpans`` (cached)."""
        key = (id(resource), id(scope))
        found = self._groups.get(key)
        if found is not None and found[0] is resource and found[1] is scope:
            return found[2], found[3]
        attributes = b"".join(
            _field(0x0A, _key_value(k, v)) for k, v in resource.attributes.items()
        )
        scope_bytes = b""
        if scope is not None:
            inner = _field(0x0A, scope.name.encode()) if scope.name else b""
            if scope.version:
                inner += _field(0x12, scope.version.encode())
            inner += b"".join(
                _field(0x1A, _key_value(k, v)) for k, v in (scope.attributes or {}).items()
            )
            scope_bytes = _field(0x0A, inner)
            if scope.schema_url:
                scope_bytes += _field(0x1A, scope.schema_url.encode())
        if len(self._groups) >= _CACHE_LIMIT:
            self._groups.clear()
        # Kept with their bytes, so neither id can be reused meanwhile.
        resource_bytes = _field(0x0A, attributes)
        self._groups[key] = (resource, scope, resource_bytes, scope_bytes)
        return resource_bytes, scope_bytes

    def span(self, span: ReadableSpan) -> bytes:
        """One ``Span`` message."""
        context = span.get_span_context()
        assert context is not None
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        ]
        if context.trace_state:
            state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
            parts.append(_field(0x1A, state.encode()))
        parent = span.parent
        if parent is not None:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        parts.append(self._name(span.name))
        parts.append(b"\x30" + bytes((span.kind.value + 1,)))
        parts.append(b"\x39" + _FIXED64.pack(span.start_time or 0))
        parts.append(b"\x41" + _FIXED64.pack(span.end_time or 0))
        parts.append(self._attributes_of(0x4A, span.attributes))
        if span.dropped_attributes:
            parts.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            body = b"\x09" + _FIXED64.pack(event.timestamp) + _field(0x12, event.name.encode())
            body += self._attributes_of(0x1A, event.attributes)
            parts.append(_field(0x5A, body))
        if span.dropped_events:
            parts.append(b"\x60" + _varint(span.dropped_events))
        for link in span.links:
            body = (
                b"\x0a\x10"
                + link.context.trace_id.to_bytes(16, "big")
                + b"\x12\x08"
                + link.context.span_id.to_bytes(8, "big")
            )
            body += self._attributes_of(0x22, link.attributes)
            body += b"\x35" + _FIXED32.pack(_flags(link.context))
            parts.append(_field(0x6A, body))
        if span.dropped_links:
            parts.append(b"\x70" + _varint(span.dropped_links))
        status = span.status
        message = status.description or ""
        code = status.status_code.value
        inner = (_field(0x12, message.encode()) if message else b"") + (
            b"\x18" + _varint(code) if code else b""
        )
        parts.append(_field(0x7A, inner))
        parts.append(b"\x85\x01" + _FIXED32.pack(_flags(parent)))
        return b"".join(parts)

    def _name(self, name: str) -> bytes:
        found = self._names.get(name)
        if found is None:
            if len(self._names) >= _CACHE_LIMIT:
                self._names.clear()
            found = self._names[name] = _field(0x2A, name.encode())
        return found

    def _attributes_of(self, tag: int, attributes: Mapping[str, Any] | None) -> bytes:
        """Each attribute as a repeated ``KeyValue`` field of number ``tag``."""
        if not attributes:
            return b""
        cache = self._attributes
        parts = []
        for key, value in attributes.items():
            if type(value) is int:
                # Counts and durations differ on every span: not worth a cache slot.
                parts.append(_field(tag, _key_value(key, value)))
                continue
            cache_key = (tag, key, type(value), value if type(value) is not list else tuple(value))
            try:
                found = cache.get(cache_key)
            except TypeError:  # an unhashable sequence
                parts.append(_field(tag, _key_value(key, value)))
                continue
            if found is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                found = cache[cache_key] = _field(tag, _key_value(key, value))
            parts.append(found)
        return b"".join(parts)


def _flags(parent: SpanContext | None) -> int:
    if parent is not None and parent.is_remote:
        return _HAS_IS_REMOTE | _IS_REMOTE
    return _HAS_IS_REMOTE


class OtlpGrpcExporter(SpanExporter):
    """Sends each batch to an OTLP/gRPC collector (plain text, as the mesh's
    ``otlp_endpoint`` names it: ``host:port`` or ``http://host:port``)."""

    def __init__(self, endpoint: str) -> None:
        target = endpoint.split("://", 1)[-1].rstrip("/")
        self._channel = grpc.insecure_channel(target)
        self._export = self._channel.unary_unary(EXPORT_METHOD)
        self._encoder = SpanEncoder()
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Send one batch; a failure drops it (spans are not worth a backlog)."""
        try:
            self._export(self._encoder.encode(spans), timeout=EXPORT_TIMEOUT_S)
        except grpc.RpcError as exc:
            if not self._failing:  # once per outage, not per batch
                log.warning("exporting spans failed: %s", exc)
            self._failing = True
            return SpanExportResult.FAILURE
        self._failing = False
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the channel."""
        self._channel.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is held here: every batch is sent as it comes."""
        return True
