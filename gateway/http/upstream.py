"""The orchestrator, as the adapter sees it: KServe v2 gRPC over a pool of channels.

Each call goes to the next channel in turn (one HTTP/2 connection caps
throughput under load), carries the current trace context as W3C
``traceparent`` metadata (the shared client interceptors open a client span
under the adapter's server span), and has a deadline. A failed call is
re-raised as the ``shared.errors`` class of its status, so the HTTP status
comes from the same tree that produced the gRPC one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.channels import open_channels
from shared.errors import MeshError, error_for_status
from shared.servicer import until_final


class Upstream:
    """KServe v2 calls to one orchestrator address, round robin over ``channels``."""

    def __init__(
        self,
        target: str,
        *,
        channels: int,
        max_message_bytes: int,
        timeout_s: float,
        tracer: trace.Tracer,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channels = open_channels(target, channels, max_message_bytes, tracer)
        self._stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in self._channels]  # type: ignore[no-untyped-call]
        self._next = itertools.cycle(range(channels))

    async def call(self, method: str, request: Message) -> Any:
        """``GRPCInferenceService/<method>(request)``; a failure raises its MeshError."""
        stub = self._stubs[next(self._next)]
        try:
            return await getattr(stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self.failure(exc) from exc

    async def stream_infer(
        self, request: pb.ModelInferRequest
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """One request's responses over ``ModelStreamInfer`` (a decoupled model), up to
        its final one. An in-stream error or a failed call raises its MeshError;
        closing the generator early cancels the call, and with it the generation."""
        stub = self._stubs[next(self._next)]
        call = stub.ModelStreamInfer(iter([request]), timeout=self.timeout_s)
        try:
            async for response in until_final(call):
                yield response
        except grpc.aio.AioRpcError as exc:
            raise self.failure(exc) from exc
        finally:
            call.cancel()  # a no-op once the call has ended

    def failure(self, exc: grpc.aio.AioRpcError) -> MeshError:
        """A failed call to the orchestrator as the MeshError of its status."""
        code = exc.code()
        details = exc.details() or code.name.lower()
        if code == grpc.StatusCode.UNAVAILABLE:
            details = f"orchestrator {self.target}: {details}"
        return error_for_status(code, details)

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        """The pool's channels (for stubs of other services on the orchestrator)."""
        return list(self._channels)

    async def close(self) -> None:
        """Close every channel (calls still open are cancelled)."""
        await asyncio.gather(*(channel.close() for channel in self._channels))
