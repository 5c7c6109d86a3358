"""OTLP in: the gRPC ``TraceService`` and the OTLP/HTTP handler, translation only.

Both decode an ``ExportTraceServiceRequest`` and hand it to ``Intake``, which
stores the spans and, where configured, forwards the batch to another
collector (the batch is forwarded as received, in a task the intake owns).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from services.tracestore.spans import records
from services.tracestore.store import TraceStore

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 5.0
MAX_FORWARDS_IN_FLIGHT = 64
"""Beyond this many batches on their way to the forward endpoint, new ones are dropped."""
PROTOBUF = "application/x-protobuf"


class Intake:
    """Where received batches go: the store, and the forward endpoint if any."""

    def __init__(self, store: TraceStore, forward_endpoint: str | None) -> None:
        self.store = store
        self._channel = grpc.aio.insecure_channel(forward_endpoint) if forward_endpoint else None
        self._forward = (
            trace_service_pb2_grpc.TraceServiceStub(self._channel)  # type: ignore[no-untyped-call]
            if self._channel
            else None
        )
        self._tasks: set[asyncio.Task[None]] = set()

    async def accept(self, request: ExportTraceServiceRequest) -> None:
        """Store the batch's spans (and forward it)."""
        if self._forward is not None and len(self._tasks) < MAX_FORWARDS_IN_FLIGHT:
            task = asyncio.create_task(self._send(request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # Decoded in the store's thread, as it writes: a large batch would hold the event loop.
        await self.store.receive(records(request))

    async def _send(self, request: ExportTraceServiceRequest) -> None:
        assert self._forward is not None
        try:
            await self._forward.Export(request, timeout=FORWARD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("forwarding spans failed: %s", exc.details())

    async def close(self) -> None:
        """Wait briefly for batches still being forwarded, then close the channel."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=FORWARD_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()
        if self._channel is not None:
            await self._channel.close()


class OtlpTraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """OTLP/gRPC ``TraceService.Export``."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake

    async def Export(self, request: ExportTraceServiceRequest, context: Any) -> Any:
        """Store one batch."""
        await self._intake.accept(request)
        return ExportTraceServiceResponse()


def otlp_http_routes(intake: Intake) -> list[web.RouteDef]:
    """OTLP/HTTP: ``POST /v1/traces`` with a protobuf body."""

    async def export(request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            raise web.HTTPUnsupportedMediaType(
                text=f"POST /v1/traces takes Content-Type {PROTOBUF} (OTLP/HTTP protobuf), "
                f"not {request.content_type or 'none'}"
            )
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(await request.read())
        except DecodeError as exc:
            raise web.HTTPBadRequest(text=f"not an ExportTraceServiceRequest: {exc}") from exc
        await intake.accept(message)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type=PROTOBUF)

    return [web.post("/v1/traces", export)]
