"""Unary gRPC methods served over HTTP/1.1, for Envoy's gRPC-HTTP/1.1 reverse bridge.

A grpc.aio server spends about half a millisecond of CPU on every unary call
before its handler runs; parsing an HTTP/1.1 request with httptools costs a
tenth of that. Envoy's edge therefore sends the mesh's hot unary call
(ModelInfer) to this door instead of the gRPC port: its reverse bridge
(``envoy.filters.http.grpc_http1_reverse_bridge``, ``withhold_grpc_frames``)
strips the gRPC frame on the way in and adds it back on the way out, and a
header mutation moves the status into the trailers (gateway/envoy/wire.py).
Callers still speak gRPC to Envoy; only the hop behind it changes.

The exchange::

    POST /<package.Service>/<Method>          body: the serialised request
    200, content-type application/x-protobuf  body: the serialised response
         x-grpc-status: <code>                (always; 0 on success)
         x-grpc-message: <percent-encoded>    (on error; the body is empty)

Request headers are the call's metadata (Envoy passes them through):
``grpc-timeout`` sets the deadline, ``traceparent`` the trace, and a handler
reads the rest from its ``WireContext`` as it would from a servicer context.
A request that does not parse gets 400 and its connection is closed; one
larger than the door's limit gets RESOURCE_EXHAUSTED. A closed connection
cancels its request's handler, as a cancelled RPC does.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

import grpc
import httptools  # type: ignore[import-untyped]
from opentelemetry import context as otel_context
from opentelemetry import trace

from shared.errors import GENERIC_INTERNAL_MESSAGE, DeadlineExceeded, MeshError
from shared.grpc_headers import grpc_message, grpc_timeout
from shared.interceptors import DrainGate
from shared.trace_ids import TRACEPARENT
from shared.trace_interceptors import recorded, start_server_span
from shared.tracing import extract_context

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/x-protobuf"
"""The content type the bridge sends and expects back (its ``content_type``)."""
STATUS_HEADER = "x-grpc-status"
MESSAGE_HEADER = "x-grpc-message"
MAX_PIPELINED = 8
"""Requests one connection may have waiting behind the one being answered."""

WireHandler = Callable[[bytes, "WireContext"], Awaitable[bytes]]
"""A unary method: the serialised request and its context in, the serialised answer out."""


class WireContext:
    """What a handler sees of its call: the servicer-context methods the mesh's
    handlers use (metadata, deadline, response headers)."""

    __slots__ = ("_metadata", "answer_headers", "deadline")

    def __init__(self, metadata: list[tuple[str, str]], deadline: float | None) -> None:
        self._metadata = metadata
        self.deadline = deadline
        """The event loop's time at the caller's deadline (None: no deadline)."""
        self.answer_headers: list[tuple[str, str]] = []
        """Headers for the answer (initial and trailing metadata alike)."""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        """The caller's metadata: the request's headers, names in lower case."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (None: no deadline)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def send_initial_metadata(self, initial_metadata: Iterable[tuple[str, Any]]) -> None:
        """Answer headers (they reach the caller as the response's headers)."""
        self.answer_headers += [(k, str(v)) for k, v in initial_metadata]

    def set_trailing_metadata(self, trailing_metadata: Iterable[tuple[str, Any]]) -> None:
        """Also answer headers: behind the bridge a method has no trailers of its own."""
        self.answer_headers += [(k, str(v)) for k, v in trailing_metadata]


def _answer(code: int, body: bytes, headers: Iterable[tuple[str, str]], message: str = "") -> bytes:
    lines = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n",
        b"x-grpc-status: %d\r\n" % code,
    ]
    if message:
        lines.append(f"{MESSAGE_HEADER}: {grpc_message(message)}\r\n".encode("latin-1"))
    for key, value in headers:
        if "\r" not in value and "\n" not in value:
            lines.append(f"{key}: {value}\r\n".encode("latin-1", "replace"))
    lines.append(b"content-length: %d\r\n\r\n" % len(body))
    lines.append(body)
    return b"".join(lines)


