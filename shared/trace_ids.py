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
    # %-formatting: this runs several times per request, and costs less than an f-string.
    return "00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)  # noqa: UP031


def current_trace_id() -> str | None:
    """The current span's trace id (32 lowercase hex digits); None outside any trace."""
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None
