"""The adapter's middlewares, one concern each, composed in a list by ``app.build_app``.

::

    measuring    request count and latency by route and status (outermost: sees
                 every answer, errors included)
    tracing      the server span, continuing the caller's W3C ``traceparent``;
                 ``identify`` (on response prepare) puts its ``traceparent`` and the
                 request's ``x-request-id`` (the caller's, or a new one) in the headers
    errors       an exception as its HTTP answer (the one HTTP error map)
    drain_gate   while draining, refuse new work with 503 (health stays open)

``errors`` answers a ``MeshError`` with its class's ``http_status`` (the same
tree that gives the gRPC code) and ``{"error": message}``, an aiohttp HTTP
error (unknown route, wrong method) with its own status, anything else with
500 and a generic message while the traceback goes to the log. Under
``/v1/`` and vLLM's paths the same statuses carry OpenAI's error body. A 429
(RESOURCE_EXHAUSTED: a full queue) carries ``Retry-After``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from gateway.http import openai
from shared.errors import GENERIC_INTERNAL_MESSAGE, MeshError, Unavailable
from shared.trace_ids import TRACEPARENT, traceparent
from shared.tracing import extract_context

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REQUEST_ID = "x-request-id"
_SPAN_KEY = web.RequestKey("meshserve_server_span", trace.Span)
RETRY_AFTER_S = 1
"""Seconds a 429 asks the client to wait: a full queue drains in about a batch's time."""

HEALTH_PREFIX = "/v2/health/"
"""Paths the drain gate lets through: readiness must be able to say "draining"."""


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def measuring(requests: Counter, latency: Histogram) -> Middleware:
    """Count each answer by method, route and status, and time it by route."""

    # Each series looked up once: labels() costs more than the increment itself.
    counts: dict[tuple[str, str, int], Any] = {}
    timings: dict[tuple[str, str], Any] = {}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        response = await handler(request)
        method, route, status = request.method, _route(request), response.status
        count = counts.get((method, route, status))
        if count is None:
            count = counts[method, route, status] = requests.labels(method, route, str(status))
        timing = timings.get((method, route))
        if timing is None:
            timing = timings[method, route] = latency.labels(method, route)
        count.inc()
        timing.observe(time.perf_counter() - started)
        return response

    return middleware


def tracing(tracer: trace.Tracer) -> Middleware:
    """A server span per request, a child of the caller's ``traceparent`` if any."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = _route(request)
        carrier = [(key.lower(), value) for key, value in request.headers.items()]
        with tracer.start_as_current_span(
            f"{request.method} {route}",
            context=extract_context(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
        ) as span:
            request[_SPAN_KEY] = span
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        return response

    return middleware


async def identify(request: web.Request, response: web.StreamResponse) -> None:
    """Name the request in every answer's headers, streams too (before they are sent)."""
    response.headers[REQUEST_ID] = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
    span = request.get(_SPAN_KEY)
    header = traceparent(span) if span is not None else None
    if header is not None:
        response.headers[TRACEPARENT] = header


def _answer(
    request: web.Request, status: int, message: str, exc: BaseException | None = None
) -> web.Response:
    if openai.speaks_openai(request.path):
        return openai.error_response(status, message, exc)
    return web.json_response({"error": message}, status=status)


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path}"
    if exc.status == 405:
        return f"{request.method} is not allowed on {request.path}"
    return exc.text or exc.reason


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every exception a handler raises as its HTTP answer."""
    try:
        return await handler(request)
    except MeshError as exc:
        answer = _answer(request, exc.http_status, exc.message, exc)
        if exc.http_status == 429:
            answer.headers["Retry-After"] = str(RETRY_AFTER_S)
        return answer
    except web.HTTPException as exc:
        return _answer(request, exc.status, _http_message(request, exc))
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _answer(request, 500, GENERIC_INTERNAL_MESSAGE)


def drain_gate(draining: Callable[[], bool]) -> Middleware:
    """While ``draining()``, new requests get 503 (health checks still answer)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if draining() and not request.path.startswith(HEALTH_PREFIX):
            raise Unavailable("the HTTP adapter is shutting down; retry on another replica")
        return await handler(request)

    return middleware
