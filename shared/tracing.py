"""OpenTelemetry: tracer set-up and W3C ``traceparent`` propagation over gRPC.

Each process builds its own ``TracerProvider`` (never the global one), so
several services can share a test process and still report distinct
``service.name`` values. Context travels in gRPC metadata under the standard
W3C keys (``traceparent``, ``tracestate``); on a stream opened ahead of its
requests, each request carries them as string parameters of the same names.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.errors import MeshError
from shared.otlp_export import OtlpGrpcExporter
from shared.span_recorder import SpanRecorder
from shared.trace_ids import traceparent

_PROPAGATOR = TraceContextTextMapPropagator()

T = TypeVar("T")

EXPORT_DELAY_S = 0.5
"""How long a service holds its ended spans before sending them as one batch: an
export call costs its sender and a Python collector (the trace store) about what
a few dozen spans cost, so a busy service sends a few batches a second, not many
small ones; a span can be looked up about this long after its request ended."""


def make_tracer_provider(
    service_name: str,
    otlp_endpoint: str | None,
    exporter: SpanExporter | None = None,
    sample_ratio: float = 1.0,
) -> TracerProvider | None:
    """A provider exporting to ``otlp_endpoint`` (OTLP/gRPC) or ``exporter``.

    None when there is nowhere to send spans: ``tracer_for`` then gives a no-op
    tracer, which still passes the caller's trace context on (a span of it is
    the caller's own context, not recorded), so a traced caller's downstream
    spans still join its trace. (Recording spans that nobody exports cost the
    orchestrator about ten span set-ups per chat request, for nothing.)

    Sampling is decided once per trace, where it starts: a request that comes
    with a ``traceparent`` keeps its caller's decision (the sampled flag), and
    one without is sampled with probability ``sample_ratio``, by its trace id,
    so every hop that has to decide decides alike.
    """
    if exporter is None and otlp_endpoint:
        exporter = OtlpGrpcExporter(otlp_endpoint)
    if exporter is None:
        return None
    # Spans recorded without the SDK's per-span machinery (shared/span_recorder.py).
    resource = Resource.create({"service.name": service_name})
    return SpanRecorder(resource, exporter, sample_ratio, delay_s=EXPORT_DELAY_S)


def extract_context(metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    """The trace context carried by incoming gRPC metadata (empty if none)."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return _context_of(carrier)


_VERSION_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
"""A ``traceparent`` of the W3C version every hop of the mesh sends."""


def _context_of(carrier: Mapping[str, str]) -> otel_context.Context:
    """The context ``carrier`` (W3C fields) names: read here for the version-00
    header every hop sends (a compiled pattern, no getter calls, each request at
    every hop), by OpenTelemetry's propagator for anything else."""
    header = carrier.get("traceparent")
    match = _VERSION_00.fullmatch(header) if header is not None else None
    if match is None:
        return _PROPAGATOR.extract(carrier) if header is not None else otel_context.Context()
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return otel_context.Context()  # invalid ids: no parent, as the propagator says
    state = carrier.get("tracestate")
    caller = SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(int(match[3], 16)),
        trace_state=TraceState.from_header([state]) if state else None,
    )
    return trace.set_span_in_context(NonRecordingSpan(caller), otel_context.Context())


def inject_metadata(
    metadata: Sequence[tuple[str, str | bytes]] | None,
    ctx: otel_context.Context | None = None,
) -> list[tuple[str, str | bytes]]:
    """``metadata`` plus the current (or given) trace context as W3C headers."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    kept = [(k, v) for k, v in (metadata or ()) if k not in carrier]
    return kept + list(carrier.items())


TRACE_PARAMETERS = ("traceparent", "tracestate")
"""Request parameters that carry a request's own trace context."""


def inject_parameters(parameters: Any) -> None:
    """Put the current trace context into a v2 request's ``parameters`` map."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    for key, value in carrier.items():
        parameters[key].string_param = value


def current_carrier() -> dict[str, str]:
    """The current trace context as W3C fields (empty outside any trace): what a
    request carries in its parameters on a stream (``pop_parameters_context``)."""
    span = trace.get_current_span()
    header = traceparent(span)
    if header is None:
        return {}
    state = span.get_span_context().trace_state
    if state:
        return {"traceparent": header, "tracestate": state.to_header()}
    return {"traceparent": header}


@contextlib.contextmanager
def client_span(tracer: trace.Tracer, method: str) -> Iterator[None]:
    """A client span for a call to ``method`` (``/service/Method``) made as a message
    on a stream, current while it runs, as the client interceptor opens for an RPC
    of its own: none when the current span is already the call's client span (an
    ensemble step's) or records nothing."""
    current = trace.get_current_span()
    if getattr(current, "kind", None) is trace.SpanKind.CLIENT or not current.is_recording():
        yield
        return
    service, _, name = method.lstrip("/").rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    with tracer.start_as_current_span(
        method.lstrip("/"),
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except MeshError as exc:
            # The call's status, as the client interceptor sets it for an RPC.
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise


def pop_parameters_context(parameters: Any) -> otel_context.Context | None:
    """The trace context a v2 request carries in ``parameters`` (None when it
    carries none), removed from them: models never see it."""
    carrier = {}
    for key in TRACE_PARAMETERS:
        if key in parameters:
            carrier[key] = parameters[key].string_param
            del parameters[key]
    return _context_of(carrier) if carrier else None


def traceparent_of(metadata: Mapping[str, str]) -> str | None:
    """The raw ``traceparent`` header, if present."""
    return metadata.get("traceparent")


def tracer_for(provider: trace.TracerProvider | None, name: str) -> trace.Tracer:
    """A tracer from ``provider``; a no-op tracer when there is none."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(name)


async def iterate_in_context(
    ctx: otel_context.Context, stream: AsyncIterator[T]
) -> AsyncIterator[T]:
    """The items of ``stream``, with ``ctx`` current while each one is produced.

    Only around each step: a generator may be resumed in another context, and a
    token attached across a yield could then not be detached.
    """
    while True:
        token = otel_context.attach(ctx)
        try:
            item = await anext(stream)
        except StopAsyncIteration:
            return
        finally:
            otel_context.detach(token)
        yield item
