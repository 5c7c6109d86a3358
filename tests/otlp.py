"""An in-test OTLP/gRPC trace receiver: what the services export, as plain spans."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    """One received span."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attrs.get("service.name", "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        Span(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(value: Any) -> Any:
    which = value.WhichOneof("value")
    return getattr(value, which) if which else None


class OtlpReceiver:
    """A real OTLP/gRPC endpoint on 127.0.0.1, port 0."""

    def __init__(self) -> None:
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        """``host:port`` to pass as ``--otlp-endpoint``."""
        return f"127.0.0.1:{self.port}"

    def spans(self) -> list[Span]:
        """Every span received so far."""
        with self._collector.lock:
            return list(self._collector.spans)

    def wait_for(self, predicate: Any, timeout: float = 15.0) -> list[Span]:
        """Poll until ``predicate(spans)`` holds; returns the spans."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the receiver."""
        self._server.stop(0)
