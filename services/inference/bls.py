"""Requests a python model makes of other models (Triton's BLS), and the bridge to them.

A model on this stage is called in-process, through its ``ModelVersion``
(validation, batcher, statistics, as any caller); any other model of the mesh
is called through the orchestrator over gRPC, so it may live on another stage,
be an ensemble, or run on another host. Model code runs in instance threads
(or an instance's own event loop), and these calls run on the stage's event
loop: ``run`` and ``submit`` carry a coroutine across.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.channels import open_channels
from shared.errors import FailedPrecondition, MeshError, NotFound
from shared.manager import ModelManager
from shared.model import ModelVersion
from shared.request import InferRequest, InferResponse
from shared.rpc import remote, remote_stream
from shared.stream_messages import EMPTY_FINAL_RESPONSE, is_final, until_final
from shared.tensors import decode_outputs, encode_inputs, set_parameter

T = TypeVar("T")


class ModelCaller:
    """Runs BLS requests: on this stage in-process, elsewhere through the orchestrator."""

    def __init__(
        self, manager: ModelManager, orchestrator: str | None, max_message_bytes: int
    ) -> None:
        self.manager = manager
        self.orchestrator = orchestrator
        self._limit = max_message_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None

    async def start(self) -> None:
        """Bind to the running (the stage's) event loop."""
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        """Close the channel to the orchestrator."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- from model threads ----------------------------------------------------------

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``work`` on the stage's loop; its future, for any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            work.close()
            raise FailedPrecondition("BLS requests are only served while the stage runs")
        if _running_loop() is loop:
            work.close()
            raise FailedPrecondition("a BLS request cannot wait on the stage's own event loop")
        return asyncio.run_coroutine_threadsafe(work, loop)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the stage's loop and wait for its result (blocking this thread)."""
        return self.submit(work).result()

    # -- on the stage's loop ---------------------------------------------------------

    async def infer(self, request: InferRequest, timeout_s: float | None) -> InferResponse:
        """One response from the model ``request`` names."""
        local = self._local(request)
        if local is not None:
            return await asyncio.wait_for(local.infer(request), timeout_s)
        with remote():
            answer = await self._stub().ModelInfer(_to_proto(request), timeout=timeout_s)
        return InferResponse(outputs=decode_outputs(answer))

    async def stream(
        self, request: InferRequest, timeout_s: float | None
    ) -> AsyncIterator[InferResponse]:
        """Every response of a (decoupled) model to ``request``, the last one final."""
        local = self._local(request)
        if local is not None:
            async with contextlib.aclosing(local.stream(request)) as responses:
                async for response in responses:
                    yield response
            return
        message = _to_proto(request)
        message.parameters[EMPTY_FINAL_RESPONSE].bool_param = True  # the end, said plainly
        call = self._stub().ModelStreamInfer(timeout=timeout_s)
        try:
            with remote():
                await call.write(message)
                await call.done_writing()
            async for answer in until_final(remote_stream(call)):
                yield InferResponse(outputs=decode_outputs(answer), final=is_final(answer))
        finally:
            call.cancel()

    async def model_ready(self, name: str, version: str) -> bool:
        """True when ``name`` (at ``version``) serves here or through the orchestrator."""
        with contextlib.suppress(MeshError):
            if self.manager.get(name, version).ready:
                return True
        if self.orchestrator is None:
            return False
        try:
            with remote():
                answer = await self._stub().ModelReady(
                    pb.ModelReadyRequest(name=name, version=version), timeout=10
                )
        except MeshError:
            return False
        return bool(answer.ready)

    async def load(self, name: str, config: str | None) -> None:
        """Load ``name`` on the mesh (through the orchestrator, which finds its stage)."""
        request = pb.RepositoryModelLoadRequest(model_name=name)
        if config:
            request.parameters["config"].string_param = config
        if self.orchestrator is None:
            await self.manager.load(name, config)
            return
        await self._admin(self._stub().RepositoryModelLoad(request, timeout=300))

    async def unload(self, name: str) -> None:
        """Unload ``name`` on the mesh."""
        if self.orchestrator is None:
            await self.manager.unload(name)
            return
        request = pb.RepositoryModelUnloadRequest(model_name=name)
        await self._admin(self._stub().RepositoryModelUnload(request, timeout=60))

    @staticmethod
    async def _admin(call: Any) -> None:
        with remote():
            await call

    def _local(self, request: InferRequest) -> ModelVersion | None:
        """The version on this stage that serves ``request``; None: ask the orchestrator."""
        try:
            version = self.manager.get(request.model_name, request.model_version)
        except MeshError:
            if self.orchestrator is None:
                raise NotFound(
                    f"Request for unknown model: '{request.model_name}' is not found "
                    "(it is not on this stage, and the stage has no orchestrator for BLS)"
                ) from None
            return None
        return version

    def _stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        if self._channel is None:
            assert self.orchestrator is not None
            tracer = trace.get_tracer("meshserve.bls")
            (self._channel,) = open_channels(self.orchestrator, 1, self._limit, tracer)
        return pb_grpc.GRPCInferenceServiceStub(self._channel)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _to_proto(request: InferRequest) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    encode_inputs(message, request.inputs)
    for name in request.requested_outputs or ():
        message.outputs.add(name=name)
    for key, value in request.parameters.items():
        set_parameter(message.parameters, key, value)
    return message
