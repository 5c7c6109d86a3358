"""Spans in the JSON shape of Jaeger's query API (what Jaeger UI and Grafana's
Jaeger data source read): ``{data, total, limit, offset, errors}``, each trace
``{traceID, spans, processes}``, times in microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.tracestore.spans import SpanRecord

KIND_NAMES = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def envelope(data: Any, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Jaeger's response wrapper around ``data``."""
    total = len(data) if isinstance(data, list) else 0
    return {"data": data, "total": total, "limit": 0, "offset": 0, "errors": errors}


def not_found(trace_id: str) -> dict[str, Any]:
    """Jaeger's answer for a trace it does not have."""
    return envelope(None, [{"code": 404, "msg": f"trace {trace_id} not found"}])


def tag(key: str, value: Any) -> dict[str, Any]:
    """One Jaeger key/value tag, typed as Jaeger types them."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    text = value if isinstance(value, str) else str(value)
    return {"key": key, "type": "string", "value": text}


def _tags(span: SpanRecord) -> list[dict[str, Any]]:
    tags = [tag(key, value) for key, value in span.attributes.items()]
    if span.kind in KIND_NAMES:
        tags.append(tag("span.kind", KIND_NAMES[span.kind]))
    if span.error:
        tags.append(tag("error", True))
        tags.append(tag("otel.status_code", "ERROR"))
        if span.status_message:
            tags.append(tag("otel.status_description", span.status_message))
    if span.scope:
        tags.append(tag("otel.scope.name", span.scope))
    return tags


def trace(spans: Sequence[SpanRecord]) -> dict[str, Any]:
    """One trace: its spans and one process per service."""
    processes: dict[str, dict[str, Any]] = {}
    process_of: dict[str, str] = {}
    for span in spans:
        if span.service not in process_of:
            key = f"p{len(process_of) + 1}"
            process_of[span.service] = key
            resource = {k: v for k, v in span.resource.items() if k != "service.name"}
            processes[key] = {
                "serviceName": span.service,
                "tags": [tag(k, v) for k, v in resource.items()],
            }
    known = {span.span_id for span in spans}
    return {
        "traceID": spans[0].trace_id,
        "spans": [_span(span, process_of[span.service], known) for span in spans],
        "processes": processes,
        "warnings": None,
    }


def _span(span: SpanRecord, process: str, known: set[str]) -> dict[str, Any]:
    references = (
        [{"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_id}]
        if span.parent_id
        else []
    )
    warnings = (
        None
        if not span.parent_id or span.parent_id in known
        else [f"parent span {span.parent_id} is not in the store (not sent, or dropped)"]
    )
    return {
        "traceID": span.trace_id,
        "spanID": span.span_id,
        "operationName": span.name,
        "references": references,
        "flags": 1,
        "startTime": span.start_us,
        "duration": span.duration_us,
        "tags": _tags(span),
        "logs": [
            {
                "timestamp": event["time_us"],
                "fields": [
                    tag("event", event["name"]),
                    *(tag(k, v) for k, v in event["attributes"].items()),
                ],
            }
            for event in span.events
        ],
        "processID": process,
        "warnings": warnings,
    }


def operations(rows: Sequence[tuple[str, int]]) -> list[dict[str, str]]:
    """``/api/operations`` entries: name and span kind."""
    return [{"name": name, "spanKind": KIND_NAMES.get(kind, "")} for name, kind in rows]
