"""The trace id of the current span as an OpenMetrics exemplar.

A histogram observation made inside a request's span carries
``{"trace_id": ...}``, so a slow bucket on a dashboard links to a trace of a
request that fell in it. Prometheus sees exemplars only when it scrapes the
OpenMetrics exposition (shared/metrics_http.py serves it on request).
"""

from __future__ import annotations

from opentelemetry import trace


def trace_exemplar() -> dict[str, str] | None:
    """``{"trace_id": <32 hex digits>}`` of the current sampled span, else None."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return {"trace_id": format(context.trace_id, "032x")}
