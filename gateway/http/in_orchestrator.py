"""The orchestrator process with the HTTP front door on its loop.

``python -m gateway.http.in_orchestrator --stages inference=127.0.0.1:8003 ...
--model-repository DIR --http-port 8007``: every flag of
``services.orchestrator.main``, plus the HTTP adapter's (``HttpSettings``); it
reads ``services.orchestrator`` of the mesh YAML. The local mesh runs it by default
(``supervisor.http_front_door: orchestrator``, deploy/local/http_front_door.py).

::

    Envoy --HTTP--> aiohttp app (gateway/http/app.py) --CoreUpstream--> core --gRPC--> stages
    Envoy --gRPC--> v2 / meshserve.v1 servicers ----------------------> core

The HTTP front door is the HTTP adapter's application, translating as it
does there, but over the core in this process (gateway/http/core_upstream.py)
instead of a gRPC client to it: the REST path loses a process, a gRPC client
call and a gRPC server call per request.

Start: stages' router, ensembles, the gRPC server, then the HTTP listener
(the calls the core does not answer go to this process's own gRPC address);
then one ready line with both addresses. Stop (SIGTERM): the HTTP and gRPC
doors drain side by side, each within the grace period; the router stops
only once both are done, so no HTTP request in flight loses its stage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from pydantic import Field

from gateway.http.app import AdapterState
from gateway.http.core_upstream import CoreUpstream
from gateway.http.front_door import FrontDoor, HttpSettings
from gateway.http.torchserve_store import ModelStore
from services.orchestrator.core import Orchestrator
from services.orchestrator.main import OrchestratorConfig, build_parts
from services.orchestrator.servicer import OrchestratorServicer
from shared import gc_heap, launch
from shared.config import load_config
from shared.launch import READY_MARKER
from shared.mtls import MeshTls
from shared.server import MeshServer, ServiceParts, setup_logging, stop_signals
from shared.tracing import tracer_for

log = logging.getLogger(__name__)

LOOPBACK_CHANNELS = 2
"""Connections to this process's own gRPC port (the OpenAI routes' meshserve.v1
calls, server metadata, log and trace settings)."""


class OrchestratorHttpConfig(OrchestratorConfig, HttpSettings):
    """Settings of the orchestrator and of the HTTP front door it serves."""

    http_port: int = Field(8007, ge=0, le=65535)
    """HTTP port of the front door (KServe v2 REST, OpenAI, TorchServe APIs); 0 picks
    a free one (printed on start)."""


class HttpDoor:
    """The HTTP front door over ``core``; its metrics go to the orchestrator's registry."""

    def __init__(self, config: OrchestratorHttpConfig, core: Orchestrator, parts: ServiceParts):
        self.config = config
        self.core = core
        self.parts = parts
        self.upstream: CoreUpstream | None = None
        self.door: FrontDoor | None = None
        self._drained = asyncio.Event()

    async def start(self, grpc_address: str) -> str:
        """Listen; the bound ``host:port``."""
        config = self.config
        tracer = tracer_for(self.parts.tracer_provider, "meshserve.http")
        self.upstream = CoreUpstream(
            self.core,
            grpc_address,
            channels=LOOPBACK_CHANNELS,
            max_message_bytes=config.max_message_bytes,
            timeout_s=config.request_timeout_s,
            tracer=tracer,
        )
        state = AdapterState(self.upstream, tracer, config.max_body_bytes, self.parts.registry)
        state.model_store = ModelStore(config.model_store, config.model_repository)
        self.door = FrontDoor(state, config.grace_period_s)
        tls = MeshTls.from_config(config)
        ssl_context = tls.server_ssl_context() if tls is not None else None
        return await self.door.start(config.host, config.http_port, ssl_context)

    async def drain(self) -> None:
        """Refuse new requests, let those in flight finish, close the loopback channels."""
        try:
            if self.door is not None:
                await self.door.drain()
            if self.upstream is not None:
                await self.upstream.close()
        finally:
            self._drained.set()

    async def drained(self) -> None:
        """Return once ``drain`` has finished (a stop hook: before the router stops)."""
        await self._drained.wait()


def _announce(server: MeshServer, http: str) -> None:
    info = {
        "service": server.config.service_name,
        "grpc": server.address,
        "http": http,
        "metrics_port": server.metrics_port if server.config.metrics_port >= 0 else None,
    }
    if server.wire_address is not None:
        info["wire"] = server.wire_address
    print(f"{READY_MARKER} {json.dumps(info)}", flush=True)


async def serve(config: OrchestratorHttpConfig) -> None:
    """Serve gRPC and HTTP until SIGTERM or SIGINT, then drain both and stop."""
    setup_logging(config.log_level, config.log_format, config.service_name)
    parts = build_parts(config)
    core = next(s.core for _, s in parts.servicers if isinstance(s, OrchestratorServicer))
    http = HttpDoor(config, core, parts)
    parts.on_stop = [http.drained, *parts.on_stop]
    server = MeshServer(config, parts)
    with stop_signals() as stop:
        try:
            await server.start()
            address = await http.start(server.address)
            gc_heap.freeze()  # what it loaded stays: no full collection walks it again
            log.info("%s listening on %s, HTTP on %s", config.service_name, server.address, address)
            _announce(server, address)
            await stop.wait()
            log.info("%s draining (grace %.1fs)", config.service_name, config.grace_period_s)
        except Exception as exc:
            print(f"{config.service_name}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from exc
        finally:
            draining = asyncio.create_task(http.drain())
            await server.stop()  # its first stop hook waits for the HTTP drain
            await draining


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and serve until SIGTERM."""
    config = load_config(OrchestratorHttpConfig, argv, service="orchestrator")
    launch.run(serve(config), config)


if __name__ == "__main__":
    main(sys.argv[1:])
