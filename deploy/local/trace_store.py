"""The trace store in the local mesh: started first, every service exports to it.

``plan_traces`` says whether the supervisor runs the store (services/tracestore):
by default yes, unless the mesh YAML (``defaults.otlp_endpoint``) or the
environment (``MESHSERVE_OTLP_ENDPOINT``) already names a collector, or
``supervisor.trace_store`` is false. When it runs, every other process gets
``MESHSERVE_OTLP_ENDPOINT`` pointing at it, and Envoy routes ``/traces`` and
Jaeger's ``/api/traces`` / ``/api/services`` to its query port.

Ports come from ``services.tracestore`` (``grpc_port`` OTLP/gRPC, default
4317; ``otlp_http_port``, 4318; ``http_port``, the query API and page, 16686);
with ``--ports auto`` free ones, none of them a port the rest of the plan took.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deploy.local.port_plan import Listener
from deploy.local.service_process import ProcessSpec

OTLP_ENV = "MESHSERVE_OTLP_ENDPOINT"
DEFAULT_PORTS = {"grpc_port": 4317, "otlp_http_port": 4318, "http_port": 16686}


@dataclass(frozen=True)
class TracePlan:
    """The store's process, the environment that points services at it, its listeners."""

    specs: list[ProcessSpec] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    listeners: list[Listener] = field(default_factory=list)
    query_address: str = ""
    """host:port of the query API and the /traces page (empty: no store)."""


def plan_traces(
    mesh: Mapping[str, Any],
    auto_ports: bool,
    host: str,
    fresh_port: Callable[[], int],
    env: Mapping[str, str] | None = None,
) -> TracePlan:
    """The trace store's part of the mesh (an empty plan where it does not run); with
    ``auto_ports``, its ports from ``fresh_port`` (the plan's: never one of its others)."""
    env = os.environ if env is None else env
    defaults = mesh.get("defaults") or {}
    wanted = (mesh.get("supervisor") or {}).get("trace_store", True)
    if not wanted or defaults.get("otlp_endpoint") or env.get(OTLP_ENV):
        return TracePlan()
    settings = (mesh.get("services") or {}).get("tracestore") or {}
    ports = {
        name: fresh_port() if auto_ports else int(settings.get(name, default))
        for name, default in DEFAULT_PORTS.items()
    }
    spec = ProcessSpec(
        "tracestore",
        "tracestore",
        "services.tracestore.main",
        ports["grpc_port"],
        -1,
        ("--otlp-http-port", str(ports["otlp_http_port"]), "--http-port", str(ports["http_port"])),
    )
    listeners = [
        Listener("tracestore", "OTLP/gRPC", ports["grpc_port"]),
        Listener("tracestore", "OTLP/HTTP", ports["otlp_http_port"]),
        Listener("tracestore", "HTTP", ports["http_port"]),
    ]
    return TracePlan(
        [spec],
        {OTLP_ENV: f"{host}:{ports['grpc_port']}"},
        listeners,
        f"{host}:{ports['http_port']}",
    )


def route_edge(edge: Sequence[ProcessSpec], traces: TracePlan) -> list[ProcessSpec]:
    """The edge's processes, Envoy told where the trace store's query port is."""
    if not traces.query_address:
        return list(edge)
    return [
        replace(spec, args=(*spec.args, "--trace-store", traces.query_address))
        if spec.stage == "envoy"
        else spec
        for spec in edge
    ]
