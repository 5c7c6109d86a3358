"""The orchestrator's core: what every front door asks of the mesh.

A request for an ensemble runs its dataflow graph here (runner.py); any other
model's request is forwarded to a replica of the stage hosting it as is, its
raw tensors never decoded (router.py picks the replica and retries on another
one that cannot be reached). Model metadata, configs, statistics and the
repository (index, load, unload) are answered the same way: the ensembles'
from here, the stages' models' from their stages.

No gRPC servicer and no HTTP here: front doors (the v2 servicer, the
meshserve.v1 servicer) translate their calls into these methods, pass the
caller's deadline as ``timeout_s`` and its going away as asyncio
cancellation, and map the ``shared.errors`` raised here to their statuses.
The v2 protobuf messages are the request and response objects, since a
forwarded request travels on unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Mapping

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from inference import grpc_service_pb2 as pb
from inference import model_config_pb2 as mc
from services.orchestrator.adapters import AdapterPipelines
from services.orchestrator.ensemble import EnsemblePlan
from services.orchestrator.ensembles import ENSEMBLE_VERSION, EnsembleRegistry
from services.orchestrator.handoff import HandoffPool
from services.orchestrator.route_table import SHADOW_TIMEOUT_S, RouteTable
from services.orchestrator.router import StageRouter
from services.orchestrator.routes import TARGET_PARAMETER, Route, parse_route
from services.orchestrator.runner import Deadline, EnsembleRunner
from services.orchestrator.streaming import relay
from shared.errors import ConfigError, InvalidArgument, MeshError, NotFound, Unavailable
from shared.repository import ModelEntry, is_ensemble
from shared.rpc import remote
from shared.servicer import stats_to_proto
from shared.shared_memory import MARK as SHARED_MEMORY_MARK
from shared.shared_memory import SharedMemoryRegions
from shared.stream_messages import FINAL_RESPONSE

ROUTE_PARAMETER = "route"
"""RepositoryModelLoad parameter: the route to define under the model name, as JSON."""
INDEX_TIMEOUT_S = 5.0
"""How long a stage may take to list its models for the mesh's index."""
LOAD_TIMEOUT_S = 300.0
"""How long a stage may take to load a model (weights from disk, a warm-up)."""
UNLOAD_TIMEOUT_S = 60.0
"""How long a stage may take to unload a model (its requests in flight finish)."""


def _check_version(ensemble: str, version: str) -> None:
    """NotFound for a version of an ensemble other than the one it is served as."""
    if version not in ("", ENSEMBLE_VERSION):
        raise NotFound(
            f"Request for unknown model: '{ensemble}' version {version} is not found "
            f"(ensemble '{ensemble}' has no version '{version}'; served: [{ENSEMBLE_VERSION}])"
        )


