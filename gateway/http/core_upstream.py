"""The orchestrator's core, as the HTTP front door sees it when both share a process.

``CoreUpstream`` answers the KServe v2 calls of ``Upstream`` by calling the
core (services/orchestrator/core.py) on this event loop: no gRPC client, no
gRPC server, no second encoding of the request on the way. A stage model's
request is serialised once and forwarded to its stage as the v2 servicer
forwards one (``Orchestrator.forward``); an ensemble's or a route's runs in
the core. The answers and errors are the ones the v2 servicer would have
sent: the core raises the ``shared.errors`` classes the HTTP error map reads.

What only the v2 servicer itself holds (the server's metadata, its log and
trace settings) and the meshserve.v1 calls of ``MeshClient`` (the OpenAI
routes) still go over gRPC, to this same process's own port: they are not
on any hot path, and so stay answered in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from opentelemetry import trace

from gateway.http.upstream import Upstream
from inference import grpc_service_pb2 as pb
from services.orchestrator.core import Orchestrator
from shared.errors import DeadlineExceeded


class CoreUpstream(Upstream):
    """``Upstream`` over an in-process core; ``target`` is this process's own gRPC
    address (for the calls the core does not answer)."""

    def __init__(
        self,
        core: Orchestrator,
        target: str,
        *,
        channels: int,
        max_message_bytes: int,
        timeout_s: float,
        tracer: trace.Tracer,
    ) -> None:
        super().__init__(
            target,
            channels=channels,
            max_message_bytes=max_message_bytes,
            timeout_s=timeout_s,
            tracer=tracer,
        )
        self.core = core

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """``ModelInfer``, answered by the core; past ``timeout_s``, DeadlineExceeded."""
        name = request.model_name
        span = trace.get_current_span()
        if span.is_recording():  # a trace is found by its model, as on the gRPC doors
            span.set_attribute("meshserve.model", name)
        try:
            async with asyncio.timeout(self.timeout_s):
                if not self.core.forwards(name):
                    return await self.core.infer(request, self.timeout_s)
                # No deadline given: the core may carry it on an open stream, a
                # message where a unary call costs both ends several times more.
                answer = await self.core.forward(
                    name, request.SerializeToString(), request.id, None
                )
        except TimeoutError:
            raise DeadlineExceeded(
                f"model '{name}' did not answer within {self.timeout_s:g}s"
                " (request_timeout_s of the HTTP front door)"
            ) from None
        return pb.ModelInferResponse.FromString(answer)

    async def stream_infer(
        self, request: pb.ModelInferRequest
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """Every response to one request, up to its final one; closing the generator
        early closes the core's stream, which stops the generation."""
        responses = self.core.stream(request, self.timeout_s)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()

    async def server_ready(self) -> pb.ServerReadyResponse:
        """``ServerReady``."""
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        """``ModelReady``."""
        ready = await self.core.model_ready(request.name, request.version, self.timeout_s)
        return pb.ModelReadyResponse(ready=ready)

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        """``ModelMetadata``."""
        return await self.core.metadata(request.name, request.version, self.timeout_s)

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        """``ModelConfig``."""
        config = await self.core.config(request.name, request.version, self.timeout_s)
        return pb.ModelConfigResponse(config=config)

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        """``ModelStatistics``."""
        stats = await self.core.statistics(request.name, request.version, self.timeout_s)
        return pb.ModelStatisticsResponse(model_stats=stats)

    async def repository_index(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        """``RepositoryIndex``."""
        return pb.RepositoryIndexResponse(models=await self.core.index(request.ready))

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        """``RepositoryModelLoad``."""
        await self.core.load(request.model_name, request.parameters)
        return pb.RepositoryModelLoadResponse()

    async def unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        """``RepositoryModelUnload``."""
        await self.core.unload(request.model_name, request.parameters)
        return pb.RepositoryModelUnloadResponse()
