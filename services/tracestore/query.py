"""The query side over HTTP, translation only: Jaeger's API, the page and its data.

::

    GET /api/services                          service names
    GET /api/services/{service}/operations     span names of a service
    GET /api/operations?service=S              the same, with span kinds
    GET /api/traces?service=&operation=&tags=&minDuration=&maxDuration=
                   &start=&end=&lookback=&limit=     whole traces, newest first
    GET /api/traces/{traceID}                  one trace
    GET /traces                                the page (recent / slowest, waterfall)
    GET /traces/data/list?order=recent|slowest&model=&status=ok|error&limit=
    GET /traces/data/waterfall/{traceID}       one trace's rows with queue/compute/network

Bad parameters are 400 with a message naming the parameter.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aiohttp import web

from services.tracestore import jaeger
from services.tracestore.store import TraceQuery, TraceStore
from services.tracestore.waterfall import waterfall

PAGE = Path(__file__).resolve().parent / "page.html"
MAX_LIMIT = 1000
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|µs|ms|s|m|h|d)?\s*$")
_UNIT_US = {"us": 1, "µs": 1, "ms": 1000, "s": 10**6, "m": 60 * 10**6, "h": 3600 * 10**6}
_UNIT_US["d"] = 24 * _UNIT_US["h"]
_TRACE_ID = re.compile(r"^[0-9a-fA-F]{1,32}$")


def duration_us(text: str, name: str, default_unit: str = "us") -> int:
    """``1.5s``, ``200ms``, ``300us``, ``2h`` as microseconds; 400 naming ``name`` if not."""
    match = _DURATION.match(text)
    if match is None:
        raise web.HTTPBadRequest(
            text=f"parameter '{name}': {text!r} is not a duration such as 100ms, 1.5s or 2h"
        )
    return int(float(match.group(1)) * _UNIT_US[match.group(2) or default_unit])


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"parameter '{name}': {raw!r} is not an integer") from exc
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"parameter '{name}': {value} is not in [{low}, {high}]")
    return value


def trace_id_of(request: web.Request) -> str:
    """The path's trace id, 32 lowercase hex digits (Jaeger's shorter form is padded)."""
    raw = request.match_info["trace_id"]
    if not _TRACE_ID.match(raw):
        raise web.HTTPBadRequest(text=f"trace id {raw!r} is not 1-32 hex digits")
    return raw.lower().rjust(32, "0")


def _tags(request: web.Request) -> tuple[tuple[str, str], ...]:
    raw = request.query.get("tags", "")
    if not raw:
        return ()
    try:
        tags = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"parameter 'tags': not JSON ({exc.msg})") from exc
    if not isinstance(tags, dict):
        raise web.HTTPBadRequest(text="parameter 'tags': expected a JSON object of key: value")
    return tuple((str(k), _tag_text(v)) for k, v in tags.items())


def _tag_text(value: object) -> str:
    # As stored: attributes are JSON, and SQLite reads a JSON true as 1.
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def _duration_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name, "")
    return duration_us(raw, name) if raw else None


def trace_query(request: web.Request) -> TraceQuery:
    """Jaeger's ``/api/traces`` parameters as a ``TraceQuery``."""
    q = request.query
    start = _int(request, "start", -1, 0, 2**62)
    end = _int(request, "end", -1, 0, 2**62)
    if "lookback" in q and q["lookback"] not in ("", "custom") and start < 0:
        start = int(time.time() * 1e6) - duration_us(q["lookback"], "lookback")
    return TraceQuery(
        service=q.get("service") or None,
        operation=q.get("operation") or None,
        tags=_tags(request),
        min_duration_us=_duration_param(request, "minDuration") or 0,
        max_duration_us=_duration_param(request, "maxDuration"),
        start_us=start if start >= 0 else None,
        end_us=end if end >= 0 else None,
        limit=_int(request, "limit", 20, 1, MAX_LIMIT),
    )


def query_routes(store: TraceStore) -> list[web.RouteDef]:
    """Every route of the query port."""

    async def services(_: web.Request) -> web.Response:
        return web.json_response(jaeger.envelope(await store.run(store.services)))

    async def service_operations(request: web.Request) -> web.Response:
        rows = await store.run(store.operations, request.match_info["service"])
        return web.json_response(jaeger.envelope(sorted({name for name, _ in rows})))

    async def operations(request: web.Request) -> web.Response:
        service = request.query.get("service", "")
        if not service:
            raise web.HTTPBadRequest(text="parameter 'service' is required")
        rows = await store.run(store.operations, service)
        return web.json_response(jaeger.envelope(jaeger.operations(rows)))

    async def traces(request: web.Request) -> web.Response:
        found = await store.run(store.find, trace_query(request))
        return web.json_response(jaeger.envelope([jaeger.trace(spans) for spans in found]))

    async def one_trace(request: web.Request) -> web.Response:
        trace_id = trace_id_of(request)
        spans = await store.run(store.trace, trace_id)
        if not spans:
            return web.json_response(jaeger.not_found(trace_id), status=404)
        return web.json_response(jaeger.envelope([jaeger.trace(spans)]))

    async def page(_: web.Request) -> web.FileResponse:
        return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def listing(request: web.Request) -> web.Response:
        order = request.query.get("order", "recent")
        if order not in ("recent", "slowest"):
            raise web.HTTPBadRequest(text=f"parameter 'order': {order!r} is not recent or slowest")
        status = request.query.get("status", "")
        if status not in ("", "ok", "error"):
            raise web.HTTPBadRequest(text=f"parameter 'status': {status!r} is not ok or error")
        error = None if not status else status == "error"
        limit = _int(request, "limit", 50, 1, MAX_LIMIT)
        model = request.query.get("model") or None
        rows = await store.run(store.summaries, order, limit, model, error)
        models = await store.run(store.models)
        return web.json_response({"traces": [asdict(row) for row in rows], "models": models})

    async def one_waterfall(request: web.Request) -> web.Response:
        trace_id = trace_id_of(request)
        spans = await store.run(store.trace, trace_id)
        if not spans:
            raise web.HTTPNotFound(text=f"trace {trace_id} is not in the store")
        return web.json_response(waterfall(spans).as_json())

    return [
        web.get("/api/services", services),
        web.get("/api/services/{service}/operations", service_operations),
        web.get("/api/operations", operations),
        web.get("/api/traces", traces),
        web.get("/api/traces/{trace_id}", one_trace),
        web.get("/traces", page),
        web.get("/traces/data/list", listing),
        web.get("/traces/data/waterfall/{trace_id}", one_waterfall),
    ]


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An HTTP error as ``{"error": message}`` (Jaeger's clients read the status)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status in (404, 405) and message.startswith(f"{exc.status}:"):
            message = f"no route for {request.method} {request.path}"
        return web.json_response({"error": message}, status=exc.status)
