"""The orchestrator, as the adapter sees it: typed gRPC calls over a pool of channels.

``Upstream`` makes the KServe v2 calls (``inference.GRPCInferenceService``),
``MeshClient`` the ``meshserve.v1.MeshService`` ones the OpenAI routes need;
both go over the same channels. Each call goes to the next channel in turn
(one HTTP/2 connection caps throughput under load), carries the current trace
context as W3C ``traceparent`` metadata (the shared client interceptors open a
client span under the adapter's server span), and has a deadline. A failed
call leaves through ``shared.rpc`` as the ``shared.errors`` class of its
status, so the HTTP status comes from the same tree that produced the gRPC
one; UNAVAILABLE names the orchestrator, since the caller cannot tell which
hop is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from meshserve.v1 import meshserve_pb2 as api
from meshserve.v1 import meshserve_pb2_grpc as api_grpc
from shared.channels import open_channels
from shared.errors import Unavailable
from shared.rpc import remote
from shared.stream_messages import until_final


class Upstream:
    """KServe v2 calls to one orchestrator address, round robin over its channels."""

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
        self._next = itertools.cycle(self._stubs)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Run calls to the orchestrator; a failed one raises its MeshError, and
        UNAVAILABLE says which orchestrator could not be reached."""
        try:
            with remote():
                yield
        except Unavailable as exc:
            raise Unavailable(f"orchestrator {self.target}: {exc.message}") from exc.__cause__

    def _stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        return next(self._next)

    async def server_ready(self) -> pb.ServerReadyResponse:
        """``ServerReady``."""
        with self.calling():
            reply: pb.ServerReadyResponse = await self._stub().ServerReady(
                pb.ServerReadyRequest(), timeout=self.timeout_s
            )
        return reply

    async def server_metadata(self) -> pb.ServerMetadataResponse:
        """``ServerMetadata``."""
        with self.calling():
            reply: pb.ServerMetadataResponse = await self._stub().ServerMetadata(
                pb.ServerMetadataRequest(), timeout=self.timeout_s
            )
        return reply

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        """``ModelMetadata``."""
        with self.calling():
            reply: pb.ModelMetadataResponse = await self._stub().ModelMetadata(
                request, timeout=self.timeout_s
            )
        return reply

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        """``ModelReady``."""
        with self.calling():
            reply: pb.ModelReadyResponse = await self._stub().ModelReady(
                request, timeout=self.timeout_s
            )
        return reply

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        """``ModelConfig``."""
        with self.calling():
            reply: pb.ModelConfigResponse = await self._stub().ModelConfig(
                request, timeout=self.timeout_s
            )
        return reply

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        """``ModelStatistics``."""
        with self.calling():
            reply: pb.ModelStatisticsResponse = await self._stub().ModelStatistics(
                request, timeout=self.timeout_s
            )
        return reply

    async def repository_index(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        """``RepositoryIndex``."""
        with self.calling():
            reply: pb.RepositoryIndexResponse = await self._stub().RepositoryIndex(
                request, timeout=self.timeout_s
            )
        return reply

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        """``RepositoryModelLoad``."""
        with self.calling():
            reply: pb.RepositoryModelLoadResponse = await self._stub().RepositoryModelLoad(
                request, timeout=self.timeout_s
            )
        return reply

    async def unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        """``RepositoryModelUnload``."""
        with self.calling():
            reply: pb.RepositoryModelUnloadResponse = await self._stub().RepositoryModelUnload(
                request, timeout=self.timeout_s
            )
        return reply

    async def log_settings(self, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
        """``LogSettings`` (read, or change and read back)."""
        with self.calling():
            reply: pb.LogSettingsResponse = await self._stub().LogSettings(
                request, timeout=self.timeout_s
            )
        return reply

    async def trace_setting(self, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
        """``TraceSetting`` (read, or change and read back)."""
        with self.calling():
            reply: pb.TraceSettingResponse = await self._stub().TraceSetting(
                request, timeout=self.timeout_s
            )
        return reply

    async def region_status(
        self, request: pb.SystemSharedMemoryStatusRequest
    ) -> pb.SystemSharedMemoryStatusResponse:
        """``SystemSharedMemoryStatus``."""
        with self.calling():
            reply: pb.SystemSharedMemoryStatusResponse = (
                await self._stub().SystemSharedMemoryStatus(request, timeout=self.timeout_s)
            )
        return reply

    async def region_register(self, request: pb.SystemSharedMemoryRegisterRequest) -> None:
        """``SystemSharedMemoryRegister``."""
        with self.calling():
            await self._stub().SystemSharedMemoryRegister(request, timeout=self.timeout_s)

    async def region_unregister(self, request: pb.SystemSharedMemoryUnregisterRequest) -> None:
        """``SystemSharedMemoryUnregister``."""
        with self.calling():
            await self._stub().SystemSharedMemoryUnregister(request, timeout=self.timeout_s)

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """``ModelInfer``."""
        with self.calling():
            reply: pb.ModelInferResponse = await self._stub().ModelInfer(
                request, timeout=self.timeout_s
            )
        return reply

    async def stream_infer(
        self, request: pb.ModelInferRequest
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """One request's responses over ``ModelStreamInfer`` (a decoupled model), up to
        its final one. An in-stream error or a failed call raises its MeshError;
        closing the generator early cancels the call, and with it the generation."""
        call = self._stub().ModelStreamInfer(iter([request]), timeout=self.timeout_s)
        try:
            with self.calling():
                async for response in until_final(call):
                    yield response
        finally:
            call.cancel()  # a no-op once the call has ended

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        """The pool's channels (for stubs of other services on the orchestrator)."""
        return list(self._channels)

    async def close(self) -> None:
        """Close every channel (calls still open are cancelled)."""
        await asyncio.gather(*(channel.close() for channel in self._channels))


class MeshClient:
    """``meshserve.v1.MeshService`` over the adapter's channels to the orchestrator."""

    def __init__(self, upstream: Upstream) -> None:
        # The KServe v2 client's pool: same connections, tracing interceptors and deadline.
        self._upstream = upstream
        stubs = [api_grpc.MeshServiceStub(c) for c in upstream.channels]  # type: ignore[no-untyped-call]
        self._next = itertools.cycle(stubs)

    def _stub(self) -> api_grpc.MeshServiceStub:
        return next(self._next)

    async def embed(self, request: api.EmbedRequest) -> api.EmbedResponse:
        """``Embed``."""
        with self._upstream.calling():
            reply: api.EmbedResponse = await self._stub().Embed(
                request, timeout=self._upstream.timeout_s
            )
        return reply

    async def list_models(self, request: api.ListModelsRequest) -> api.ListModelsResponse:
        """``ListModels``."""
        with self._upstream.calling():
            reply: api.ListModelsResponse = await self._stub().ListModels(
                request, timeout=self._upstream.timeout_s
            )
        return reply

    async def tokenize(self, request: api.TokenizeRequest) -> api.TokenizeResponse:
        """``Tokenize``."""
        with self._upstream.calling():
            reply: api.TokenizeResponse = await self._stub().Tokenize(
                request, timeout=self._upstream.timeout_s
            )
        return reply

    async def detokenize(self, request: api.DetokenizeRequest) -> api.DetokenizeResponse:
        """``Detokenize``."""
        with self._upstream.calling():
            reply: api.DetokenizeResponse = await self._stub().Detokenize(
                request, timeout=self._upstream.timeout_s
            )
        return reply

    def chat(self, request: api.ChatRequest) -> AsyncGenerator[api.TextDelta, None]:
        """The TextDeltas of a streaming ``Chat``."""
        return self._deltas(lambda stub: stub.Chat(request, timeout=self._upstream.timeout_s))

    def generate(self, request: api.GenerateRequest) -> AsyncGenerator[api.TextDelta, None]:
        """The TextDeltas of a streaming ``Generate``."""
        return self._deltas(lambda stub: stub.Generate(request, timeout=self._upstream.timeout_s))

    async def _deltas(self, start: Callable[[Any], Any]) -> AsyncGenerator[api.TextDelta, None]:
        # The call starts on the first delta asked for, so a stream never read opens none.
        call = start(self._stub())
        try:
            with self._upstream.calling():
                async for response in call:
                    yield response.delta
        finally:
            # A no-op after the last delta; otherwise the client went away (or we
            # failed), and cancelling the RPC makes the engine abort the generation.
            call.cancel()
