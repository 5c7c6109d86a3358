"""The orchestrator's v2 servicer: ensembles run here, everything else is forwarded.

A call to a non-ensemble model is passed to a replica of the stage hosting it
as is (no decoding); a call to an ensemble runs its dataflow graph, each step
a ModelInfer on the stage hosting the step's model. The caller's deadline
bounds every step (a unary step's timeout; a stream is cancelled with its
caller), and a cancelled caller cancels every step in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import (
    FINISH_TENSOR,
    EnsemblePlan,
    Step,
    WireTensor,
    is_finished,
)
from services.orchestrator.ensembles import ENSEMBLE_VERSION, EnsembleRegistry, is_ensemble
from services.orchestrator.router import StageRouter
from services.orchestrator.streaming import (
    StepStreams,
    relay,
    step_request,
    wire_outputs,
)
from shared.classification import classification
from shared.errors import ConfigError, InvalidArgument, MeshError, NotFound, error_for_status
from shared.repository import ModelEntry, hosting_service
from shared.servicer import (
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    BaseServicer,
    refuse_shared_memory,
    stats_to_proto,
)
from shared.tensors import decode_inputs, decode_raw, encode_raw, refuse_mixed_contents


def _deadline(context: Any) -> float | None:
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else max(0.001, remaining)


def _as_mesh_error(exc: grpc.aio.AioRpcError, prefix: str = "") -> MeshError:
    return error_for_status(exc.code(), f"{prefix}{exc.details()}")


def _check_version(ensemble: str, version: str) -> None:
    """NotFound for a version of an ensemble other than the one it is served as."""
    if version not in ("", ENSEMBLE_VERSION):
        raise NotFound(
            f"Request for unknown model: '{ensemble}' version {version} is not found "
            f"(ensemble '{ensemble}' has no version '{version}'; served: [{ENSEMBLE_VERSION}])"
        )


def wire_inputs(request: pb.ModelInferRequest) -> dict[str, WireTensor]:
    """Request inputs in wire form; typed contents are re-encoded raw once."""
    refuse_shared_memory(request)
    refuse_mixed_contents(request)
    if request.raw_input_contents:
        if len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument(
                f"raw_input_contents has {len(request.raw_input_contents)} entries for "
                f"{len(request.inputs)} inputs; send all inputs raw or none"
            )
        raws = list(request.raw_input_contents)
    else:
        arrays = decode_inputs(request)
        raws = [encode_raw(arrays[t.name]) for t in request.inputs]
    return {
        t.name: WireTensor(t.datatype, tuple(t.shape), raw)
        for t, raw in zip(request.inputs, raws, strict=True)
    }


class OrchestratorServicer(BaseServicer):
    """GRPCInferenceService for every model in the mesh."""

    def __init__(
        self, router: StageRouter, ensembles: EnsembleRegistry, tracer: trace.Tracer
    ) -> None:
        super().__init__()
        self.router = router
        self.ensembles = ensembles
        self.tracer = tracer
        self._decoupled: dict[str, bool] = {}

    def _plan(self, name: str, version: str) -> EnsemblePlan | None:
        """The ensemble ``name`` (None: a stage's model); a version it does not
        have is NotFound, as a stage answers for its models."""
        plan = self.ensembles.get(name)
        if plan is not None:
            _check_version(name, version)
        return plan

    async def _forward(self, model: str, method: str, request: Any, context: Any) -> Any:
        try:
            return await self.router.call(
                model,
                method,
                lambda stub: getattr(stub, method)(request, timeout=_deadline(context)),
            )
        except grpc.aio.AioRpcError as exc:
            raise _as_mesh_error(exc) from exc

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        stages_ready = all(e.ready for e in self.router.endpoints)
        return pb.ServerReadyResponse(ready=stages_ready and not self.ensembles.failed)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        try:
            if self._plan(request.name, request.version) is not None:
                return pb.ModelReadyResponse(ready=True)
            return await self._forward(request.name, "ModelReady", request, context)
        except MeshError:
            return pb.ModelReadyResponse(ready=False)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        plan = self._plan(request.name, request.version)
        if plan is None:
            return await self._forward(request.name, "ModelMetadata", request, context)
        response = pb.ModelMetadataResponse(
            name=plan.name, versions=[ENSEMBLE_VERSION], platform="ensemble"
        )
        for target, specs in (
            (response.inputs, plan.io.inputs),
            (response.outputs, plan.io.outputs),
        ):
            for spec in specs.values():
                target.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        return response

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> Any:
        plan = self._plan(request.name, request.version)
        if plan is None:
            return await self._forward(request.name, "ModelConfig", request, context)
        return pb.ModelConfigResponse(config=plan.config)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        plan = self._plan(request.model_name, request.model_version)
        if plan is None:
            return await self._forward(request.model_name, "ModelInfer", request, context)
        classify = self._classifier(plan, request)
        outputs = await self.ensembles.run(
            plan, wire_inputs(request), self._step_call(plan, request, context), self.tracer
        )
        return self._ensemble_response(plan, request, classify(outputs))

    def _classifier(
        self, plan: EnsemblePlan, request: pb.ModelInferRequest
    ) -> Callable[[dict[str, WireTensor]], dict[str, WireTensor]]:
        """What answers the ensemble outputs that ask for classification as their
        top classes (labels from the ensemble's folder); the identity when none does."""
        repository = self.ensembles.repository
        folder = repository.root / plan.name if repository is not None else None
        wanted = classification(request, plan.config, folder)
        if wanted is None:
            return lambda outputs: outputs

        def classify(outputs: dict[str, WireTensor]) -> dict[str, WireTensor]:
            arrays = {
                name: decode_raw(name, tensor.datatype, tensor.shape, tensor.raw)
                for name, tensor in outputs.items()
                if name in wanted.classes
            }
            answered = dict(outputs)
            for name, array in wanted.apply(arrays).items():
                answered[name] = WireTensor("BYTES", array.shape, encode_raw(array))
            return answered

        return classify

    @staticmethod
    def _ensemble_response(
        plan: EnsemblePlan, request: pb.ModelInferRequest, outputs: dict[str, WireTensor]
    ) -> pb.ModelInferResponse:
        wanted = [o.name for o in request.outputs] or list(outputs)
        unknown = [name for name in wanted if name not in outputs]
        if unknown:
            raise InvalidArgument(
                f"ensemble '{plan.name}': unknown output {unknown}; expected {sorted(outputs)}"
            )
        response = pb.ModelInferResponse(
            model_name=plan.name, model_version=ENSEMBLE_VERSION, id=request.id
        )
        for name in wanted:
            tensor = outputs[name]
            response.outputs.add(name=name, datatype=tensor.datatype, shape=list(tensor.shape))
            response.raw_output_contents.append(tensor.raw)
        return response

    def _step_call(
        self,
        plan: EnsemblePlan,
        request: pb.ModelInferRequest,
        context: Any,
        streams: StepStreams | None = None,
    ) -> Any:
        """Run one step: a ModelInfer, or a message on the step's open stream."""

        async def call(
            step: Step, inputs: dict[str, WireTensor], outputs: list[str]
        ) -> dict[str, WireTensor]:
            sub = step_request(step, inputs, outputs, request.id)
            for key in ("priority", "timeout"):
                if key in request.parameters:
                    sub.parameters[key].CopyFrom(request.parameters[key])
            if streams is None or self.ensembles.get(step.model) is not None:
                return wire_outputs(await self.ModelInfer(sub, context))
            return wire_outputs(await streams.infer(step.index, sub))

        return call

    def _step_stream(
        self, request: pb.ModelInferRequest, streams: StepStreams, later: Sequence[Step]
    ) -> Any:
        """Relay the decoupled step; once its request is on its way, take the
        ``later`` steps' streams, so that where no spare stream waits the stages set
        new ones up during the prefill, not when the first token waits for them."""

        async def stream(
            step: Step, inputs: dict[str, WireTensor], outputs: list[str]
        ) -> AsyncIterator[dict[str, WireTensor]]:
            sub = step_request(step, inputs, outputs, request.id)
            async for response in relay(self.router, sub, lambda: streams.open_soon(later)):
                yield wire_outputs(response)

        return stream

    async def _is_decoupled(self, model: str) -> bool:
        if model not in self._decoupled:
            config = await self.router.model_config(model)
            self._decoupled[model] = config.model_transaction_policy.decoupled
        return self._decoupled[model]

    async def stream_responses(
        self, request: pb.ModelInferRequest, context: Any
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response to one request of a ModelStreamInfer stream."""
        plan = self._plan(request.model_name, request.model_version)
        if plan is not None and plan.streaming is not None:
            classify = self._classifier(plan, request)
            streams = StepStreams(self.router)
            # Nested ensembles run here (ModelInfer); the other later steps stream.
            later = [s for s in plan.downstream if self.ensembles.get(s.model) is None]
            outputs_stream = self.ensembles.stream(
                plan,
                wire_inputs(request),
                self._step_call(plan, request, context, streams),
                self._step_stream(request, streams, later),
                self.tracer,
            )
            # Each response goes out as soon as it is made; the one that carries a
            # finish reason is the last and says so. (Holding each back until the
            # next came, to flag the last, delayed every token by one engine step.)
            last = False
            try:
                async for outputs in outputs_stream:
                    response = self._ensemble_response(plan, request, classify(outputs))
                    last = is_finished(outputs.get(FINISH_TENSOR))
                    response.parameters[FINAL_RESPONSE].bool_param = last
                    yield response
            finally:
                streams.close()
            asked = request.parameters.get(EMPTY_FINAL_RESPONSE)
            if not last and asked is not None and asked.bool_param:
                # Ended without a finish reason: as Triton, a flags-only final
                # response, only for a caller that asked for one.
                final = pb.ModelInferResponse(
                    model_name=plan.name, model_version=ENSEMBLE_VERSION, id=request.id
                )
                final.parameters[FINAL_RESPONSE].bool_param = True
                yield final
            return
        if plan is None and await self._is_decoupled(request.model_name):
            async for response in relay(self.router, request):
                yield response
            return
        response = await self.ModelInfer(request, context)
        response.parameters[FINAL_RESPONSE].bool_param = True
        yield response

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> Any:
        if request.name:
            if request.name in self.ensembles.stats:
                _check_version(request.name, request.version)
                response = pb.ModelStatisticsResponse()
                recorder = self.ensembles.stats[request.name]
                response.model_stats.append(
                    stats_to_proto(request.name, int(ENSEMBLE_VERSION), recorder.stats)
                )
                return response
            return await self._forward(request.name, "ModelStatistics", request, context)
        response = pb.ModelStatisticsResponse()
        for name, recorder in self.ensembles.stats.items():
            response.model_stats.append(stats_to_proto(name, int(ENSEMBLE_VERSION), recorder.stats))
        for endpoint in [e for e in self.router.endpoints if e.ready]:
            try:
                part = await endpoint.stub().ModelStatistics(request, timeout=_deadline(context))
            except grpc.aio.AioRpcError:
                continue
            response.model_stats.extend(part.model_stats)
        return response

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> Any:
        response = pb.RepositoryIndexResponse()
        seen: set[tuple[str, str]] = set()
        for endpoint in self.router.endpoints:
            try:
                part = await endpoint.stub().RepositoryIndex(request, timeout=5)
            except grpc.aio.AioRpcError:
                continue
            for model in part.models:
                if (model.name, model.version) not in seen:
                    seen.add((model.name, model.version))
                    response.models.append(model)
        for name in self.ensembles.names():
            if name in self.ensembles.plans:
                response.models.add(name=name, version=ENSEMBLE_VERSION, state="READY")
            elif not request.ready:
                response.models.add(
                    name=name,
                    version=ENSEMBLE_VERSION,
                    state="UNAVAILABLE",
                    reason=self.ensembles.failed.get(name, "not loaded"),
                )
        return response

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> Any:
        name = request.model_name
        entry = self._entry_to_load(name)
        if entry is not None and is_ensemble(entry.config):
            await self.ensembles.load(name)
            return pb.RepositoryModelLoadResponse()
        try:
            if self.router.replicas(name):
                await self._forward(name, "RepositoryModelLoad", request, context)
            elif entry is not None:
                stage = hosting_service(entry.config)
                await self.router.broadcast(
                    stage, lambda stub: stub.RepositoryModelLoad(request, timeout=300)
                )
            else:
                raise NotFound(
                    f"failed to load '{name}', failed to poll from model repository "
                    "(no stage hosts it)"
                )
        except grpc.aio.AioRpcError as exc:
            raise _as_mesh_error(exc) from exc
        finally:
            # Succeeded or not: the index now says what the stages hold (and why not).
            await self.router.refresh()
        return pb.RepositoryModelLoadResponse()

    def _entry_to_load(self, name: str) -> ModelEntry | None:
        """The repository's entry of a model to load (None: no repository here);
        its errors in Triton's words for a failed load."""
        repository = self.ensembles.repository
        if repository is None:
            return None
        try:
            return repository.entry(name)
        except NotFound as exc:
            raise NotFound(
                f"failed to load '{name}', failed to poll from model repository ({exc.message})"
            ) from exc
        except ConfigError as exc:
            raise ConfigError(f"failed to load '{name}': {exc.message}") from exc

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> Any:
        name = request.model_name
        if name in self.ensembles.plans:
            self.ensembles.unload(name)
            return pb.RepositoryModelUnloadResponse()
        replicas = [e for e in self.router.replicas(name) if e.ready]
        if not replicas:
            raise NotFound(f"model '{name}' is not loaded on any stage")
        try:
            await asyncio.gather(
                *(e.stub().RepositoryModelUnload(request, timeout=60) for e in replicas)
            )
        except grpc.aio.AioRpcError as exc:
            raise _as_mesh_error(exc) from exc
        await self.router.refresh()
        return pb.RepositoryModelUnloadResponse()
