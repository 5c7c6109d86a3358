"""The trace across hops: a server span per RPC, a client span and a
``traceparent`` per outgoing call.

``TracingInterceptor`` is the server's middle interceptor
(``shared.interceptors``); the client interceptors go on every ``grpc.aio``
channel the mesh opens (``shared.channels``) and carry the trace to the next
hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.errors import MeshError
from shared.forwarding import FORWARD_HEADER, FORWARD_UNARY, Pack
from shared.interceptors import Behavior, HandlerWrapper, SeenRequests, around
from shared.trace_ids import TRACEPARENT, traceparent
from shared.tracing import (
    extract_context,
    inject_metadata,
    iterate_in_context,
    pop_parameters_context,
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.rpartition("/")
    return service.lstrip("/"), name


def start_server_span(
    tracer: trace.Tracer, method: str, parent: otel_context.Context, context: Any
) -> trace.Span:
    """A call's server span under ``parent``; its traceparent goes in the call's
    trailers (``context.set_trailing_metadata``), where the caller finds its
    request's trace (an abort keeps them). The gRPC port's and the wire door's."""
    service, name = _split(method)
    span = tracer.start_span(
        method.lstrip("/"),
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
    )
    header = traceparent(span)
    if header is not None:
        context.set_trailing_metadata(((TRACEPARENT, header),))
    return span


class TracingInterceptor(HandlerWrapper):
    """A server span per RPC, continuing the W3C trace the caller sent.

    The context comes from the call's metadata; a stream opened ahead of its
    requests carries none there, and its first request's parameters do (they
    are removed from every request: models never see them).
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self._silent = isinstance(tracer, trace.NoOpTracer)

    def passes(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> bool:
        """A call with no trace to continue, to a server that records none: its span
        would be an invalid one, so no span and no context are set up for it. (A
        bidirectional stream may carry its trace in its first request instead.)"""
        if not self._silent or (handler.request_streaming and handler.response_streaming):
            return False
        return not any(key == TRACEPARENT for key, _ in details.invocation_metadata or ())

    def wrap(
        self, behavior: Behavior, bidirectional: bool, details: grpc.HandlerCallDetails
    ) -> Behavior:
        method: str = details.method
        parent = extract_context(details.invocation_metadata)
        if bidirectional and _forwards(details.invocation_metadata):
            return self._forwarded(behavior, parent)
        if bidirectional:
            return around(behavior, functools.partial(self._first_request_span, method, parent))
        if inspect.isasyncgenfunction(behavior):
            return self._streamed(behavior, method, parent)
        return around(behavior, functools.partial(self._span, method, parent))

    def _start(
        self, method: str, parent: otel_context.Context, context: grpc.aio.ServicerContext[Any, Any]
    ) -> trace.Span:
        return start_server_span(self._tracer, method, parent, context)

    @contextlib.asynccontextmanager
    async def _span(
        self,
        method: str,
        parent: otel_context.Context,
        request: Any,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[Any]:
        span = self._start(method, parent, context)
        _label(span, request)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            with recorded(span):
                yield request
        finally:
            otel_context.detach(token)

    def _streamed(self, behavior: Behavior, method: str, parent: otel_context.Context) -> Behavior:
        # The span is current only while each response is produced: a token
        # attached across a yield might not be detachable (``iterate_in_context``).
        async def streamed(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            span = self._start(method, parent, context)
            _label(span, request)
            with recorded(span):
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in iterate_in_context(trace.set_span_in_context(span), items):
                        yield item

        return streamed

    @contextlib.asynccontextmanager
    async def _first_request_span(
        self,
        method: str,
        parent: otel_context.Context,
        requests: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[Any]:
        spans: list[trace.Span] = []

        def see(request: Any) -> None:
            parameters = getattr(request, "parameters", None)
            carried = pop_parameters_context(parameters) if parameters is not None else None
            if spans:
                return
            has_parent = trace.get_current_span(parent).get_span_context().is_valid
            span = self._start(
                method, parent if has_parent or carried is None else carried, context
            )
            _label(span, request)
            spans.append(span)
            # Current from here on in the task reading the requests, so the
            # tasks it starts for them run in the request's trace.
            otel_context.attach(trace.set_span_in_context(span))

        try:
            yield SeenRequests(requests, see)
        except BaseException as exc:
            for span in spans:
                _record(span, exc)
            raise
        finally:
            for span in spans:
                span.end()

    def _forwarded(self, behavior: Behavior, parent: otel_context.Context) -> Behavior:
        """A stream of forwarded unary requests (``FORWARD_HEADER``; one to a
        message, or several: ``shared.forwarding.Pack``): each request
        gets the server span a ModelInfer of its own would have had, from the
        trace context its parameters carry, current in the task that answers it
        and ended as its answer is written; the stream itself has none."""

        def scope(requests: AsyncIterator[Any], context: Any) -> tuple[Any, _Answering]:
            spans: dict[str, trace.Span] = {}

            def enter(request: Any) -> None:
                # Current from here on in the task reading the requests, which
                # then starts the request's own task (it inherits the context).
                otel_context.attach(self._request_context(request, parent, spans))

            def see(message: Any) -> None:
                if isinstance(message, Pack):
                    message.before_each = enter  # each as it is taken from the pack
                else:
                    enter(message)

            return SeenRequests(requests, see), _Answering(context, spans)

        if inspect.isasyncgenfunction(behavior):

            async def streamed(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                seen, answering = scope(requests, context)
                try:
                    async with contextlib.aclosing(behavior(seen, answering)) as items:
                        async for item in items:
                            answering.answered(item)
                            yield item
                finally:
                    answering.end_unanswered()

            return streamed

        async def written(requests: AsyncIterator[Any], context: Any) -> Any:
            seen, answering = scope(requests, context)
            try:
                return await behavior(seen, answering)
            finally:
                answering.end_unanswered()

        return written

    def _request_context(
        self, request: Any, parent: otel_context.Context, spans: dict[str, trace.Span]
    ) -> otel_context.Context:
        """The context a forwarded request runs in: its own server span's, when its
        trace is sampled here; its caller's context when not (the ids still reach
        the logs); the stream's when it carries none."""
        carried = pop_parameters_context(request.parameters)
        if carried is None:
            return parent
        caller = trace.get_current_span(carried)
        if self._silent or not caller.get_span_context().trace_flags.sampled:
            return carried
        span = self._tracer.start_span(
            FORWARDED_METHOD, context=carried, kind=SpanKind.SERVER, attributes=_FORWARDED
        )
        _label(span, request)
        spans[request.id] = span
        return trace.set_span_in_context(span)


