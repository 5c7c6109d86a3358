"""The HTTP adapter process: KServe v2 REST and the OpenAI API in, gRPC to the orchestrator.

``python -m gateway.http.main --orchestrator 127.0.0.1:8001 --http-port 8007``

The same front door can run inside the orchestrator instead (its ``http_port``;
docs/http-front-door.md): one hop less. This process is for meshes that keep
the front door apart (Kubernetes' http-adapter Deployment, a local mesh with
``supervisor.http_front_door: process``).

When ready it prints ``MESHSERVE_READY {json}`` like every service, with its
HTTP address under ``http`` and, so launchers that read ``grpc`` as "the
service's address" work unchanged, the same address under ``grpc``.
On SIGTERM the front door drains (front_door.py), then the gRPC channels close.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence

from pydantic import Field

from gateway.http.app import AdapterState
from gateway.http.front_door import CUT_REASON, FrontDoor, HttpSettings, drain
from gateway.http.torchserve_store import ModelStore
from gateway.http.upstream import Upstream
from shared import launch
from shared.channels import use_mesh_tls
from shared.config import load_config
from shared.launch import READY_MARKER
from shared.metrics_http import start_metrics_server
from shared.mtls import MeshTls
from shared.server import setup_logging, stop_signals
from shared.tracing import make_tracer_provider, tracer_for

__all__ = ["CUT_REASON", "HttpAdapterConfig", "drain", "main", "serve"]

log = logging.getLogger(__name__)

SERVICE = "http_adapter"


class HttpAdapterConfig(HttpSettings):
    """Settings of the HTTP adapter (KServe v2 REST and OpenAI API)."""

    http_port: int = Field(8007, ge=0, le=65535)
    """HTTP port of the REST API; 0 picks a free one (printed on start)."""
    grpc_port: int = Field(0, ge=0, le=65535)
    """Ignored: the adapter serves no gRPC (accepted so launchers pass it uniformly)."""
    orchestrator: str = Field("127.0.0.1:8001", pattern=r"^\S+:\d{1,5}$")
    """The orchestrator's KServe v2 gRPC address (host:port)."""
    channels: int = Field(4, ge=1, le=64)
    """gRPC connections to the orchestrator; calls go round robin over them."""


def _announce(config: HttpAdapterConfig, address: str, metrics_port: int | None) -> None:
    info = {
        "service": config.service_name,
        "grpc": address,
        "http": address,
        "metrics_port": metrics_port,
    }
    print(f"{READY_MARKER} {json.dumps(info)}", flush=True)


async def serve(config: HttpAdapterConfig) -> None:
    """Serve the REST API until SIGTERM or SIGINT, then drain and stop."""
    provider = make_tracer_provider(
        config.service_name, config.otlp_endpoint, sample_ratio=config.trace_sample_ratio
    )
    tracer = tracer_for(provider, "meshserve.http_adapter")
    # Mutual TLS, when configured: Envoy must show a certificate here, and the
    # adapter shows its own to the orchestrator.
    tls = MeshTls.from_config(config)
    use_mesh_tls(tls)
    upstream = Upstream(
        config.orchestrator,
        channels=config.channels,
        max_message_bytes=config.max_message_bytes,
        timeout_s=config.request_timeout_s,
        tracer=tracer,
    )
    state = AdapterState(upstream, tracer, config.max_body_bytes)
    state.model_store = ModelStore(config.model_store, config.model_repository)
    door = FrontDoor(state, config.grace_period_s)
    metrics = None
    with stop_signals() as stop:
        try:
            ssl_context = tls.server_ssl_context() if tls is not None else None
            address = await door.start(config.host, config.http_port, ssl_context)
            if config.metrics_port >= 0:
                metrics = start_metrics_server(config.host, config.metrics_port, state.registry)
            _announce(config, address, metrics.server_address[1] if metrics else None)
            log.info("%s listening on http://%s -> %s", SERVICE, address, config.orchestrator)
            await stop.wait()
            log.info("%s draining (grace %.1fs)", SERVICE, config.grace_period_s)
        finally:
            await door.drain()
            await upstream.close()
            if metrics is not None:
                metrics.shutdown()
                metrics.server_close()
            if provider is not None:
                provider.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and serve until SIGTERM."""
    config = load_config(HttpAdapterConfig, argv, service=SERVICE)
    setup_logging(config.log_level, config.log_format, config.service_name)
    try:
        launch.run(serve(config), config)
    except OSError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
