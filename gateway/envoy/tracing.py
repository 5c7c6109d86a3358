"""How Envoy's OpenTelemetry tracer sends its spans.

Envoy's tracer exports a batch as soon as it holds ``min_flush_spans`` spans
(5 unless told otherwise), so at a hundred requests a second it makes twenty
export calls a second, each of which costs the receiving collector (the mesh's
trace store is Python) a call's set-up and a write for five spans. Flushed on
the same schedule as the mesh's own services (``shared.tracing``), a batch
carries all the spans of its interval instead.
"""

from __future__ import annotations

from typing import Any

FLUSH_INTERVAL_MS = 500
"""How often Envoy sends the spans it holds (the services' batch delay,
``shared.tracing.EXPORT_DELAY_S``)."""
MIN_FLUSH_SPANS = 512
"""Spans that make Envoy send at once, before the interval is up (the services'
batch size)."""


def span_flush_runtime() -> dict[str, Any]:
    """A runtime layer of the bootstrap: the tracer's flush settings, which Envoy
    reads from its runtime rather than from the tracer's config."""
    return {
        "name": "tracing",
        "static_layer": {
            "tracing.opentelemetry.flush_interval_ms": FLUSH_INTERVAL_MS,
            "tracing.opentelemetry.min_flush_spans": MIN_FLUSH_SPANS,
        },
    }
