"""Where the local mesh's plan puts the HTTP front door (``supervisor.http_front_door``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.local.port_plan import PortPlanError, collisions
from deploy.local.prometheus_config import targets_from_mesh
from deploy.local.supervisor import DEFAULT_CONFIG, listeners, plan

MESH = yaml.safe_load(DEFAULT_CONFIG.read_text())


def mesh_with(mode: str, **adapter: Any) -> dict[str, Any]:
    mesh = copy.deepcopy(MESH)
    mesh["supervisor"]["http_front_door"] = mode
    mesh["services"]["http_adapter"].update(adapter)
    return mesh


def test_in_the_orchestrator_no_adapter_runs_and_envoy_sends_rest_to_the_orchestrator() -> None:
    mesh = mesh_with("orchestrator", max_body_bytes=4096, model_store="/srv/store")
    _, orchestrator, edge = plan(mesh, Path("/models"), False, {})
    assert [spec.name for spec in edge] == ["envoy"]
    assert orchestrator.module == "gateway.http.in_orchestrator"
    args = list(orchestrator.args)
    assert args[args.index("--http-port") + 1] == "8007"  # the adapter's documented port
    assert args[args.index("--max-body-bytes") + 1] == "4096"
    assert args[args.index("--model-store") + 1] == "/srv/store"
    (envoy,) = edge
    assert envoy.args[envoy.args.index("--http-adapter") + 1] == "127.0.0.1:8007"
    assert ("orchestrator", "HTTP", 8007) in [
        (listener.process, listener.role, listener.port) for listener in listeners([orchestrator])
    ]
    # Its HTTP metrics are the orchestrator's: Prometheus has no adapter to scrape.
    assert "http_adapter" not in {target.job for target in targets_from_mesh(mesh)}
    assert "http_adapter" in {target.job for target in targets_from_mesh(MESH)}


def test_the_orchestrators_http_port_is_in_the_port_check() -> None:
    mesh = mesh_with("orchestrator", http_port=8003)  # the inference stage's gRPC port
    stages, orchestrator, edge = plan(mesh, Path("/models"), False, {})
    assert collisions(listeners([*stages, orchestrator, *edge])) == [
        "inference-0 (gRPC) and orchestrator (HTTP) both want port 8003"
    ]


def test_the_default_keeps_the_adapter_process_and_a_wrong_mode_is_named() -> None:
    _, orchestrator, edge = plan(MESH, Path("/models"), False, {})
    assert orchestrator.module == "services.orchestrator.main"
    assert "http_adapter" in [spec.name for spec in edge]
    with pytest.raises(PortPlanError, match="http_front_door must be one of"):
        plan(mesh_with("envoy"), Path("/models"), False, {})
