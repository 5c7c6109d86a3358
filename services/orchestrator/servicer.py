"""The orchestrator's v2 servicer: KServe v2 gRPC in front of the core.

Each RPC takes the caller's deadline from its context, calls the core
(core.py) and wraps the answer in the RPC's response; the core's errors
become statuses in the server interceptor. Nothing else happens here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol, TypeAlias, TypeVar

import grpc

from inference import grpc_service_pb2 as pb
from services.orchestrator.core import Orchestrator
from services.orchestrator.route_headers import announce_target, take_route_headers
from shared.servicer import BaseServicer

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
        super().__init__()
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
