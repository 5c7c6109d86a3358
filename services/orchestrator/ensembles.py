"""The orchestrator's own models: ensembles read from the repository.

An ensemble is validated against its step models' configs, which are fetched
from the stages hosting them, so an ensemble can load only once its stages
are discovered. Ensembles that could not load are retried whenever discovery
sees a change; the reason stays visible in RepositoryIndex meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from opentelemetry import trace

from inference import model_config_pb2 as mc
from services.orchestrator.ensemble import (
    EnsemblePlan,
    ModelIO,
    StepCall,
    StepStream,
    WireTensor,
)
from shared.errors import MeshError, NotFound, Unavailable
from shared.repository import ModelRepository, is_ensemble, safe_text
from shared.statistics import Metrics, StatsRecorder

log = logging.getLogger(__name__)

ENSEMBLE_VERSION = "1"
"""The one version an ensemble is served as (its folder holds a config, not weights)."""

FetchConfig = Callable[[str], Awaitable[mc.ModelConfig]]


class EnsembleRegistry:
    """Loaded ensemble plans, their failures and their statistics."""

    def __init__(
        self,
        repository: ModelRepository | None,
        fetch_config: FetchConfig,
        metrics: Metrics | None,
        served_whole: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.repository = repository
        self._fetch_config = fetch_config
        self._metrics = metrics
        self._stage_serves = served_whole
        """True when a ready stage serves a model of that name: for an ensemble of
        the repository, the stage runs it whole (services/colocated/)."""
        self._from_repository: set[str] = set()
        """Loaded plans read from the repository (not derived, as an adapter's is)."""
        self.plans: dict[str, EnsemblePlan] = {}
        self.failed: dict[str, str] = {}
        self.stats: dict[str, StatsRecorder] = {}
        self.step_configs: dict[str, dict[str, mc.ModelConfig]] = {}
        """Each loaded plan's stage models' configs, by model (batch sizes, instances)."""

    def names(self) -> list[str]:
        """Ensembles in the repository (loaded or not)."""
        if self.repository is None:
            return []
        names = []
        for name in self.repository.names():
            try:
                if is_ensemble(self.repository.entry(name).config):
                    names.append(name)
            except MeshError as exc:
                # An ensemble whose config is wrong is listed with its error.
                if self.repository.declared_backend(name) == "ensemble":
                    self.failed[name] = self._reason(exc)
                    self.plans.pop(name, None)
                    names.append(name)
        return names

    async def load_all(self) -> None:
        """Load every ensemble; failures are recorded (and logged), not raised."""
        for name in self.names():
            try:
                await self.load(name)
            except MeshError as exc:
                log.error("ensemble '%s' not loaded: %s", name, exc.message)

    async def retry_failed(self) -> None:
        """Try again the ensembles that failed (a stage may have come up)."""
        for name in list(self.failed):
            try:
                await self.load(name)
            except MeshError:
                continue

    async def load(self, name: str, config: mc.ModelConfig | None = None) -> EnsemblePlan:
        """Validate and (re)load one ensemble; raises naming the step on error."""
        from_repository = config is None
        if config is None:
            if self.repository is None:
                raise NotFound(f"Request for unknown model: '{name}' is not found")
            config = self.repository.entry(name).config
        try:
            models: dict[str, ModelIO] = {}
            configs: dict[str, mc.ModelConfig] = {}
            for step in config.ensemble_scheduling.step:
                model = step.model_name
                if model in models:
                    continue
                if model in self.plans:  # a nested ensemble
                    models[model] = self.plans[model].io
                    continue
                try:
                    configs[model] = await self._step_config(model)
                except NotFound:
                    continue  # build() names the step that uses the unknown model
                models[model] = ModelIO.from_config(configs[model])
            plan = EnsemblePlan.build(config, models)
        except MeshError as exc:
            self.failed[name] = self._reason(exc)
            self.plans.pop(name, None)
            raise
        self.plans[name] = plan
        self.step_configs[name] = configs
        if from_repository:
            self._from_repository.add(name)
        else:
            self._from_repository.discard(name)
        self.failed.pop(name, None)
        self.stats.setdefault(name, StatsRecorder(name, ENSEMBLE_VERSION, self._metrics))
        log.info("ensemble '%s' ready (%d steps)", name, len(plan.steps))
        return plan

    def _reason(self, exc: MeshError) -> str:
        """Why an ensemble failed, as any caller may read it (no server paths)."""
        root = self.repository.root if self.repository is not None else None
        return safe_text(exc.message, root)

    async def _step_config(self, model: str) -> mc.ModelConfig:
        """A stage model's config, from the stage that hosts it."""
        try:
            return await self._fetch_config(model)
        except NotFound:
            raise
        except MeshError as exc:
            raise Unavailable(f"model '{model}': config not available: {exc.message}") from exc

    def unload(self, name: str) -> None:
        """Stop serving an ensemble."""
        if self.plans.pop(name, None) is None:
            raise NotFound(f"model '{name}' is not loaded")
        self.step_configs.pop(name, None)
        self._from_repository.discard(name)

    def served_whole(self, name: str) -> bool:
        """True for an ensemble of the repository that a ready stage runs whole: its
        requests go there as a stage model's do, and it does not run here."""
        return name in self._from_repository and self._stage_serves(name)

    def runs_here(self, name: str) -> bool:
        """True when the ensemble ``name`` is loaded here and no stage serves it whole."""
        return name in self.plans and not self.served_whole(name)

    def get(self, name: str) -> EnsemblePlan | None:
        """The plan, or None when ``name`` is not an ensemble run here (a stage
        model, or an ensemble a stage serves whole); raises if it failed here."""
        if self.served_whole(name):
            return None
        plan = self.plans.get(name)
        if plan is None and name in self.failed:
            raise Unavailable(
                f"Request for unknown model: '{name}' has no available versions: "
                f"failed to load '{name}': {self.failed[name]}"
            )
        return plan

    @contextlib.contextmanager
    def recorded(self, name: str) -> Iterator[None]:
        """Record one request's outcome and duration in the ensemble's statistics."""
        started = time.monotonic_ns()
        recorder = self.stats[name]
        try:
            yield
        except BaseException:
            recorder.request_done(time.monotonic_ns() - started, 0, False, "BACKEND")
            raise
        elapsed = time.monotonic_ns() - started
        recorder.request_done(elapsed, 0, True)
        recorder.batch_done(1, 0, elapsed, 0)

    async def stream(
        self,
        plan: EnsemblePlan,
        inputs: dict[str, WireTensor],
        call: StepCall,
        stream_call: StepStream,
        tracer: trace.Tracer,
    ) -> AsyncIterator[dict[str, WireTensor]]:
        """Stream one request through a decoupled ``plan``, recording statistics."""
        with self.recorded(plan.name):
            async for outputs in plan.stream(inputs, call, stream_call, tracer):
                yield outputs

    async def run(
        self,
        plan: EnsemblePlan,
        inputs: dict[str, WireTensor],
        call: StepCall,
        tracer: trace.Tracer,
    ) -> dict[str, WireTensor]:
        """Run one request through ``plan``, recording statistics."""
        with self.recorded(plan.name):
            return await plan.run(inputs, call, tracer)
