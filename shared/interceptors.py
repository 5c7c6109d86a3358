"""Server interceptors, one concern each, and the base they share.

The server composes three, outermost first (``shared.server``)::

    ErrorInterceptor     a MeshError becomes its status with its message; any
                         other exception becomes INTERNAL with a generic
                         message while the traceback goes to the log
    TracingInterceptor   the RPC's server span, continuing the caller's trace
                         (``shared.trace_interceptors``)
    DrainGate            refuses new RPCs while draining; counts those in flight

so no handler carries its own try/except, a refused RPC still shows in its
trace, and the gate counts only RPCs that reached a handler. Each wraps a
handler without changing its kind: a streaming handler may be an async
generator or a coroutine that writes with ``context.write`` (grpc's health
Watch). A bidirectional stream starts its span and its in-flight count with its
first request, not when it opens: the orchestrator keeps streams open ahead of
their requests, and an idle one is no work to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

from shared.errors import GENERIC_INTERNAL_MESSAGE, InvalidArgument, MeshError, Unavailable

log = logging.getLogger(__name__)

Behavior = Callable[..., Any]
"""A handler: a coroutine function, or an async generator function for streams."""
Scope = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AbstractAsyncContextManager[Any]]
"""Runs around one call; yields the request (or request stream) to pass on."""

# RPCs that keep working while the server drains, so probes see NOT_SERVING
# instead of a refused call.
_ALWAYS_ALLOWED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class HandlerWrapper(grpc.aio.ServerInterceptor):  # type: ignore[misc]
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


class SeenRequests:
    """A request stream that shows each request to ``see`` before passing it on
    (``see`` may raise to refuse the stream)."""

    def __init__(self, requests: AsyncIterator[Any], see: Callable[[Any], None]) -> None:
        self._requests = requests
        self._see = see

    def __aiter__(self) -> SeenRequests:
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


class ErrorInterceptor(HandlerWrapper):
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


class DrainGate(HandlerWrapper):
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
            yield SeenRequests(requests, see)
        finally:
            if admitted:
                self.release()
