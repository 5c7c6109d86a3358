"""The server bootstrap every service uses: ``serve(config, parts)``.

One ``grpc.aio`` server with the shared interceptors (errors, tracing, drain
gate), grpc.health.v1, server reflection, a Prometheus ``/metrics`` endpoint,
message-size limits from config, mutual TLS when configured (``shared.mtls``),
and graceful shutdown: health turns
NOT_SERVING at once, new RPCs are refused, in-flight RPCs get up to
``grace_period_s`` to finish, then the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from shared import cpu_policy, event_loop, gc_heap, logs
from shared.allocator import keep_large_blocks
from shared.channels import use_mesh_tls
from shared.config import ServiceConfig
from shared.h2grpc.connection import MIN_PING_INTERVAL_S
from shared.h2grpc.server import LeanServer
from shared.interceptors import DrainGate, ErrorInterceptor
from shared.metrics_http import start_metrics_server
from shared.mtls import MeshTls
from shared.trace_interceptors import TracingInterceptor
from shared.tracing import make_tracer_provider, tracer_for
from shared.wire_door import WireDoor, WireHandler

log = logging.getLogger(__name__)

PING_INTERVAL_MS = int(MIN_PING_INTERVAL_S * 1000)
"""The shortest gap between a client's pings that a server takes without answering
GOAWAY "too_many_pings" (after two strikes), with or without calls open. gRPC
clients send at most one a second (BDP probes; keepalive every 30 s,
shared/channels.py), but a server's defaults allow one per 5 minutes while it
sends nothing, and one per 2 hours on a connection with no call open: a stage
whose orchestrator probed an idle connection a few times dropped it with the
request that came next. Half the clients' gap absorbs a busy host's delays;
a flood is still refused."""

FLUSH_GRACE_S = 0.2
"""Grace for the server's own stop once no counted RPC is left: time for the
last answers to go out. Open streams that were never counted (health Watch, a
stream opened ahead and idle) are cancelled after it rather than waited for."""

Hook = Callable[[], Awaitable[None]]


@dataclass
class ServiceParts:
    """What a concrete service adds to the shared server."""

    servicers: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any]]
    """``(add_XServicer_to_server, servicer)`` pairs."""
    service_names: Sequence[str]
    """Full service names, for health and reflection."""
    on_start: Sequence[Hook] = ()
    """Run after the port is bound, before health says SERVING (e.g. load models)."""
    on_stop: Sequence[Hook] = ()
    """Run after the gRPC server stopped (e.g. stop batchers, unload models)."""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    """Prometheus registry served on /metrics."""
    tracer_provider: TracerProvider | None = None
    """Set when the service's own code makes spans (else the server makes one)."""
    wire_handlers: Mapping[str, WireHandler] = field(default_factory=dict)
    """Unary methods (by path) also served on the wire door, when ``wire_port`` is set."""


