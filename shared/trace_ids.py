"""A request's trace id as its caller sees it: the W3C ``traceparent`` of a server
span, and the bare trace id that response bodies carry.

No gRPC or HTTP here: the tracing interceptor puts the header in trailing
metadata, the HTTP adapter in its response headers.
"""

from __future__ import annotations

from opentelemetry import trace

TRACEPARENT = "traceparent"


def traceparent(span: trace.Span) -> str | None:
    """``00-<trace id>-<span id>-<flags>`` of ``span``; None for an invalid span."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def current_trace_id() -> str | None:
    """The current span's trace id (32 lowercase hex digits); None outside any trace."""
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None
