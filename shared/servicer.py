"""The KServe v2 servicer over a ModelManager: translation and nothing else.

Each RPC turns the proto into domain objects, calls the manager or a model
version, and turns the result back into a proto. Errors are raised as
``shared.errors`` classes and mapped to statuses by the server interceptor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Container, Sequence
from typing import Any

import grpc

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from inference import model_config_pb2 as mc
from shared.classification import Classification, classification
from shared.config import MAX_MESSAGE_BYTES
from shared.errors import (
    InvalidArgument,
    MeshError,
    Unimplemented,
)
from shared.forwarding import (
    FORWARD_HEADER,
    FORWARD_UNARY,
    add_forwarding,
    one_at_a_time,
    serve_forwarded,
)
from shared.manager import ModelManager
from shared.model import ModelVersion
from shared.request import InferRequest, InferResponse
from shared.shared_memory import HANDOFF_EXTENSION, REGION, SharedMemoryRegions
from shared.shared_memory_servicer import SharedMemoryMethods
from shared.statistics import Duration, ModelStats
from shared.stream_messages import (
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    fitting,
    stream_error,
    stream_failed,
)
from shared.stream_tasks import StreamTasks
from shared.tensors import decode_inputs, encode_outputs, parameters_to_dict, set_parameter

log = logging.getLogger(__name__)

SERVER_NAME = "meshserve"
SERVER_VERSION = "0.1.0"
EXTENSIONS = (
    "classification",
    "model_repository",
    "model_configuration",
    "statistics",
    "logging",
    "binary_tensor_data",
    "parameters",
)
SHARED_MEMORY_EXTENSION = "system_shared_memory"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
GATHERED = "meshserve_gathered"
"""Request parameter: true when the request's rows are a batch that a queue
upstream gathered (the orchestrator's ensemble queue), so the model's batcher
sends it without waiting for others to join (``InferRequest.gathered``)."""


def extensions(regions: SharedMemoryRegions) -> list[str]:
    """The protocol extensions a server reports: system shared memory where allowed,
    and the mesh's own handoff buffers where taken."""
    found = list(EXTENSIONS)
    if regions.allowed:
        found.append(SHARED_MEMORY_EXTENSION)
    if regions.handoff:
        found.append(HANDOFF_EXTENSION)
    return found


def to_domain(
    request: pb.ModelInferRequest, raws: Sequence[bytes | memoryview] | None = None
) -> InferRequest:
    """A ModelInferRequest as the domain InferRequest; ``raws``: its inputs' raw
    contents where they came from shared memory (``SharedMemoryRegions.resolve_apart``)."""
    refuse_shared_memory(request)
    params = parameters_to_dict(request.parameters)
    priority = params.get("priority", 0)
    timeout = params.get("timeout", 0)
    if not isinstance(priority, int) or priority < 0:
        raise InvalidArgument(
            f"parameter 'priority' must be a non-negative integer, got {priority!r}"
        )
    if not isinstance(timeout, int) or timeout < 0:
        raise InvalidArgument(
            f"parameter 'timeout' must be a non-negative integer (microseconds), got {timeout!r}"
        )
    return InferRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        inputs=decode_inputs(request, raws),
        requested_outputs=[output.name for output in request.outputs] or None,
        id=request.id,
        parameters=params,
        priority=priority,
        timeout_us=timeout,
        gathered=params.get(GATHERED) is True,
    )


def to_proto(
    request: InferRequest,
    version: int,
    response: InferResponse,
    order: list[str],
    elsewhere: Container[str] = (),
) -> pb.ModelInferResponse:
    """A domain InferResponse as a ModelInferResponse (outputs raw, in config order;
    those in ``elsewhere``, already in shared memory, with empty raw contents)."""
    message = pb.ModelInferResponse(
        model_name=request.model_name, model_version=str(version), id=request.id
    )
    names = [name for name in order if name in response.outputs]
    names += [name for name in response.outputs if name not in names]
    encode_outputs(message, response.outputs, names, elsewhere)
    for key, value in response.parameters.items():
        set_parameter(message.parameters, key, value)
    return message


