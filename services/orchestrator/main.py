"""The orchestrator: KServe v2 for every model in the mesh; runs ensembles.

``python -m services.orchestrator.main --stages inference=127.0.0.1:8003 ...
--model-repository DIR``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from services.batch.job_api import add_job_api
from services.orchestrator.core import Orchestrator
from services.orchestrator.discovery import Resolver
from services.orchestrator.endpoint import INFER_METHOD, StageAddress
from services.orchestrator.ensembles import EnsembleRegistry
from services.orchestrator.handoff import HandoffPool
from services.orchestrator.mesh_api import MESH_SERVICE_NAME, MeshApiServicer, add_mesh_api
from services.orchestrator.route_api import ROUTE_SERVICE_NAME, RouteApiServicer, add_route_api
from services.orchestrator.route_table import RouteTable
from services.orchestrator.router import Discovery, StageRouter
from services.orchestrator.routes import load_routes
from services.orchestrator.servicer import OrchestratorServicer, add_orchestrator
from shared import launch
from shared.config import ServiceConfig, load_config
from shared.launch import run_service
from shared.repository import ModelRepository
from shared.server import ServiceParts
from shared.servicer import SERVICE_NAME
from shared.shared_memory import SharedMemoryRegions
from shared.statistics import Metrics
from shared.tracing import make_tracer_provider, tracer_for


class OrchestratorConfig(ServiceConfig):
    """Settings of the orchestrator."""

    grpc_port: int = Field(8001, ge=0, le=65535)
    """The mesh's public gRPC port (KServe v2)."""
    metrics_port: int = Field(8002, ge=-1, le=65535)
    """Prometheus /metrics port; 0 picks a free one, -1 turns it off."""
    stages: list[str] = Field(default_factory=list)
    """Stage endpoints as name=host:port (repeat the flag); a host that is a name
    stands for every address it resolves to (docs/discovery.md)."""
    hosts_file: Path | None = None
    """A hosts file (ADDRESS NAME per line) read before DNS; every line of a name
    counts, so one name can list several replicas."""
    resolve_interval_s: float = Field(5.0, ge=0.1, le=3600.0)
    """How often stage hosts are resolved again (new replicas join, vanished ones go)."""
    retire_grace_s: float = Field(5.0, ge=0.0, le=600.0)
    """How long calls in flight on a vanished replica may run before they are
    cut and retried on another one."""
    model_repository: Path | None = None
    """Repository holding the ensembles (the same folder the stages read)."""
    channels_per_stage: int = Field(4, ge=1, le=64)
    """HTTP/2 connections to each stage replica (one caps throughput under load)."""
    refresh_interval_s: float = Field(2.0, ge=0.1, le=300.0)
    """How often stage discovery re-reads each replica's RepositoryIndex."""
    spare_streams: int = Field(4, ge=0, le=64)
    """ModelStreamInfer calls kept open ahead of their requests per stage replica
    that is streamed to (a request takes one instead of setting a stream up)."""
    packed_forwarding: bool = True
    """Forwarded requests travel several to a message to a stage that serves
    meshserve.v1.ForwardingService (false: one to a message, as to other servers)."""
    stage_client: Literal["asyncio", "grpcio"] = "asyncio"
    """What carries the streams of forwarded requests to the stages: the project's
    own HTTP/2 client on asyncio (shared/h2grpc/client.py), which costs a fraction
    of grpcio's CPU per message, or grpcio's (grpc.aio); cleartext only, so with
    mutual TLS grpcio's carries them."""


def build_parts(config: OrchestratorConfig) -> ServiceParts:
    """Router, ensemble registry, the core, its front doors and their start/stop hooks."""
    provider = make_tracer_provider(
        config.service_name, config.otlp_endpoint, sample_ratio=config.trace_sample_ratio
    )
    tracer = tracer_for(provider, "meshserve.orchestrator")
    parts = ServiceParts(
        servicers=[],
        service_names=[SERVICE_NAME, MESH_SERVICE_NAME, ROUTE_SERVICE_NAME],
        tracer_provider=provider,
    )
    router = StageRouter(
        [StageAddress.parse(text) for text in config.stages],
        channels_per_endpoint=config.channels_per_stage,
        max_message_bytes=config.max_message_bytes,
        tracer=tracer,
        refresh_interval_s=config.refresh_interval_s,
        spare_streams=config.spare_streams,
        packed_forwarding=config.packed_forwarding,
        lean_streams=config.stage_client == "asyncio",
        discovery=Discovery(
            Resolver(config.hosts_file), config.resolve_interval_s, config.retire_grace_s
        ),
    )
    repository = ModelRepository(config.model_repository) if config.model_repository else None
    ensembles = EnsembleRegistry(
        repository, router.model_config, Metrics(parts.registry), served_whole=router.hosts
    )
    routes = RouteTable(load_routes(config.model_repository), parts.registry)
    regions = SharedMemoryRegions(config.allow_client_shm)
    handoff = HandoffPool() if config.shm_handoff else None
    core = Orchestrator(router, ensembles, tracer, routes, regions, handoff)
    servicer = OrchestratorServicer(core)
    parts.servicers = [
        (add_orchestrator, servicer),
        (add_mesh_api, MeshApiServicer(core)),
        (add_route_api, RouteApiServicer(core)),
    ]

    async def start() -> None:
        await router.start()
        await ensembles.load_all()
        router.on_change = ensembles.retry_failed

    # Envoy's edge sends unary ModelInfer here over HTTP/1.1 (gateway/envoy/wire.py).
    parts.wire_handlers = {INFER_METHOD: servicer.forward_infer}
    parts.on_start = [start]
    parts.on_stop = [routes.close, core.runner.close, router.stop, regions.close]
    if handoff is not None:
        parts.on_stop.append(handoff.aclose)
    add_job_api(parts)  # batch jobs' meshserve.v1 API, when a job queue is configured
    return parts


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and serve until SIGTERM."""
    config = load_config(OrchestratorConfig, argv, service="orchestrator")
    launch.run(run_service(config, build_parts(config)), config)


if __name__ == "__main__":
    main(sys.argv[1:])
