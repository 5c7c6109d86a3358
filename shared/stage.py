"""A stage service: the shared v2 server plus the backends it registers.

The inference, tokenizer, preprocess and postprocess services differ only in
their backends; each ``main`` builds a ``StageConfig`` and calls ``run_stage``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from pydantic import Field

from shared import launch
from shared.backend import Backend
from shared.batch_delay import QueueDelayPolicy
from shared.config import ServiceConfig, load_config
from shared.cpu_policy import CpuPolicy
from shared.launch import run_service
from shared.manager import ModelManager
from shared.queue_bounds import (
    DEFAULT_QUEUE_TIMEOUT_US,
    QUEUED_BATCHES_PER_INSTANCE,
    STREAMS_PER_INSTANCE,
    QueueDefaults,
)
from shared.repository import ModelRepository
from shared.server import Hook, ServiceParts
from shared.servicer import SERVICE_NAME, InferenceServicer, add_to_server
from shared.shared_memory import SharedMemoryRegions
from shared.statistics import Metrics
from shared.tracing import make_tracer_provider, tracer_for


class StageConfig(ServiceConfig):
    """Settings of a stage service (any service that hosts models)."""

    cpu_policy: CpuPolicy = "normal"
    """The scheduling policy of the stage's threads (shared/cpu_policy.py): normal, the
    kernel's default, so that work arriving at the model's service takes a core at
    once; batch (SCHED_BATCH), as the services in front of it run."""
    model_repository: Path = Path("model_repository")
    """Triton-layout model repository folder."""
    load_models: list[str] = Field(default_factory=list)
    """Models to load at start; empty loads every model this service hosts."""
    orchestrator: str | None = None
    """The orchestrator (host:port) that models here call for models elsewhere
    (Triton's BLS); unset: they reach only the models of this stage."""
    default_queued_batches: int = Field(QUEUED_BATCHES_PER_INSTANCE, ge=0, le=1_000_000)
    """For models whose config bounds no queue: full batches (requests, when unbatched)
    queued per instance and priority level before RESOURCE_EXHAUSTED; 0: unbounded."""
    default_queue_timeout_s: float = Field(DEFAULT_QUEUE_TIMEOUT_US / 1e6, ge=0.0, le=86_400.0)
    """For models whose config sets no queue timeout: longest wait in a queue before
    UNAVAILABLE; 0: no limit."""
    default_streams_per_instance: int = Field(STREAMS_PER_INSTANCE, ge=0, le=1_000_000)
    """For decoupled models whose config sets no max_queue_size: streams open at once per
    instance before RESOURCE_EXHAUSTED; 0: unbounded."""
    default_queue_delay_policy: QueueDelayPolicy = "adaptive"
    """For batching models whose config sets no ``queue_delay_policy`` parameter: how a
    partial batch waits, ``adaptive`` (only while requests arrive together) or
    ``fixed`` (Triton's: the whole max_queue_delay_microseconds)."""

    def queue_defaults(self) -> QueueDefaults:
        """The bounds this stage gives models whose config sets none."""
        return QueueDefaults(
            queued_batches_per_instance=self.default_queued_batches,
            queue_timeout_us=round(self.default_queue_timeout_s * 1e6),
            streams_per_instance=self.default_streams_per_instance,
            queue_delay_policy=self.default_queue_delay_policy,
        )


@dataclass(frozen=True)
class StageContext:
    """What a backend that works with its stage is given (``StageBackend.attach``)."""

    config: StageConfig
    manager: ModelManager
    """The stage's models: a backend may call them (BLS)."""
    registry: CollectorRegistry
    """The stage's /metrics registry."""
    tracer: trace.Tracer
    """The stage's tracer (a no-op one when tracing is off)."""


@runtime_checkable
class StageBackend(Protocol):
    """A backend that needs the stage it runs in: its models, metrics, start and stop."""

    def attach(self, stage: StageContext) -> tuple[list[Hook], list[Hook]]:
        """Bind to ``stage``; hooks to run before the models load and after they unload."""
        ...


def build_stage_parts(config: StageConfig, backends: Mapping[str, Backend]) -> ServiceParts:
    """The v2 servicer over a model manager with ``backends``, and its hooks."""
    provider = make_tracer_provider(
        config.service_name, config.otlp_endpoint, sample_ratio=config.trace_sample_ratio
    )
    parts = ServiceParts(servicers=[], service_names=[SERVICE_NAME], tracer_provider=provider)
    manager = ModelManager(
        ModelRepository(config.model_repository),
        backends,
        Metrics(parts.registry),
        config.queue_defaults(),
    )
    manager.starting = True  # until load_all is done: its models are loading, not unknown
    regions = SharedMemoryRegions(config.allow_client_shm, config.shm_handoff)
    servicer = InferenceServicer(manager, config.max_message_bytes, regions)
    parts.servicers = [(add_to_server, servicer)]
    context = StageContext(config, manager, parts.registry, tracer_for(provider, "meshserve.stage"))
    starts: list[Hook] = []
    stops: list[Hook] = []
    for backend in backends.values():
        if isinstance(backend, StageBackend):
            start, stop = backend.attach(context)
            starts += start
            stops += stop

    async def load() -> None:
        await manager.load_all(config.load_models or None)

    parts.on_start = [*starts, load]
    parts.on_stop = [manager.unload_all, *stops, regions.close]
    return parts


def run_stage(
    service: str,
    config_class: type[StageConfig],
    backends: Mapping[str, Backend],
    argv: Sequence[str] | None,
) -> None:
    """Parse the config once, then serve ``backends`` until SIGTERM."""
    config = load_config(config_class, argv, service=service)
    launch.run(run_service(config, build_stage_parts(config, backends)), config)
