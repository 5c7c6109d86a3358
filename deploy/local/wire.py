"""The orchestrator's wire door in the local mesh (shared/wire_door.py).

With an edge and ``services.orchestrator.wire_port`` set (0: a free port), the
orchestrator also serves unary ModelInfer over HTTP/1.1 there and Envoy sends
every gRPC ModelInfer through its reverse bridge (gateway/envoy/wire.py).
Unset or -1, the call stays on the gRPC port, which costs the path less
(docs/envoy.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from deploy.local.port_plan import Listener
from deploy.local.service_process import ProcessSpec

WIRE_PORT_FLAG = "--wire-port"


def open_wire(
    orchestrator: ProcessSpec, edge: Sequence[ProcessSpec], host: str, port: int
) -> tuple[ProcessSpec, list[ProcessSpec]]:
    """The orchestrator with its wire door on ``port``, and Envoy pointed at it
    (-1: the door stays shut, whatever the YAML says)."""
    served = replace(orchestrator, args=(*orchestrator.args, WIRE_PORT_FLAG, str(port)))
    if port < 0:
        return served, list(edge)
    pointed = [
        replace(spec, args=(*spec.args, "--orchestrator-wire", f"{host}:{port}"))
        if spec.stage == "envoy"
        else spec
        for spec in edge
    ]
    return served, pointed


def wire_listeners(spec: ProcessSpec) -> list[Listener]:
    """The wire port of a process that opens one."""
    if WIRE_PORT_FLAG not in spec.args:
        return []
    port = int(spec.args[spec.args.index(WIRE_PORT_FLAG) + 1])
    return [Listener(spec.name, "wire", port)] if port >= 0 else []
