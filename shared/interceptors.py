"""Server and client interceptors, one concern each.

The server composes three, outermost first (``shared.server``)::

    ErrorInterceptor     a MeshError becomes its status with its message; any
                         other exception becomes INTERNAL with a generic
                         message while the traceback goes to the log
    TracingInterceptor   the RPC's server span, continuing the caller's trace
    DrainGate            refuses new RPCs while draining; counts those in flight

so no handler carries its own try/except, a refused RPC still shows in its
trace, and the gate counts only RPCs that reached a handler. Each wraps a
handler without changing its kind: a streaming handler may be an async
generator or a coroutine that writes with ``context.write`` (grpc's health
Watch). A bidirectional stream starts its span and its in-flight count with its
first request, not when it opens: the orchestrator keeps streams open ahead of
their requests, and an idle one is no work to wait for.

The client interceptors carry the trace to the next hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.errors import GENERIC_INTERNAL_MESSAGE, InvalidArgument, MeshError, Unavailable
from shared.forwarding import FORWARD_HEADER, FORWARD_UNARY, Pack
from shared.trace_ids import TRACEPARENT, traceparent
from shared.tracing import (
    extract_context,
    inject_metadata,
    iterate_in_context,
    pop_parameters_context,
)

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

Behavior = Callable[..., Any]
"""A handler: a coroutine function, or an async generator function for streams."""
Scope = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AbstractAsyncContextManager[Any]]
"""Runs around one call; yields the request (or request stream) to pass on."""

# RPCs that keep working while the server drains, so probes see NOT_SERVING
# instead of a refused call.
_ALWAYS_ALLOWED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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


class _HandlerWrapper(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Base of the server interceptors: wraps the handler the server found.

    An interceptor whose wrapping depends on the method alone (``by_method``)
    keeps the last handler it made for each method, so an RPC allocates no
    new one while the handler it wraps stays the same.
    """

    by_method = False
    _made: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]]

    def passes(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> bool:
        """True when this call needs nothing of this interceptor (default: never)."""
        return False

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or self.passes(details, handler):
            return handler
        if self.by_method:
            made = self._made.get(details.method)
            if made is not None and made[0] is handler:
                return made[1]
        wrap = functools.partial(self.wrap, details=details)
        wrapped = _rewrapped(handler, wrap, self.deserializer(handler))
        if self.by_method:
            self._made[details.method] = (handler, wrapped)
        return wrapped

    def deserializer(self, handler: grpc.RpcMethodHandler[Any, Any]) -> Any:
        """The request deserializer to run (default: the handler's own)."""
        return handler.request_deserializer

    def wrap(
        self, behavior: Behavior, bidirectional: bool, details: grpc.HandlerCallDetails
    ) -> Behavior:
        """The handler as this interceptor runs it."""
        raise NotImplementedError


def _rewrapped(
    handler: grpc.RpcMethodHandler[Any, Any],
    wrap: Callable[[Behavior, bool], Behavior],
    deserializer: Any,
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with its behaviour passed through ``wrap`` and ``deserializer``
    for requests, of the same call kind."""
    codecs = {
        "request_deserializer": deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **codecs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **codecs)
    return handler  # no behaviour at all: nothing to wrap


def around(behavior: Behavior, scope: Scope) -> Behavior:
    """``behavior`` run inside ``scope``, still a generator if it was one."""
    if inspect.isasyncgenfunction(behavior):

        async def streamed(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async with (
                scope(request, context) as passed,
                contextlib.aclosing(behavior(passed, context)) as items,
            ):
                async for item in items:
                    yield item

        return streamed

    async def called(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async with scope(request, context) as passed:
            return await behavior(passed, context)

    return called


class _SeenRequests:
    """A request stream that shows each request to ``see`` before passing it on
    (``see`` may raise to refuse the stream)."""

    def __init__(self, requests: AsyncIterator[Any], see: Callable[[Any], None]) -> None:
        self._requests = requests
        self._see = see

    def __aiter__(self) -> _SeenRequests:
        return self

    async def __anext__(self) -> Any:
        request = await anext(self._requests)
        self._see(request)
        return request


class _Undecodable:
    """What a request that does not decode becomes (``ErrorInterceptor``): gRPC
    would answer UNKNOWN and log a traceback per request, before any handler
    or interceptor could say what was wrong."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _decoding(deserializer: Callable[[bytes], Any], streaming: bool) -> Callable[[bytes], Any]:
    """``deserializer`` answering a message that does not decode with an
    ``_Undecodable`` (a unary request: its handler has not started, so the
    error interceptor answers it) or an InvalidArgument (a stream's request: the
    handler reading it gets the error, and the interceptor maps it)."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    kind = getattr(descriptor, "full_name", "") or "request"
    message = f"the request is not a valid {kind} message"

    def decoded(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:
            log.info("%s (%d bytes): %s", message, len(raw), exc)
            if streaming:
                raise InvalidArgument(message) from None
            return _Undecodable(message)

    return decoded


class ErrorInterceptor(_HandlerWrapper):
    """The one error map: a handler's exception becomes the RPC's status (and a
    request that does not decode, INVALID_ARGUMENT)."""

    by_method = True

    def __init__(self) -> None:
        # One wrapper per deserializer, made on its first call: nothing new per RPC.
        self._decoders: dict[tuple[Any, bool], Callable[[bytes], Any]] = {}
        self._made = {}

    def deserializer(self, handler: grpc.RpcMethodHandler[Any, Any]) -> Any:
        """The handler's deserializer, answering a request that does not decode."""
        own = handler.request_deserializer
        if own is None:
            return None  # raw bytes: nothing to decode
        key = (own, handler.request_streaming)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._decoders[key] = _decoding(own, handler.request_streaming)
        return decoder

    def wrap(
        self, behavior: Behavior, bidirectional: bool, details: grpc.HandlerCallDetails
    ) -> Behavior:
        method: str = details.method
        if inspect.isasyncgenfunction(behavior):
            return around(behavior, functools.partial(_statuses, method))

        # A coroutine (every unary RPC): a plain try, which costs a call a few
        # microseconds less than a context manager around it.
        async def called(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if type(request) is _Undecodable:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            try:
                return await behavior(request, context)
            except Exception as exc:
                await _abort_for(exc, method, context)

        return called


@contextlib.asynccontextmanager
async def _statuses(
    method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    if type(request) is _Undecodable:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    try:
        yield request
    except Exception as exc:
        await _abort_for(exc, method, context)


async def _abort_for(
    exc: Exception, method: str, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    """End the call with the status ``exc`` stands for (raises AbortError)."""
    # Cancellation and a closed stream are BaseExceptions: gRPC's own, never here.
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler set its status itself
    if isinstance(exc, MeshError):
        await context.abort(exc.code, exc.message)
    log.error("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE)


class TracingInterceptor(_HandlerWrapper):
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
            yield _SeenRequests(requests, see)
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

            return _SeenRequests(requests, see), _Answering(context, spans)

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


class DrainGate(_HandlerWrapper):
    """Counts the RPCs in flight and, once closed, refuses new ones with UNAVAILABLE.

    Health and reflection pass untouched, so probes read NOT_SERVING while the
    server drains. ``idle()`` returns once no counted RPC is left, so a
    shutdown waits on an event rather than polling the count.
    """

    by_method = True

    def __init__(self) -> None:
        self._made = {}
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        """Refuse every RPC from now on (the ones in flight carry on)."""
        self.draining = True

    async def idle(self) -> None:
        """Return once no counted RPC is in flight."""
        await self._idle.wait()

    def wrap(
        self, behavior: Behavior, bidirectional: bool, details: grpc.HandlerCallDetails
    ) -> Behavior:
        if details.method.startswith(_ALWAYS_ALLOWED_PREFIXES):
            return behavior
        if bidirectional or inspect.isasyncgenfunction(behavior):
            return around(behavior, self._first_request if bidirectional else self._admitted)

        # A coroutine (every unary RPC): a plain try, as in ErrorInterceptor.
        async def admitted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.admit()
            try:
                return await behavior(request, context)
            finally:
                self.release()

        return admitted

    def admit(self) -> None:
        """Count a call in (UNAVAILABLE once closed): the wire door's calls come here too."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        """Count an admitted call out."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def _admitted(
        self, request: Any, _: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        self.admit()
        try:
            yield request
        finally:
            self.release()

    @contextlib.asynccontextmanager
    async def _first_request(
        self, requests: AsyncIterator[Any], _: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        admitted: list[bool] = []

        def see(_: Any) -> None:
            if not admitted:
                self.admit()
                admitted.append(True)

        try:
            yield _SeenRequests(requests, see)
        finally:
            if admitted:
                self.release()


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