def refuse_shared_memory(request: pb.ModelInferRequest) -> None:
    """UNIMPLEMENTED for a tensor still placed in a shared-memory region where the
    regions were not resolved (a stream's request: regions serve ModelInfer), which
    would otherwise read as an input without data or an output parameter ignored."""
    for kind, tensors in (("input", request.inputs), ("output", request.outputs)):
        for tensor in tensors:
            if REGION in tensor.parameters:
                raise Unimplemented(
                    f"{kind} '{tensor.name}': shared-memory tensors are served on ModelInfer, "
                    "not on streams; send tensors in raw_input_contents"
                )


def _classified(wanted: Classification | None, response: InferResponse) -> InferResponse:
    """``response`` with the outputs ``wanted`` names as their top classes."""
    if wanted is None:
        return response
    return dataclasses.replace(response, outputs=wanted.apply(response.outputs))


def _forwarded_stream(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """True for a stream whose caller forwards unary requests on it (FORWARD_HEADER)."""
    return any(
        key == FORWARD_HEADER and value == FORWARD_UNARY
        for key, value in context.invocation_metadata() or ()
    )


def _duration(target: pb.StatisticDuration, source: Duration) -> None:
    target.count = source.count
    target.ns = source.ns


def stats_to_proto(name: str, version: int, stats: ModelStats) -> pb.ModelStatistics:
    """ModelStats as Triton's ModelStatistics."""
    message = pb.ModelStatistics(
        name=name,
        version=str(version),
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
    )
    infer = message.inference_stats
    for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        _duration(getattr(infer, field), getattr(stats, field))
    for size, batch in sorted(stats.batches.items()):
        entry = message.batch_stats.add(batch_size=size)
        _duration(entry.compute_input, batch.compute_input)
        _duration(entry.compute_infer, batch.compute_infer)
        _duration(entry.compute_output, batch.compute_output)
    return message


class BaseServicer(SharedMemoryMethods, pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs every v2 server in the mesh answers the same way; ``max_message_bytes``:
    the largest message its server sends; ``regions``: its shared-memory regions."""

    def __init__(
        self,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        regions: SharedMemoryRegions | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.regions = SharedMemoryRegions(allowed=False) if regions is None else regions
        self._log_settings: dict[str, Any] = {
            "log_info": True,
            "log_warning": True,
            "log_error": True,
            "log_verbose_level": 0,
            "log_format": "default",
        }

    async def ServerLive(
        self,
        request: pb.ServerLiveRequest,
        context: grpc.aio.ServicerContext[pb.ServerLiveRequest, pb.ServerLiveResponse],
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerMetadata(
        self,
        request: pb.ServerMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ServerMetadataRequest, pb.ServerMetadataResponse],
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=extensions(self.regions)
        )

    # The stubs type a streaming handler as a response iterator; this one writes
    # with context.write instead (see below), which grpc.aio equally accepts.
    async def ModelStreamInfer(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelStreamInferResponse],
    ) -> None:
        # Requests of one stream run concurrently; each response is written as
        # soon as it is ready (by the request's own task: no hand-off to another
        # task on the way out), and a failed request becomes error_message, not
        # the end of the stream (what tritonclient's streaming callback expects).
        # When the caller goes away, this handler is cancelled and so is every
        # request still running, which stops the generation behind a decoupled model.
        # A stream of forwarded unary requests: shared/forwarding.py.
        if _forwarded_stream(context):
            await serve_forwarded(
                self.answer_forwarded,
                request_iterator,
                context,
                packed=False,
                limit=self.max_message_bytes,
            )
            return
        send = one_at_a_time(context)
        tasks = StreamTasks()

        async def one(request: pb.ModelInferRequest) -> None:
            answers = self.stream_responses(request, context)
            try:
                async for answer in answers:
                    await send(pb.ModelStreamInferResponse(infer_response=answer))
            except Exception as exc:
                await send(stream_failed(request, exc, "ModelStreamInfer"))
            finally:
                # Close it now (a cancelled request's generation stops here), not at GC.
                aclose = getattr(answers, "aclose", None)
                if aclose is not None:
                    await aclose()

        try:
            async for request in request_iterator:
                tasks.start(one(request))
            await tasks.finish()
        finally:
            await tasks.cancel()

    async def answer_forwarded(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, Any],
        refused: MeshError | None = None,
    ) -> pb.ModelStreamInferResponse:
        """A forwarded request's message: ModelInfer's one answer, or its error
        (``refused``: the error it already has; RESOURCE_EXHAUSTED for an answer
        over the largest message), without the generator and its closing that a
        decoupled model's responses need."""
        if refused is not None:
            return stream_error(request, refused)
        try:
            answer = await self.ModelInfer(request, context)
        except Exception as exc:
            return stream_failed(request, exc, "forwarded ModelInfer")
        return fitting(pb.ModelStreamInferResponse(infer_response=answer), self.max_message_bytes)

    async def ModelInfer(
        self,
        request: pb.ModelInferRequest,
        # Any reply type: stream_responses answers a stream's request with it.
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, Any],
    ) -> pb.ModelInferResponse:
        """Each v2 server infers its own way; ``stream_responses`` answers with it."""
        raise Unimplemented("ModelInfer is not served here")

    async def stream_responses(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelStreamInferResponse],
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response to one request of a ModelStreamInfer stream (here: one).

        Responses carry Triton's ``triton_final_response`` parameter; servers
        that host decoupled models yield several, the last one final.
        """
        answer = await self.ModelInfer(request, context)
        answer.parameters[FINAL_RESPONSE].bool_param = True
        yield answer

    async def TraceSetting(
        self,
        request: pb.TraceSettingRequest,
        context: grpc.aio.ServicerContext[pb.TraceSettingRequest, pb.TraceSettingResponse],
    ) -> pb.TraceSettingResponse:
        # Tracing is OpenTelemetry, configured per service at start; report it.
        response = pb.TraceSettingResponse()
        response.settings["trace_mode"].value.append("opentelemetry")
        response.settings["trace_level"].value.append("TIMESTAMPS")
        return response

    async def LogSettings(
        self,
        request: pb.LogSettingsRequest,
        context: grpc.aio.ServicerContext[pb.LogSettingsRequest, pb.LogSettingsResponse],
    ) -> pb.LogSettingsResponse:
        for key, value in request.settings.items():
            if key not in self._log_settings:
                raise InvalidArgument(
                    f"unknown log setting '{key}'; expected one of {sorted(self._log_settings)}"
                )
            which = value.WhichOneof("parameter_choice")
            self._log_settings[key] = getattr(value, which) if which else None
        verbose = self._log_settings["log_verbose_level"]
        logging.getLogger().setLevel(logging.DEBUG if verbose else logging.INFO)
        response = pb.LogSettingsResponse()
        for key, value in self._log_settings.items():
            setting = response.settings[key]
            if isinstance(value, bool):
                setting.bool_param = value
            elif isinstance(value, int):
                setting.uint32_param = value
            else:
                setting.string_param = str(value)
        return response


class InferenceServicer(BaseServicer):
    """GRPCInferenceService for a stage service's models."""

    def __init__(
        self,
        manager: ModelManager,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        regions: SharedMemoryRegions | None = None,
    ) -> None:
        super().__init__(max_message_bytes, regions)
        self.manager = manager

    async def ServerReady(
        self,
        request: pb.ServerReadyRequest,
        context: grpc.aio.ServicerContext[pb.ServerReadyRequest, pb.ServerReadyResponse],
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.manager.all_ready())

    async def ModelReady(
        self,
        request: pb.ModelReadyRequest,
        context: grpc.aio.ServicerContext[pb.ModelReadyRequest, pb.ModelReadyResponse],
    ) -> pb.ModelReadyResponse:
        try:
            ready = self.manager.get(request.name, request.version).ready
        except MeshError:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ModelMetadata(
        self,
        request: pb.ModelMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ModelMetadataRequest, pb.ModelMetadataResponse],
    ) -> pb.ModelMetadataResponse:
        model = self.manager.get(request.name, request.version)
        versions = sorted(v.version for v in self.manager.loaded() if v.name == request.name)
        config = model.spec.config
        response = pb.ModelMetadataResponse(
            name=model.name,
            versions=[str(v) for v in versions],
            platform=config.platform or config.backend,
        )
        meta = model.metadata()
        for target, tensors in (
            (response.inputs, meta["inputs"]),
            (response.outputs, meta["outputs"]),
        ):
            for name, datatype, shape in tensors:
                target.add(name=name, datatype=datatype, shape=shape)
        return response

    async def ModelInfer(
        self,
        request: pb.ModelInferRequest,
        # Any reply type: stream_responses answers a stream's request with it.
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, Any],
    ) -> pb.ModelInferResponse:
        model = self.manager.get(request.model_name, request.model_version)
        raws, placements = self.regions.resolve_apart(request)
        domain = to_domain(request, raws)
        wanted = classification(request, model.spec.config, model.spec.model_dir)
        response = _classified(wanted, await model.infer(domain))
        written = self.regions.write_arrays(response.outputs, placements)
        order = [o.name for o in model.spec.config.output]
        answer = to_proto(domain, model.version, response, order, written)
        self.regions.place(answer, placements, written)
        return answer

    async def stream_responses(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelStreamInferResponse],
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """A decoupled model's responses as they come; any other model's one answer."""
        model = self.manager.get(request.model_name, request.model_version)
        domain = to_domain(request)
        order = [output.name for output in model.spec.config.output]
        wants_empty_final = domain.parameters.get(EMPTY_FINAL_RESPONSE) is True
        wanted = classification(request, model.spec.config, model.spec.model_dir)
        async with contextlib.aclosing(model.stream(domain)) as responses:
            async for response in responses:
                if response.final and not response.outputs and not wants_empty_final:
                    return  # Triton sends a flags-only final response only when asked to
                message = to_proto(domain, model.version, _classified(wanted, response), order)
                message.parameters[FINAL_RESPONSE].bool_param = response.final
                yield message

    async def ModelConfig(
        self,
        request: pb.ModelConfigRequest,
        context: grpc.aio.ServicerContext[pb.ModelConfigRequest, pb.ModelConfigResponse],
    ) -> pb.ModelConfigResponse:
        model = self.manager.get(request.name, request.version)
        return pb.ModelConfigResponse(config=_with_runtime(model.spec.config, model))

    async def ModelStatistics(
        self,
        request: pb.ModelStatisticsRequest,
        context: grpc.aio.ServicerContext[pb.ModelStatisticsRequest, pb.ModelStatisticsResponse],
    ) -> pb.ModelStatisticsResponse:
        if request.name:
            versions = (
                [self.manager.get(request.name, request.version)]
                if request.version
                else [v for v in self.manager.loaded() if v.name == request.name]
            )
            if not versions:
                self.manager.get(request.name)  # raises NotFound naming the model
        else:
            versions = self.manager.loaded()
        response = pb.ModelStatisticsResponse()
        for version in versions:
            response.model_stats.append(
                stats_to_proto(version.name, version.version, version.stats.stats)
            )
        return response

    async def RepositoryIndex(
        self,
        request: pb.RepositoryIndexRequest,
        context: grpc.aio.ServicerContext[pb.RepositoryIndexRequest, pb.RepositoryIndexResponse],
    ) -> pb.RepositoryIndexResponse:
        rows = self.manager.index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=r.name, version=r.version, state=r.state, reason=r.reason
                )
                for r in rows
            ]
        )

    async def RepositoryModelLoad(
        self,
        request: pb.RepositoryModelLoadRequest,
        context: grpc.aio.ServicerContext[
            pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse
        ],
    ) -> pb.RepositoryModelLoadResponse:
        override = request.parameters.get("config")
        if any(key.startswith("file:") for key in request.parameters):
            raise Unimplemented(
                "loading model files sent in the request ('file:' "
                "parameters) is not supported; place them in the repository"
            )
        await self.manager.load(
            request.model_name, override.string_param if override is not None else None
        )
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self,
        request: pb.RepositoryModelUnloadRequest,
        context: grpc.aio.ServicerContext[
            pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse
        ],
    ) -> pb.RepositoryModelUnloadResponse:
        await self.manager.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the servicer (the shape ``ServiceParts.servicers`` expects), and
    the stream that takes forwarded requests several to a message."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    add_forwarding(servicer.answer_forwarded, server, servicer.max_message_bytes)


def _with_runtime(config: mc.ModelConfig, model: ModelVersion) -> mc.ModelConfig:
    """The config as loaded plus what its instances report once running (e.g.
    ``dtype_in_use``): a reported value wins, since it is what actually runs."""
    runtime = model.runtime_parameters
    if not runtime:
        return config
    shown = mc.ModelConfig()
    shown.CopyFrom(config)
    for key, value in runtime.items():
        shown.parameters[key].string_value = value
    return shown