FORWARDED_METHOD = "inference.GRPCInferenceService/ModelInfer"
"""The span name of a forwarded request: the RPC it stands for."""
_FORWARDED = {"rpc.system": "grpc", "rpc.service": "inference.GRPCInferenceService"}
_FORWARDED |= {"rpc.method": "ModelInfer"}


def _forwards(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """True for a stream whose caller forwards unary requests on it."""
    return any(k == FORWARD_HEADER and v == FORWARD_UNARY for k, v in metadata or ())


class _Answering:
    """A forwarded stream's servicer context whose ``write`` ends the span of the
    request that the message answers (by the request's id, which its answer
    echoes), with an error status for an in-band error; anything else is the
    real context's."""

    def __init__(self, context: Any, spans: dict[str, trace.Span]) -> None:
        self._context = context
        self._spans = spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        """End the answered request's span, then write its answer."""
        self.answered(message)
        await self._context.write(message)

    def answered(self, message: Any) -> None:
        """End the span of the request ``message`` (a ModelStreamInferResponse, or
        a list of them: a packed stream's) answers."""
        if not self._spans:
            return
        if isinstance(message, list):
            for answer in message:
                self.answered(answer)
            return
        span = self._spans.pop(message.infer_response.id, None)
        if span is None:
            return
        if message.error_message:
            span.set_status(Status(StatusCode.ERROR, message.error_message))
        span.end()

    def end_unanswered(self) -> None:
        """End the spans of the requests left unanswered (the stream ended first)."""
        for span in self._spans.values():
            span.end()
        self._spans.clear()


def _label(span: trace.Span, request: Any) -> None:
    """Name the model a request asks for on its span: a trace is found by its model."""
    model = getattr(request, "model_name", None) or getattr(request, "model", None)
    if isinstance(model, str) and model:
        span.set_attribute("meshserve.model", model)


@contextlib.contextmanager
def recorded(span: trace.Span) -> Iterator[trace.Span]:
    """Ends ``span``, recording the exception that ends the call, if any."""
    try:
        yield span
    except BaseException as exc:
        _record(span, exc)
        raise
    finally:
        span.end()


def _record(span: trace.Span, exc: BaseException) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        span.set_status(Status(StatusCode.ERROR, "aborted"))
    elif isinstance(exc, MeshError):
        span.set_status(Status(StatusCode.ERROR, exc.message))
        span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
    elif isinstance(exc, Exception):
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    # Cancellation or a closed stream: gRPC ended the call, nothing failed here.


class _ClientBase:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _details(
        self, details: grpc.aio.ClientCallDetails, span: trace.Span
    ) -> grpc.aio.ClientCallDetails:
        metadata = inject_metadata(list(details.metadata or ()), trace.set_span_in_context(span))
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )

    def _span(self, details: grpc.aio.ClientCallDetails) -> trace.Span:
        current = trace.get_current_span()
        if not current.get_span_context().is_valid:
            # A call made outside any trace (discovery, a stream opened ahead of
            # its requests) starts no trace of its own.
            return trace.INVALID_SPAN
        if getattr(current, "kind", None) is SpanKind.CLIENT or not current.is_recording():
            # The caller's span is already this call's client span (an ensemble
            # step's), or the trace is not sampled: pass its context on as is
            # (ending this stand-in ends nothing).
            return trace.NonRecordingSpan(current.get_span_context())
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, name = _split(method)
        return self._tracer.start_span(
            method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )


class ClientUnaryInterceptor(_ClientBase, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Opens a client span and sends its ``traceparent`` with unary calls."""

    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Req], Awaitable[grpc.aio.UnaryUnaryCall[Req, Resp]]
        ],
        details: grpc.aio.ClientCallDetails,
        request: Req,
    ) -> grpc.aio.UnaryUnaryCall[Req, Resp]:
        span = self._span(details)
        try:
            call = await continuation(self._details(details, span), request)
            # Read the outcome without raising: the caller gets the call as it
            # is and turns a failure into the error tree (``shared.rpc``).
            try:
                code = await call.code()
            except asyncio.CancelledError:
                # The caller went away while the call ran: this task is what grpc
                # cancels, and waiting for the code does not end the call, so
                # the server would go on with a request nobody waits for.
                call.cancel()
                raise
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, await call.details() or ""))
            return call
        finally:
            span.end()


class ClientUnaryStreamInterceptor(_ClientBase, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends ``traceparent`` with server-streaming calls; the span covers the set-up."""

    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Req], Awaitable[grpc.aio.UnaryStreamCall[Req, Resp]]
        ],
        details: grpc.aio.ClientCallDetails,
        request: Req,
    ) -> grpc.aio.UnaryStreamCall[Req, Resp]:
        span = self._span(details)
        try:
            return await continuation(self._details(details, span), request)
        finally:
            span.end()


class ClientStreamStreamInterceptor(_ClientBase, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Sends ``traceparent`` with bidirectional calls; the span covers the set-up."""

    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[Req] | Iterable[Req]],
            Awaitable[grpc.aio.StreamStreamCall[Req, Resp]],
        ],
        details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[Req] | Iterable[Req],
    ) -> grpc.aio.StreamStreamCall[Req, Resp]:
        span = self._span(details)
        try:
            return await continuation(self._details(details, span), request_iterator)
        finally:
            span.end()


def client_interceptors(tracer: trace.Tracer) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a ``grpc.aio`` channel that propagate the trace.

    One class per call kind: a channel files each interceptor under the first
    kind it implements, so one class serving two kinds would miss the second.
    """
    return [
        ClientUnaryInterceptor(tracer),
        ClientUnaryStreamInterceptor(tracer),
        ClientStreamStreamInterceptor(tracer),
    ]
