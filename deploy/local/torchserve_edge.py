"""TorchServe's pieces of the local mesh's edge.

The HTTP adapter's management API writes registered archives into the mesh's
repository, so it is told the repository the stages read. Envoy's management
listener (``envoy.torchserve_management_port`` in the mesh YAML, TorchServe's
8081 by default) gets a free port under ``--ports auto``, like every other
port, so meshes started side by side never contend for 8081.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deploy.local.port_plan import Listener
from deploy.local.service_process import ProcessSpec


def torchserve_edge(
    edge: Sequence[ProcessSpec],
    mesh: dict[str, Any],
    repository: Path,
    auto_ports: bool,
    free_port: Callable[[], int],
) -> tuple[list[ProcessSpec], list[Listener]]:
    """The edge's processes with TorchServe's settings, and the port it adds to the plan."""
    envoy = ((mesh.get("services") or {}).get("envoy")) or {}
    port = int(envoy.get("torchserve_management_port", -1))
    if auto_ports and port >= 0:
        port = free_port()
    extra: dict[str, tuple[str, ...]] = {"http_adapter": ("--model-repository", str(repository))}
    if auto_ports and port >= 0:
        extra["envoy"] = ("--torchserve-management-port", str(port))
    specs = [replace(s, args=(*s.args, *extra.get(s.stage, ()))) for s in edge]
    planned = [Listener("envoy", "TorchServe management", port)] if edge and port > 0 else []
    return specs, planned