def _status_of(exc: BaseException, method: str) -> tuple[int, str]:
    if isinstance(exc, MeshError):
        return exc.code.value[0], exc.message
    log.error("unexpected error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL.value[0], GENERIC_INTERNAL_MESSAGE


class _Request:
    __slots__ = ("body", "metadata", "method", "size")

    def __init__(self, method: str, metadata: list[tuple[str, str]], body: bytes, size: int):
        self.method = method
        self.metadata = metadata
        self.body = body
        self.size = size
        """The body's length as sent (over the door's limit, ``body`` is left empty)."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: requests answered in the order they came."""

    def __init__(self, door: WireDoor) -> None:
        self._door = door
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._waiting: deque[_Request] = deque()
        self._task: asyncio.Task[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but the same API.
        self._transport = cast(asyncio.Transport, transport)
        self._door.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._door.connections.discard(self)
        self._transport = None
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()  # the caller is gone: so is its call

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse(f"malformed HTTP/1.1 request: {exc}")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", [], [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= self._door.max_request_bytes:
            self._body.append(body)

    def on_message_complete(self) -> None:
        method = self._url.decode("latin-1")
        request = _Request(method, self._headers, b"".join(self._body), self._size)
        self._waiting.append(request)
        if len(self._waiting) > MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_all())

    def _refuse(self, reason: str) -> None:
        if self._transport is not None:
            body = reason.encode("latin-1", "replace")[:200]
            self._transport.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self._transport.close()

    async def _answer_all(self) -> None:
        try:
            while self._waiting:
                request = self._waiting.popleft()
                answer = await self._door.answer(request)
                if self._transport is None:
                    return
                self._transport.write(answer)
                if len(self._waiting) <= MAX_PIPELINED:
                    self._transport.resume_reading()
        finally:
            self._task = None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class WireDoor:
    """Serves ``handlers`` (by path, ``/package.Service/Method``) on one port."""

    def __init__(
        self,
        handlers: Mapping[str, WireHandler],
        tracer: trace.Tracer,
        max_request_bytes: int,
        gate: DrainGate,
    ) -> None:
        self._handlers = dict(handlers)
        self._tracer = tracer
        self._silent = isinstance(tracer, trace.NoOpTracer)
        self.max_request_bytes = max_request_bytes
        self.connections: set[_Connection] = set()
        self._gate = gate
        """The gRPC server's: a drain refuses and waits for calls on both doors."""
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> str:
        """Listen; returns ``host:port`` (port 0 takes a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, ssl=tls, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound}"

    def close(self) -> None:
        """Stop listening and close every connection: called once the drain gate is
        idle or its grace is over, when the gRPC server cancels what still runs
        too (a call still running here is cancelled with its connection)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()

    async def answer(self, request: _Request) -> bytes:
        """The whole HTTP answer to one request."""
        handler = self._handlers.get(request.method)
        if handler is None:
            code = grpc.StatusCode.UNIMPLEMENTED.value[0]
            return _answer(code, b"", (), f"method {request.method[:100]} is not served here")
        if request.size > self.max_request_bytes:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            limit = self.max_request_bytes
            return _answer(code, b"", (), f"request of {request.size} bytes is over {limit}")
        deadline, traced = None, not self._silent
        for key, value in request.metadata:  # one pass: the deadline, and a trace to continue
            if key == "grpc-timeout":
                timeout = grpc_timeout(value)
                if timeout is not None:
                    deadline = asyncio.get_running_loop().time() + timeout
            elif key == TRACEPARENT:
                traced = True
        context = WireContext(request.metadata, deadline)
        try:
            self._gate.admit()
        except MeshError as exc:
            return _answer(exc.code.value[0], b"", (), exc.message)
        try:
            if traced:
                body = await self._traced(handler, request, context)
            else:
                body = await self._call(handler, request, context)
            return _answer(0, body, context.answer_headers)
        except Exception as exc:
            code, message = _status_of(exc, request.method)
            return _answer(code, b"", context.answer_headers, message)
        finally:
            self._gate.release()

    @staticmethod
    async def _call(handler: WireHandler, request: _Request, context: WireContext) -> bytes:
        if context.deadline is None:
            return await handler(request.body, context)
        remaining = context.time_remaining()
        try:
            return await asyncio.wait_for(handler(request.body, context), remaining)
        except TimeoutError:
            raise DeadlineExceeded("the call's deadline passed before its answer") from None

    async def _traced(self, handler: WireHandler, request: _Request, context: WireContext) -> bytes:
        """The call in a server span continuing the caller's trace, as the gRPC
        port's tracing interceptor opens one."""
        parent = extract_context(request.metadata)
        span = start_server_span(self._tracer, request.method, parent, context)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            with recorded(span):
                return await self._call(handler, request, context)
        finally:
            otel_context.detach(token)
