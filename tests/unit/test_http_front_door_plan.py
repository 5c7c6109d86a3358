"""Where the local mesh's plan puts the HTTP front door (``supervisor.http_front_door``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.local.http_front_door import (
    announce_front_door,
    front_door_address,
    front_door_listeners,
)
from deploy.local.port_plan import PortPlanError, collisions
from deploy.local.prometheus_config import targets_from_mesh
from deploy.local.service_process import ManagedProcess
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
    assert "http_adapter" in {target.job for target in targets_from_mesh(mesh_with("process"))}


def test_the_orchestrators_http_port_is_in_the_port_check() -> None:
    mesh = mesh_with("orchestrator", http_port=8003)  # the inference stage's gRPC port
    stages, orchestrator, edge = plan(mesh, Path("/models"), False, {})
    assert collisions(listeners([*stages, orchestrator, *edge])) == [
        "inference-0 (gRPC) and orchestrator (HTTP) both want port 8003"
    ]


def test_the_default_is_the_orchestrator_and_the_adapter_process_a_setting() -> None:
    _, orchestrator, edge = plan(MESH, Path("/models"), False, {})
    assert orchestrator.module == "gateway.http.in_orchestrator"
    assert "http_adapter" not in [spec.name for spec in edge]
    unsaid = copy.deepcopy(MESH)  # a mesh YAML that does not say
    del unsaid["supervisor"]["http_front_door"]
    assert plan(unsaid, Path("/models"), False, {})[1].module == "gateway.http.in_orchestrator"
    _, orchestrator, edge = plan(mesh_with("process"), Path("/models"), False, {})
    assert orchestrator.module == "services.orchestrator.main"
    (adapter,) = [spec for spec in edge if spec.name == "http_adapter"]
    assert adapter.module == "gateway.http.main" and adapter.grpc_port == 8007
    assert front_door_listeners(orchestrator) == []
    with pytest.raises(PortPlanError, match="http_front_door must be one of"):
        plan(mesh_with("envoy"), Path("/models"), False, {})


def test_the_ready_line_and_log_say_which_process_serves_rest() -> None:
    def running(mode: str) -> tuple[ManagedProcess, list[ManagedProcess]]:
        _, orchestrator, edge = plan(mesh_with(mode), Path("/models"), False, {})
        started = [ManagedProcess(spec, Path("mesh.yaml"), (0.5, 10.0)) for spec in edge]
        for process in started:
            process.address = f"127.0.0.1:{process.spec.grpc_port}"
        served = ManagedProcess(orchestrator, Path("mesh.yaml"), (0.5, 10.0))
        served.address = "127.0.0.1:8001"
        return served, started

    orchestrator, edge = running("orchestrator")
    assert front_door_address(orchestrator, edge) == "127.0.0.1:8007"
    assert announce_front_door(orchestrator, edge).endswith("the orchestrator on 127.0.0.1:8007")
    orchestrator, edge = running("process")
    assert front_door_address(orchestrator, edge) == "127.0.0.1:8007"
    assert "the http_adapter on 127.0.0.1:8007" in announce_front_door(orchestrator, edge)
    assert front_door_address(orchestrator, []) is None