class Orchestrator:
    """Every model of the mesh behind one set of calls."""

    def __init__(
        self,
        router: StageRouter,
        ensembles: EnsembleRegistry,
        tracer: trace.Tracer,
        routes: RouteTable | None = None,
        regions: SharedMemoryRegions | None = None,
        handoff: HandoffPool | None = None,
    ) -> None:
        # Where each stage model lives -> the ensembles run here -> one request
        # of an ensemble, step by step; routes pick the model a name stands for.
        self.router = router
        self.ensembles = ensembles
        self.runner = EnsembleRunner(router, ensembles, self._infer, tracer, handoff)
        self.routes = routes or RouteTable({}, CollectorRegistry())
        self._decoupled: dict[str, bool] = {}
        self.adapters = AdapterPipelines(ensembles, router.model_config)
        """LoRA adapters' pipelines, derived when a stream first names one (adapters.py)."""
        self.regions = SharedMemoryRegions(allowed=False) if regions is None else regions
        """Callers' shared-memory regions: read before a request runs, written after."""

    def plan(self, name: str, version: str = "") -> EnsemblePlan | None:
        """The ensemble ``name`` (None: a stage's model); a version it does not
        have is NotFound, as a stage answers for its models."""
        plan = self.ensembles.get(name)
        if plan is not None:
            _check_version(name, version)
        return plan

    # Inference.

    async def infer(
        self, request: pb.ModelInferRequest, timeout_s: float | None = None
    ) -> pb.ModelInferResponse:
        """One request's answer: an ensemble's, or the hosting stage's (forwarded)."""
        placements = self.regions.resolve(request)
        response = await self._infer(request, Deadline.after(timeout_s))
        self.regions.place(response, placements)
        return response

    def forwards(self, name: str) -> bool:
        """True when a request for model ``name`` goes to its stage as it is: not a
        route's and not an ensemble's, which run here (``infer``)."""
        return self.routes.get(name) is None and self.ensembles.get(name) is None

    async def forward(
        self, model: str, request: bytes, request_id: str, timeout_s: float | None = None
    ) -> bytes:
        """A serialised ModelInferRequest for a stage model (``forwards``), answered
        by the stage hosting it; neither message is decoded here. Without a
        deadline it travels as a message on an open stream
        (services/orchestrator/forward_stream.py). A request with tensors in
        this service's shared-memory regions is decoded to read and write them."""
        on_stream = request_id if timeout_s is None else None
        if not self.regions or SHARED_MEMORY_MARK not in request:
            return await self.router.forward(model, request, timeout_s, on_stream)
        return await self.regions.forwarded(
            request, lambda data: self.router.forward(model, data, timeout_s, on_stream)
        )

    async def _infer(
        self, request: pb.ModelInferRequest, deadline: Deadline
    ) -> pb.ModelInferResponse:
        route = self.routes.get(request.model_name)
        if route is not None:
            # A route's targets are models, never routes: no cycle to follow.
            return await self.routes.serve(
                route,
                request,
                lambda forwarded: self._infer_model(forwarded, deadline),
                lambda mirrored: self._infer_model(mirrored, Deadline.after(SHADOW_TIMEOUT_S)),
            )
        return await self._infer_model(request, deadline)

    async def _infer_model(
        self, request: pb.ModelInferRequest, deadline: Deadline
    ) -> pb.ModelInferResponse:
        plan = self.plan(request.model_name, request.model_version)
        if plan is not None:
            return await self.runner.infer(plan, request, deadline)
        timeout = deadline.remaining()
        response: pb.ModelInferResponse = await self.router.call(
            request.model_name, lambda stub: stub.ModelInfer(request, timeout=timeout)
        )
        return response

    async def stream(
        self, request: pb.ModelInferRequest, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """Every response to one request: a streaming ensemble's and a decoupled
        model's as they come, any other model's one (flagged final). Closing it
        early stops the work upstream. A route's answers name its target."""
        deadline = Deadline.after(timeout_s)
        await self.adapters.ensure(request.model_name)
        route = self.routes.get(request.model_name)
        responses = (
            self._stream(request, deadline)
            if route is None
            else self._route_stream(route, request, deadline)
        )
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def _route_stream(
        self, route: Route, request: pb.ModelInferRequest, deadline: Deadline
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        mirror = self.routes.mirror_copy(route, request)
        target = self.routes.assign(route, request)
        served: list[pb.ModelInferResponse] = []
        started = time.perf_counter()
        ok = False
        try:
            async with contextlib.aclosing(self._stream(request, deadline)) as responses:
                async for response in responses:
                    if mirror is not None:  # kept to compare with the shadow's whole stream
                        served.append(response)
                    response.parameters[TARGET_PARAMETER].string_param = target.id
                    yield response
            ok = True
            if mirror is not None:
                self.routes.mirror(route, target, mirror, served, self._collect)
        except (asyncio.CancelledError, GeneratorExit):
            ok = True  # the caller went away: not the target's failure
            raise
        finally:
            self.routes.record(route.name, target, ok, time.perf_counter() - started)

    async def _collect(self, request: pb.ModelInferRequest) -> list[pb.ModelInferResponse]:
        """Every answer of a mirrored stream (a shadow's: its own deadline)."""
        stream = self._stream(request, Deadline.after(SHADOW_TIMEOUT_S))
        async with contextlib.aclosing(stream) as responses:
            return [response async for response in responses]

    async def _stream(
        self, request: pb.ModelInferRequest, deadline: Deadline
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        plan = self.plan(request.model_name, request.model_version)
        if plan is not None and plan.streaming is not None:
            responses = self.runner.stream(plan, request, deadline)
        elif plan is None and await self._is_decoupled(request.model_name):
            responses = relay(self.router, request)
        else:
            response = await self._infer_model(request, deadline)
            response.parameters[FINAL_RESPONSE].bool_param = True
            yield response
            return
        # Closed here, at once, when this stream is: that cancels the stage calls.
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def _is_decoupled(self, model: str) -> bool:
        if model not in self._decoupled:
            config = await self.router.model_config(model)
            self._decoupled[model] = config.model_transaction_policy.decoupled
        return self._decoupled[model]

    # Health and model information.

    def ready(self) -> bool:
        """True when every stage replica answers and every ensemble loaded."""
        stages_ready = all(e.ready for e in self.router.endpoints)
        return stages_ready and not self.ensembles.failed

    def stages(self) -> dict[str, list[bool]]:
        """Each stage's replicas, ready or not."""
        stages: dict[str, list[bool]] = {}
        for endpoint in self.router.endpoints:
            stages.setdefault(endpoint.address.stage, []).append(endpoint.ready)
        return stages

    def stages_of(self, model: str) -> list[str]:
        """The stages hosting ``model`` (``orchestrator`` for an ensemble; a route's primary's)."""
        model, _ = self.resolve(model)
        if self.ensembles.runs_here(model):
            return ["orchestrator"]
        return self.router.stage_names(model)

    def resolve(self, name: str, version: str = "") -> tuple[str, str]:
        """The model (and version) that answers for ``name``: a route's primary target,
        else ``name`` itself."""
        route = self.routes.get(name)
        if route is None:
            return name, version
        return route.primary.model, route.primary.version

    async def model_ready(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> bool:
        """True when ``name`` answers inference now (a route: its primary)."""
        name, version = self.resolve(name, version)
        try:
            if self.plan(name, version) is not None:
                return True
            request = pb.ModelReadyRequest(name=name, version=version)
            response: pb.ModelReadyResponse = await self.router.call(
                name, lambda stub: stub.ModelReady(request, timeout=timeout_s)
            )
        except MeshError:
            return False
        return bool(response.ready)

    async def metadata(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> pb.ModelMetadataResponse:
        """A model's name, versions, platform and tensors (a route: its primary's,
        under the route's name)."""
        called = name
        name, version = self.resolve(name, version)
        plan = self.plan(name, version)
        if plan is None:
            request = pb.ModelMetadataRequest(name=name, version=version)
            forwarded: pb.ModelMetadataResponse = await self.router.call(
                name, lambda stub: stub.ModelMetadata(request, timeout=timeout_s)
            )
            forwarded.name = called
            return forwarded
        response = pb.ModelMetadataResponse(
            name=called, versions=[ENSEMBLE_VERSION], platform="ensemble"
        )
        for target, specs in (
            (response.inputs, plan.io.inputs),
            (response.outputs, plan.io.outputs),
        ):
            for spec in specs.values():
                target.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        return response

    async def config(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> mc.ModelConfig:
        """A model's configuration (as its stage runs it; a route: its primary's,
        under the route's name)."""
        called = name
        name, version = self.resolve(name, version)
        plan = self.plan(name, version)
        if plan is not None:
            config: mc.ModelConfig = plan.config
        else:
            request = pb.ModelConfigRequest(name=name, version=version)
            response: pb.ModelConfigResponse = await self.router.call(
                name, lambda stub: stub.ModelConfig(request, timeout=timeout_s)
            )
            config = response.config
        if called == name:
            return config
        renamed = mc.ModelConfig()
        renamed.CopyFrom(config)
        renamed.name = called
        return renamed

    async def statistics(
        self, name: str = "", version: str = "", timeout_s: float | None = None
    ) -> list[pb.ModelStatistics]:
        """Triton's statistics of one model, or of every model (no name); a route's
        are its primary's."""
        name, version = self.resolve(name, version)
        if name in self.ensembles.stats and not self.ensembles.served_whole(name):
            _check_version(name, version)
            return [self._ensemble_stats(name)]
        request = pb.ModelStatisticsRequest(name=name, version=version)
        if name:
            response: pb.ModelStatisticsResponse = await self.router.call(
                name, lambda stub: stub.ModelStatistics(request, timeout=timeout_s)
            )
            return list(response.model_stats)
        # An ensemble a stage serves whole: that stage's statistics say it.
        stats = [
            self._ensemble_stats(ensemble)
            for ensemble in self.ensembles.stats
            if not self.ensembles.served_whole(ensemble)
        ]
        for endpoint in [e for e in self.router.endpoints if e.ready]:
            try:
                with remote():
                    part = await endpoint.stub().ModelStatistics(request, timeout=timeout_s)
            except MeshError:
                continue  # a replica that went away has no statistics to add
            stats.extend(part.model_stats)
        return stats

    def _ensemble_stats(self, name: str) -> pb.ModelStatistics:
        return stats_to_proto(name, int(ENSEMBLE_VERSION), self.ensembles.stats[name].stats)

    # The model repository.

    async def index(self, ready_only: bool = False) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """Every model of the mesh (each stage's, then the ensembles), with its state."""
        request = pb.RepositoryIndexRequest(ready=ready_only)
        rows: list[pb.RepositoryIndexResponse.ModelIndex] = []
        seen: set[tuple[str, str]] = set()
        for endpoint in self.router.endpoints:
            try:
                with remote():
                    part = await endpoint.stub().RepositoryIndex(request, timeout=INDEX_TIMEOUT_S)
            except MeshError:
                continue  # a stage that cannot be reached lists nothing
            for model in part.models:
                if (model.name, model.version) not in seen:
                    seen.add((model.name, model.version))
                    rows.append(model)
        listed = {row.name for row in rows}
        for name in self.ensembles.names():
            if name in listed:
                continue  # a stage serves it whole; its row says how it is
            if name in self.ensembles.plans:
                rows.append(_index_row(name, "READY"))
            elif not ready_only:
                reason = self.ensembles.failed.get(name, "not loaded")
                rows.append(_index_row(name, "UNAVAILABLE", reason))
        rows.extend(
            pb.RepositoryIndexResponse.ModelIndex(name=name, state="READY")
            for name in self.routes.names()
        )
        return rows

    async def load(self, name: str, parameters: Mapping[str, pb.ModelRepositoryParameter]) -> None:
        """Load (or reload) ``name`` where it lives: an ensemble here; any other
        model on every ready replica of the stage whose index lists it (each
        stage lists every model its backends host, loaded or not). A ``route``
        parameter (the route as JSON) defines or replaces the route ``name``."""
        if ROUTE_PARAMETER in parameters:
            self.put_route(name, parameters[ROUTE_PARAMETER].string_param)
            return
        entry = self._entry_to_load(name)
        if entry is not None and is_ensemble(entry.config):
            await self.ensembles.load(name)
            if not self.router.listing(name):
                return  # else also where a stage runs it whole, as its other models
        # The stages' indexes as they are now: a config fixed since the last
        # refresh names its backend, and only that backend's stage lists it.
        await self.router.refresh()
        stages = self.router.listing(name)
        if not stages:
            raise NotFound(
                f"failed to load '{name}', failed to poll from model repository (no stage hosts it)"
            )
        targets = [e for e in self.router.endpoints if e.address.stage in stages and e.ready]
        if not targets:
            where = ", ".join(f"'{stage}'" for stage in sorted(stages))
            raise Unavailable(f"failed to load '{name}': stage {where} has no ready replica")
        self.adapters.forget(name)  # an adapter's pipeline is derived again when asked for
        request = pb.RepositoryModelLoadRequest(model_name=name)
        for key, value in parameters.items():
            request.parameters[key].CopyFrom(value)
        try:
            with remote():
                await asyncio.gather(
                    *(
                        e.stub().RepositoryModelLoad(request, timeout=LOAD_TIMEOUT_S)
                        for e in targets
                    )
                )
        finally:
            # Succeeded or not: the index now says what the stages hold (and why not).
            await self.router.refresh()

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

    async def unload(
        self, name: str, parameters: Mapping[str, pb.ModelRepositoryParameter]
    ) -> None:
        """Stop serving ``name``: a route (deleted), an ensemble here, else on every
        replica serving it."""
        if self.routes.get(name) is not None:
            self.routes.delete(name)
            return
        self.adapters.forget(name)  # an adapter: its derived pipeline goes, the stage unloads it
        replicas = [e for e in self.router.replicas(name) if e.ready]
        if name in self.ensembles.plans:
            self.ensembles.unload(name)
            self.runner.queues.forget(name)
            if not replicas:
                return  # else also where a stage runs it whole
        if not replicas:
            raise NotFound(f"model '{name}' is not loaded on any stage")
        request = pb.RepositoryModelUnloadRequest(model_name=name)
        for key, value in parameters.items():
            request.parameters[key].CopyFrom(value)
        with remote():
            await asyncio.gather(
                *(
                    e.stub().RepositoryModelUnload(request, timeout=UNLOAD_TIMEOUT_S)
                    for e in replicas
                )
            )
        await self.router.refresh()

    def put_route(self, name: str, document: str) -> Route:
        """Define or replace the route ``name`` from its JSON (define_route)."""
        try:
            parsed = json.loads(document)
        except ValueError as exc:
            raise InvalidArgument(f"route '{name}': not valid JSON: {exc}") from None
        return self.define_route(parse_route(name, parsed))

    def define_route(self, route: Route) -> Route:
        """Add or replace ``route``; its targets must be models the mesh serves
        (InvalidArgument naming the one it does not)."""
        name = route.name
        if self.plan(name) is not None or self.router.stage_names(name):
            raise InvalidArgument(f"route '{name}': a model of that name exists")
        mirrored = [route.shadow.target] if route.shadow else []
        for target in [*route.targets, *mirrored]:
            if self.routes.get(target.model) is not None:
                raise InvalidArgument(f"route '{name}': target '{target.model}' is a route")
            if not self.stages_of(target.model):
                raise InvalidArgument(
                    f"route '{name}': target '{target.model}' is not a model of the mesh"
                )
        return self.routes.put(route)


def _index_row(name: str, state: str, reason: str = "") -> pb.RepositoryIndexResponse.ModelIndex:
    return pb.RepositoryIndexResponse.ModelIndex(
        name=name, version=ENSEMBLE_VERSION, state=state, reason=reason
    )
