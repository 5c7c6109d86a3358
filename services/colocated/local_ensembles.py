"""Ensembles run whole on a stage that hosts every one of their steps.

A stage that hosts several stages' backends (services/colocated/main.py)
claims each ensemble whose steps are all its own models, none of them
streaming and none an ensemble itself. Its index then lists the ensemble as
any model, and the orchestrator sends the ensemble's requests here as it
forwards any stage model (services/orchestrator/ensembles.py gives way to a
stage that serves an ensemble whole): one hop for the request instead of one
per step. The graph and its checks are the orchestrator's (ensemble.py); each
step goes to its model's ``ModelVersion`` (validation, batcher, statistics) as
any caller's request does; requests that arrive together go through the
steps as one batch (services/orchestrator/ensemble_batches.py). An ensemble
that this stage does not claim is run by the orchestrator, as before.

No gRPC here.
"""

from __future__ import annotations

from opentelemetry import trace

from inference import model_config_pb2 as mc
from services.orchestrator.ensemble import EnsemblePlan, ModelIO, Step, WireTensor
from services.orchestrator.ensemble_batches import EnsembleBatches, ensemble_policy, lane_count
from shared.backend import BackendInstance, InstanceSpec, LoopModel, ModelSpec, is_decoupled
from shared.errors import ConfigError, FailedPrecondition, MeshError, Unavailable
from shared.manager import ModelManager
from shared.repository import is_ensemble
from shared.request import InferRequest, InferResponse
from shared.server import Hook
from shared.stage import StageContext


class LocalEnsembleBackend:
    """The ``ensemble`` platform, for the ensembles whose steps all run on this stage."""

    name = "ensemble"

    def __init__(self) -> None:
        self._manager: ModelManager | None = None
        self._tracer: trace.Tracer = trace.NoOpTracer()

    def attach(self, stage: StageContext) -> tuple[list[Hook], list[Hook]]:
        """Keep the stage's models (the steps run on them) and its tracer."""
        self._manager = stage.manager
        self._tracer = stage.tracer
        return [], []

    def claims(self, config: mc.ModelConfig) -> bool:
        """True when every step's model is this stage's, answers once and is no ensemble."""
        manager = self._manager
        steps = config.ensemble_scheduling.step
        if manager is None or not is_ensemble(config) or not steps:
            return False
        for step in steps:
            try:
                step_config = manager.repository.config(step.model_name)
            except MeshError:
                return False
            if is_ensemble(step_config) or is_decoupled(step_config):
                return False
            if not manager.hosts(step_config):
                return False
        return True

    def create_instance(self, model: ModelSpec, instance: InstanceSpec) -> BackendInstance:
        """Not for ensembles: they run on the loop (``open``), with no instance."""
        raise ConfigError(f"model '{model.name}': an ensemble has no execution instances")

    async def open(self, model: ModelSpec) -> LoopModel:
        """The ensemble's plan, checked against its steps' loaded configs."""
        manager = self._manager
        if manager is None:
            raise FailedPrecondition("the ensemble backend runs only inside a stage")
        models: dict[str, ModelIO] = {}
        for index, step in enumerate(model.config.ensemble_scheduling.step):
            version = "" if step.model_version < 0 else str(step.model_version)
            try:
                loaded = manager.get(step.model_name, version)
            except MeshError as exc:
                raise Unavailable(
                    f"ensemble '{model.name}' step {index} ('{step.model_name}'): {exc.message}"
                ) from exc
            models[step.model_name] = ModelIO.from_config(loaded.spec.config)
        plan = EnsemblePlan.build(model.config, models)
        ensemble = LocalEnsemble(plan, manager, self._tracer)
        await ensemble.start_batching()
        return ensemble


class LocalEnsemble:
    """One loaded ensemble: each request's steps run on this stage's models."""

    def __init__(self, plan: EnsemblePlan, manager: ModelManager, tracer: trace.Tracer) -> None:
        self.plan = plan
        self._manager = manager
        self._tracer = tracer
        self.batches: EnsembleBatches | None = None
        """Concurrent requests batched through the graph (ensemble_batches.py)."""

    async def start_batching(self) -> None:
        """Batch the ensemble's requests when it and every step have a batch dimension."""
        steps = [self._manager.get(step.model, step.version) for step in self.plan.steps]
        lanes = lane_count(max((len(step.instances) for step in steps), default=1))
        policy = ensemble_policy(self.plan.config, [step.spec.config for step in steps], lanes)
        if policy is None:
            return
        self.batches = EnsembleBatches(self.plan.name, policy, lanes, self.run, self._tracer)
        await self.batches.start()

    async def infer(self, request: InferRequest) -> InferResponse:
        """The request's outputs, from its batch's run when the ensemble batches."""
        if self.batches is not None:
            return await self.batches.infer(request)
        return await self.run(request)

    async def run(self, request: InferRequest) -> InferResponse:
        """Run the graph on the request's inputs; its outputs, as asked for."""
        # With the ensemble batching, every request reaches the steps as (part of)
        # a batch its queue gathered, so a step's batcher has nothing to wait for:
        # the other lanes' batches are on the step's other instances.
        gathered = self.batches is not None

        async def call(
            step: Step, inputs: dict[str, WireTensor], outputs: list[str]
        ) -> dict[str, WireTensor]:
            arrays = {name: tensor.array(name) for name, tensor in inputs.items()}
            sub = InferRequest(
                step.model,
                step.version,
                arrays,
                requested_outputs=outputs or None,
                id=request.id,
                priority=request.priority,
                timeout_us=request.timeout_us,
                gathered=gathered,
            )
            answer = await self._manager.get(step.model, step.version).infer(sub)
            return {name: WireTensor.of(array) for name, array in answer.outputs.items()}

        return await self.plan.run_arrays(request, call, self._tracer)

    async def close(self) -> None:
        """Finish the batches queued; the steps' models are the stage's to release."""
        if self.batches is not None:
            await self.batches.stop()
