"""Server and client interceptors: the one error map, tracing, and draining.

Every RPC handler of every service is wrapped here, so no handler carries its
own try/except: a ``MeshError`` becomes its gRPC status with its message; any
other exception becomes INTERNAL with a generic message while the traceback
goes to the log.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.errors import GENERIC_INTERNAL_MESSAGE, MeshError, Unavailable
from shared.tracing import (
    extract_context,
    inject_metadata,
    iterate_in_context,
    pop_parameters_context,
)

log = logging.getLogger(__name__)

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

# RPCs that keep working while the server drains, so probes see NOT_SERVING
# instead of a refused call.
_ALWAYS_ALLOWED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.rpartition("/")
    return service.lstrip("/"), name


class ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps errors to statuses, opens a server span, counts in-flight RPCs, drains."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self.in_flight = 0
        self.draining = False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method
        ctx = extract_context(details.invocation_metadata)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, ctx),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_any(handler.unary_stream, method, ctx),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method, ctx),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        behavior = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_request_stream(behavior, method, ctx),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _admit(self, method: str) -> bool:
        """Refuse work while draining; True when the RPC counts as in flight."""
        if method.startswith(_ALWAYS_ALLOWED_PREFIXES):
            return False
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        self.in_flight += 1
        return True

    def _start_span(self, method: str, ctx: otel_context.Context) -> trace.Span:
        service, name = _split(method)
        return self._tracer.start_span(
            method.lstrip("/"),
            context=ctx,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )

    def _wrap_any(self, behavior: Any, method: str, ctx: otel_context.Context) -> Any:
        # A streaming handler is either an async generator or a coroutine that
        # writes with context.write() (grpc's health Watch); keep its kind.
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_stream(behavior, method, ctx)
        return self._wrap_unary(behavior, method, ctx)

    def _wrap_unary(self, behavior: Unary, method: str, ctx: otel_context.Context) -> Unary:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self._start_span(method, ctx)
            token = otel_context.attach(trace.set_span_in_context(span))
            counted = False
            try:
                counted = self._admit(method)
                return await behavior(request, context)
            except BaseException as exc:
                await _abort(context, span, exc, method)
                raise
            finally:
                self.in_flight -= counted
                otel_context.detach(token)
                span.end()

        return wrapped

    def _wrap_stream(self, behavior: Streaming, method: str, ctx: otel_context.Context) -> Any:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span = self._start_span(method, ctx)
            span_ctx = trace.set_span_in_context(span)
            counted = False
            try:
                counted = self._admit(method)
                async for item in iterate_in_context(span_ctx, behavior(request, context)):
                    yield item
            except BaseException as exc:
                await _abort(context, span, exc, method)
                raise
            finally:
                self.in_flight -= counted
                span.end()

        return wrapped

    @contextlib.asynccontextmanager
    async def _admitted(
        self,
        method: str,
        ctx: otel_context.Context,
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[_AdmittedRequests]:
        """A request stream's requests, admitted at the first; ends its span and its
        in-flight count, and turns a failure into the RPC's status."""
        requests = _AdmittedRequests(self, method, ctx, request)
        try:
            yield requests
        except BaseException as exc:
            await _abort(context, requests.span, exc, method)
            raise
        finally:
            self.in_flight -= requests.counted
            requests.span.end()

    def _wrap_request_stream(self, behavior: Any, method: str, ctx: otel_context.Context) -> Any:
        """A bidirectional stream counts as in flight, and its span starts, with its
        first request: a stream opened ahead of its requests (the orchestrator
        keeps some open) holds no drain while it idles, and when its metadata
        carries no trace context, its first request's parameters do. The handler
        either yields its responses or writes them with ``context.write``."""

        async def written(request: Any, context: grpc.aio.ServicerContext) -> None:
            async with self._admitted(method, ctx, request, context) as requests:
                await behavior(requests, context)

        async def yielded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._admitted(method, ctx, request, context) as requests:
                async for item in behavior(requests, context):
                    yield item

        return yielded if inspect.isasyncgenfunction(behavior) else written


class _AdmittedRequests:
    """The requests of a stream; admits the RPC and starts its span at the first.

    The span's context is made current in the task reading the requests, so
    the tasks it starts for them run in the request's trace.
    """

    def __init__(
        self, owner: ServerInterceptor, method: str, ctx: otel_context.Context, requests: Any
    ) -> None:
        self._owner = owner
        self._method = method
        self._ctx = ctx
        self._requests = requests
        self._started = False
        self.counted = False
        self.span: trace.Span = trace.INVALID_SPAN

    def __aiter__(self) -> _AdmittedRequests:
        return self

    async def __anext__(self) -> Any:
        request = await anext(self._requests)
        parameters = getattr(request, "parameters", None)
        carried = pop_parameters_context(parameters) if parameters is not None else None
        if not self._started:
            self._started = True
            self.counted = self._owner._admit(self._method)
            has_parent = trace.get_current_span(self._ctx).get_span_context().is_valid
            parent = self._ctx if has_parent or carried is None else carried
            self.span = self._owner._start_span(self._method, parent)
            otel_context.attach(trace.set_span_in_context(self.span))
        return request


async def _abort(
    context: grpc.aio.ServicerContext, span: trace.Span, exc: BaseException, method: str
) -> None:
    """Turn ``exc`` into the RPC's status; returns only for exceptions to re-raise."""
    if isinstance(exc, grpc.aio.AbortError | GeneratorExit) or not isinstance(exc, Exception):
        # Already aborted by the handler, or cancelled / closed by gRPC itself.
        if isinstance(exc, grpc.aio.AbortError):
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        return
    if isinstance(exc, MeshError):
        span.set_status(Status(StatusCode.ERROR, exc.message))
        span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
        await context.abort(exc.code, exc.message)
    log.exception("unexpected error in %s", method)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    await context.abort(grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE)


class _ClientBase:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _details(self, details: grpc.aio.ClientCallDetails, span: trace.Span) -> Any:
        metadata = inject_metadata(list(details.metadata or ()), trace.set_span_in_context(span))
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )

    def _span(self, details: grpc.aio.ClientCallDetails) -> trace.Span:
        if not trace.get_current_span().get_span_context().is_valid:
            # A call made outside any trace (discovery, a stream opened ahead of
            # its requests) starts no trace of its own.
            return trace.INVALID_SPAN
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, name = _split(method)
        return self._tracer.start_span(
            method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )


class ClientUnaryInterceptor(_ClientBase, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Opens a client span and sends its ``traceparent`` with unary calls."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        span = self._span(details)
        try:
            call = await continuation(self._details(details, span), request)
            await call
            return call
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.details() or ""))
            raise
        finally:
            span.end()


class ClientUnaryStreamInterceptor(_ClientBase, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends ``traceparent`` with server-streaming calls; the span covers the set-up."""

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        span = self._span(details)
        try:
            return await continuation(self._details(details, span), request)
        finally:
            span.end()


class ClientStreamStreamInterceptor(_ClientBase, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Sends ``traceparent`` with bidirectional calls; the span covers the set-up."""

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        span = self._span(details)
        try:
            return await continuation(self._details(details, span), request_iterator)
        finally:
            span.end()


def client_interceptors(tracer: trace.Tracer) -> list[Any]:
    """Interceptors for a ``grpc.aio`` channel that propagate the trace.

    One class per call kind: a channel files each interceptor under the first
    kind it implements, so one class serving two kinds would miss the second.
    """
    return [
        ClientUnaryInterceptor(tracer),
        ClientUnaryStreamInterceptor(tracer),
        ClientStreamStreamInterceptor(tracer),
    ]
