"""Where the local mesh serves HTTP: in the orchestrator, or in an HTTP adapter process.

``supervisor.http_front_door`` in the mesh YAML:

    orchestrator   (the default) the orchestrator serves the HTTP front door itself
                   (it runs as gateway/http/in_orchestrator.py), on the port
                   planned for the HTTP adapter (``services.http_adapter.http_port``),
                   with the adapter's settings from ``services.http_adapter``; Envoy
                   sends REST there. One process and one gRPC hop less per request.
    process        the HTTP adapter runs as its own process (gateway/http/main.py),
                   calling the orchestrator over gRPC (as in Kubernetes).

Either way the mesh's ready line names where REST is served
(``http_front_door``: the address Envoy sends it to). docs/http-front-door.md
says why the default is what it is and what each costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from deploy.local.port_plan import Listener, PortPlanError
from deploy.local.service_process import ManagedProcess, ProcessSpec

MODES = ("orchestrator", "process")
DEFAULT_MODE = "orchestrator"
HTTP_PORT_FLAG = "--http-port"
IN_ORCHESTRATOR = "gateway.http.in_orchestrator"
"""The orchestrator's entry point with the HTTP front door on its loop."""
SETTINGS = ("max_body_bytes", "request_timeout_s", "model_store")
"""The HTTP adapter's settings the orchestrator takes on with its front door."""


def front_door_mode(mesh: dict[str, Any]) -> str:
    """``supervisor.http_front_door``, checked."""
    mode = str((mesh.get("supervisor") or {}).get("http_front_door", DEFAULT_MODE))
    if mode not in MODES:
        raise PortPlanError(
            f"supervisor.http_front_door must be one of {', '.join(MODES)}, not {mode!r}"
        )
    return mode


def place_front_door(
    mesh: dict[str, Any], orchestrator: ProcessSpec, edge: Sequence[ProcessSpec]
) -> tuple[ProcessSpec, list[ProcessSpec]]:
    """The orchestrator and edge processes with the HTTP front door where the mesh
    YAML puts it (``front_door_listeners`` names the port it adds to the plan)."""
    adapters = [spec for spec in edge if spec.stage == "http_adapter"]
    if front_door_mode(mesh) == "process" or not adapters:
        return orchestrator, list(edge)
    (adapter,) = adapters
    settings = ((mesh.get("services") or {}).get("http_adapter")) or {}
    flags: list[str] = [HTTP_PORT_FLAG, str(adapter.grpc_port)]
    for name in SETTINGS:
        if settings.get(name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(settings[name])]
    served = replace(orchestrator, module=IN_ORCHESTRATOR, args=(*orchestrator.args, *flags))
    return served, [spec for spec in edge if spec is not adapter]


def front_door_listeners(spec: ProcessSpec) -> list[Listener]:
    """The HTTP port of a process that serves the front door beside its gRPC port."""
    if spec.port_flag == HTTP_PORT_FLAG or HTTP_PORT_FLAG not in spec.args:
        return []
    port = int(spec.args[spec.args.index(HTTP_PORT_FLAG) + 1])
    return [Listener(spec.name, "HTTP", port)]


def front_door_address(orchestrator: ManagedProcess, edge: Sequence[ManagedProcess]) -> str | None:
    """Where REST is served (``host:port``): the orchestrator's HTTP port, or the
    adapter process's address; None in a mesh without an edge."""
    served = front_door_listeners(orchestrator.spec)
    if served:
        return f"{orchestrator.address.rsplit(':', 1)[0]}:{served[0].port}"
    adapters = [process.address for process in edge if process.spec.stage == "http_adapter"]
    return adapters[0] if adapters else None


def announce_front_door(orchestrator: ManagedProcess, edge: Sequence[ManagedProcess]) -> str:
    """The supervisor's line saying which process serves REST, and where."""
    address = front_door_address(orchestrator, edge)
    if address is None:
        return "no HTTP front door (supervisor.edge is off)"
    who = "the orchestrator" if front_door_listeners(orchestrator.spec) else "the http_adapter"
    return f"HTTP front door (KServe v2 REST, OpenAI, TorchServe APIs): {who} on {address}"
