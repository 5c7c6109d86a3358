"""The orchestrator's v2 servicer: KServe v2 gRPC in front of the core.

Each RPC takes the caller's deadline from its context, calls the core
(core.py) and wraps the answer in the RPC's response; the core's errors
become statuses in the server interceptor. Nothing else happens here.

ModelInfer is registered on serialised messages (``add_orchestrator``): a
stage model's request is forwarded as it is, after reading only its model
name from the wire (``shared.wireformat``), and the stage's answer goes back
untouched; decoding and encoding the tensors on the way cost the orchestrator
more than the routing. A route's or an ensemble's request is decoded and runs
in the core as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.orchestrator.core import Orchestrator
from services.orchestrator.route_headers import announce_target, take_route_headers
from shared.servicer import SERVICE_NAME, BaseServicer
from shared.wireformat import WireError, infer_header, infer_request

Request = TypeVar("Request")
Reply = TypeVar("Reply")
Context: TypeAlias = grpc.aio.ServicerContext[Request, Reply]


class Deadlined(Protocol):
    """What a front door knows of its caller's deadline (a gRPC servicer context)."""

    def time_remaining(self) -> float | None:
        """Seconds left (None: no deadline)."""
        ...


def timeout_of(context: Deadlined | None) -> float | None:
    """The caller's time left (None: no deadline)."""
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else max(0.001, remaining)


class OrchestratorServicer(BaseServicer):
    """GRPCInferenceService for every model in the mesh."""

    def __init__(self, core: Orchestrator) -> None:
        super().__init__(regions=core.regions)
        self.core = core

    async def ServerReady(
        self,
        request: pb.ServerReadyRequest,
        context: Context[pb.ServerReadyRequest, pb.ServerReadyResponse],
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def ModelReady(
        self,
        request: pb.ModelReadyRequest,
        context: Context[pb.ModelReadyRequest, pb.ModelReadyResponse],
    ) -> pb.ModelReadyResponse:
        ready = await self.core.model_ready(request.name, request.version, timeout_of(context))
        return pb.ModelReadyResponse(ready=ready)

    async def ModelMetadata(
        self,
        request: pb.ModelMetadataRequest,
        context: Context[pb.ModelMetadataRequest, pb.ModelMetadataResponse],
    ) -> pb.ModelMetadataResponse:
        return await self.core.metadata(request.name, request.version, timeout_of(context))

    async def ModelConfig(
        self,
        request: pb.ModelConfigRequest,
        context: Context[pb.ModelConfigRequest, pb.ModelConfigResponse],
    ) -> pb.ModelConfigResponse:
        config = await self.core.config(request.name, request.version, timeout_of(context))
        return pb.ModelConfigResponse(config=config)

    async def forward_infer(self, request: bytes, context: Context[bytes, bytes]) -> bytes:
        """ModelInfer on the serialised request: forwarded to the stage as it is
        when its model is a stage's, else decoded and answered by ``ModelInfer``.
        The wire door (shared/wire_door.py) calls it too, with a ``WireContext``."""
        try:
            header = infer_header(request)
        except WireError:
            header = None  # decoded below, which names what is wrong
        if header is not None:
            # The tracing interceptor saw bytes: name the model on the span here
            # (an ensemble's trace is found by its model too).
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attribute("meshserve.model", header.model_name)
        if header is not None and self.core.forwards(header.model_name):
            return await self.core.forward(
                header.model_name, request, header.id, timeout_of(context)
            )
        response = await self.ModelInfer(infer_request(request), context)
        return response.SerializeToString()

    async def ModelInfer(
        self,
        request: pb.ModelInferRequest,
        context: Context[pb.ModelInferRequest, pb.ModelInferResponse],
    ) -> pb.ModelInferResponse:
        take_route_headers(context, request)
        response = await self.core.infer(request, timeout_of(context))
        await announce_target(context, response)
        return response

    async def stream_responses(
        self,
        request: pb.ModelInferRequest,
        context: Context[pb.ModelInferRequest, pb.ModelStreamInferResponse],
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response to one request of a ModelStreamInfer stream."""
        take_route_headers(context, request)
        async with contextlib.aclosing(self.core.stream(request, timeout_of(context))) as responses:
            async for response in responses:
                yield response

    async def ModelStatistics(
        self,
        request: pb.ModelStatisticsRequest,
        context: Context[pb.ModelStatisticsRequest, pb.ModelStatisticsResponse],
    ) -> pb.ModelStatisticsResponse:
        stats = await self.core.statistics(request.name, request.version, timeout_of(context))
        return pb.ModelStatisticsResponse(model_stats=stats)

    async def RepositoryIndex(
        self,
        request: pb.RepositoryIndexRequest,
        context: Context[pb.RepositoryIndexRequest, pb.RepositoryIndexResponse],
    ) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=await self.core.index(request.ready))

    async def RepositoryModelLoad(
        self,
        request: pb.RepositoryModelLoadRequest,
        context: Context[pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse],
    ) -> pb.RepositoryModelLoadResponse:
        await self.core.load(request.model_name, request.parameters)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self,
        request: pb.RepositoryModelUnloadRequest,
        context: Context[pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse],
    ) -> pb.RepositoryModelUnloadResponse:
        await self.core.unload(request.model_name, request.parameters)
        return pb.RepositoryModelUnloadResponse()


class _Registrations:
    """Catches the method handlers the generated code registers on a server."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, _: Any) -> None:
        """The same handlers again, generically: ``handlers`` has them."""

    def add_registered_method_handlers(
        self, _: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        """Keep the handlers."""
        self.handlers = dict(handlers)


def add_orchestrator(servicer: OrchestratorServicer, server: grpc.aio.Server) -> None:
    """Register the v2 service, ModelInfer on serialised messages (``forward_infer``)."""
    caught = _Registrations()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, caught)
    handlers = caught.handlers
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(servicer.forward_infer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
