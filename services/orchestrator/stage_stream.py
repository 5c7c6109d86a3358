"""ModelStreamInfer calls to a stage replica, some opened ahead of their requests.

Setting a stream up costs both ends far more than one more message on an open
one (docs/performance.md has the figures); a chat request opens three (tokenizer, generation,
detokenizer). So each replica keeps a few streams opened ahead, with no
request yet (``Endpoint.spares``): a request takes one, and a new one is opened
when a stream is released, after the request that used it.

A stream opened ahead belongs to no request, so its metadata carries no trace
context and no deadline. Every request sent on any stage stream carries its
trace context in its parameters instead (the stage starts its span from it,
shared/trace_interceptors.py), and the caller's deadline reaches the stage as a
cancel: the orchestrator's handler is cancelled when its caller's deadline
passes, and it cancels the streams it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from opentelemetry import context as otel_context

from inference import grpc_service_pb2 as pb
from shared.errors import Unavailable
from shared.rpc import remote
from shared.tracing import inject_parameters

if TYPE_CHECKING:
    from inference.grpc_service_pb2_grpc import GRPCInferenceServiceAsyncStub as Stub


class StageStream:
    """One ModelStreamInfer call whose requests are written from a queue."""

    def __init__(self, stub: Stub) -> None:
        self._outgoing: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()
        self.on_release: Callable[[], None] | None = None
        """Set by whoever takes the stream for a request: runs once, when it ends."""
        # Opened outside any request's trace: the client interceptor then sends
        # no traceparent, and each request brings its own (send()).
        token = otel_context.attach(otel_context.Context())
        try:
            self._call = stub.ModelStreamInfer(self._requests())
        finally:
            otel_context.detach(token)

    async def _requests(self) -> AsyncIterator[pb.ModelInferRequest]:
        while (request := await self._outgoing.get()) is not None:
            yield request

    @property
    def alive(self) -> bool:
        """False once the call has ended (its replica went away or drained)."""
        return not self._call.done()

    def send(self, request: pb.ModelInferRequest) -> None:
        """Queue ``request``, with the current trace context in its parameters."""
        inject_parameters(request.parameters)
        self._outgoing.put_nowait(request)

    async def read(self) -> pb.ModelStreamInferResponse | None:
        """The next message; None once the stage has ended the stream (OK). A
        failed stream raises its MeshError."""
        with remote():
            message = await self._call.read()
        if message is grpc.aio.EOF:
            return None
        response: pb.ModelStreamInferResponse = message
        return response

    async def ask(self, request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
        """Send ``request`` and read its answer (the stream has nothing else in flight)."""
        self.send(request)
        message = await self.read()
        if message is None:
            raise Unavailable(f"model '{request.model_name}': the stage ended the stream")
        return message

    def done_sending(self) -> None:
        """Half-close: the stage ends the call (OK) once it has answered everything."""
        self._outgoing.put_nowait(None)

    def close(self) -> None:
        """End the stream cleanly and release it. (A cancel would interrupt the
        call's request writer mid-await, which gRPC logs with a formatted
        traceback: CPU per stream for nothing.)"""
        self.done_sending()
        self._release()

    def cancel(self) -> None:
        """Cancel the call (the stage stops the request's work) and release it."""
        self._call.cancel()
        self._release()

    def _release(self) -> None:
        on_release, self.on_release = self.on_release, None
        if on_release is not None:
            on_release()