class MeshServer:
    """A started-and-stoppable server; ``serve`` wraps it with signal handling."""

    def __init__(
        self,
        config: ServiceConfig,
        parts: ServiceParts,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.config = config
        self.parts = parts
        self.tracer_provider = (
            tracer_provider
            or parts.tracer_provider
            or make_tracer_provider(
                config.service_name, config.otlp_endpoint, sample_ratio=config.trace_sample_ratio
            )
        )
        self.gate = DrainGate()
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_httpd: Any = None
        self._tls: MeshTls | None = None
        self.wire: WireDoor | None = None
        self.wire_address: str | None = None
        """``host:port`` of the wire door (None: off)."""
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        """``host:port`` of the bound gRPC server."""
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        """Bind, run the start hooks, then report SERVING."""
        keep_large_blocks()  # tensors of hundreds of KB, allocated and freed per request
        log.info("event loop: %s, cpu policy: %s", event_loop.running(), cpu_policy.current())
        server = self._grpc_server()
        for add, servicer in self.parts.servicers:
            add(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            *self.parts.service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        self.port = self._bind(server)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC port {self.config.host}:{self.config.grpc_port}")
        self._server = server
        # Before the port answers: grpc's health servicer says SERVING for "" until told.
        for name in ["", *self.parts.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if self.config.metrics_port >= 0:
            self._metrics_httpd = start_metrics_server(
                self.config.host, self.config.metrics_port, self.parts.registry
            )
            self.metrics_port = self._metrics_httpd.server_address[1]
        if self.config.wire_port >= 0 and self.parts.wire_handlers:
            await self._open_wire()
        for hook in self.parts.on_start:
            await hook()
        for name in ["", *self.parts.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _grpc_server(self) -> grpc.aio.Server:
        """grpc.aio's server, or the one on asyncio (shared/h2grpc/) where the config
        asks for it and the port is cleartext."""
        limit = self.config.max_message_bytes
        # Outermost first: the error map sees the gate's refusals, and the span records them.
        interceptors = [
            ErrorInterceptor(),
            TracingInterceptor(tracer_for(self.tracer_provider, "meshserve.server")),
            self.gate,
        ]
        if self.config.grpc_server == "asyncio" and MeshTls.from_config(self.config) is None:
            log.info("gRPC served on asyncio (shared/h2grpc/)")
            return LeanServer(interceptors, limit)
        return grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", PING_INTERVAL_MS),
            ],
        )

    async def _open_wire(self) -> None:
        """The wire door beside the gRPC port: the same drain gate, TLS and limit."""
        config = self.config
        self.wire = WireDoor(
            self.parts.wire_handlers,
            tracer_for(self.tracer_provider, "meshserve.server"),
            config.max_message_bytes,
            self.gate,
        )
        context = self._tls.server_ssl_context() if self._tls is not None else None
        self.wire_address = await self.wire.start(config.host, config.wire_port, context)

    def _bind(self, server: grpc.aio.Server) -> int:
        """The port, TLS with client certificates when mutual TLS is configured; the
        channels this process opens then show the same certificate."""
        address = f"{self.config.host}:{self.config.grpc_port}"
        tls = self._tls = MeshTls.from_config(self.config)  # the wire door's too
        if tls is None:
            port: int = server.add_insecure_port(address)
            return port
        use_mesh_tls(tls)
        port = server.add_secure_port(address, tls.server_credentials())
        return port

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new RPCs, let in-flight ones finish, stop."""
        if self._server is None or self._stopped.is_set():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_period_s
        await self.health.enter_graceful_shutdown()
        self.gate.close()
        try:
            await asyncio.wait_for(self.gate.idle(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            log.warning("%d RPC(s) still in flight after the grace period", self.gate.in_flight)
        # Whatever still runs once the counted RPCs are done was never counted
        # and needs no grace; past the deadline the server cancels the rest.
        await self._server.stop(min(FLUSH_GRACE_S, max(0.0, deadline - loop.time())))
        if self.wire is not None:
            self.wire.close()
        for hook in self.parts.on_stop:
            try:
                await hook()
            except Exception:
                log.exception("stop hook failed")
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        """Return once ``stop`` has finished."""
        await self._stopped.wait()


async def serve(
    config: ServiceConfig,
    parts: ServiceParts,
    on_ready: Callable[[MeshServer], None] | None = None,
) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully."""
    server = MeshServer(config, parts)
    with stop_signals() as stop:
        try:
            await server.start()
            gc_heap.freeze()  # what it loaded stays: no full collection walks it again
            metrics = (
                f", metrics http://{config.host}:{server.metrics_port}/metrics"
                if (config.metrics_port >= 0)
                else ""
            )
            log.info("%s listening on %s%s", config.service_name, server.address, metrics)
            if on_ready is not None:
                on_ready(server)
            await stop.wait()
            log.info("%s draining (grace %.1fs)", config.service_name, config.grace_period_s)
        finally:
            await server.stop()


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event that SIGTERM or SIGINT sets, for the block (the running loop's
    handlers are removed after it, once the caller has stopped what it ran)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def setup_logging(level: str, log_format: str = "text", service: str = "") -> None:
    """Plain, greppable log lines (or JSON lines with trace ids) at the service's level."""
    logs.configure(level, log_format, service)
