"""The default mesh's port plan: replicas raised meet no other process's port."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import yaml

from deploy.local import supervisor
from deploy.local.colocation import colocated
from deploy.local.port_plan import collisions
from deploy.local.supervisor import DEFAULT_CONFIG, listeners, plan, plan_mesh

MESH = yaml.safe_load(DEFAULT_CONFIG.read_text())
STAGES = ("inference", "tokenizer", "preprocess", "postprocess")


def planned(replicas: dict[str, int]) -> list[str]:
    stages, orchestrator, edge = plan(MESH, Path("/models"), False, replicas)
    return collisions(listeners([*stages, orchestrator, *edge]))


def test_ten_replicas_of_every_stage_fit_the_default_plan() -> None:
    stages, _, _ = plan(MESH, Path("/models"), False, dict.fromkeys(STAGES, 10))
    ports = {s.name: (s.grpc_port, s.metrics_port) for s in stages}
    assert ports["tokenizer-0"] == (8004, 9104)  # the first replica keeps the documented ports
    assert ports["tokenizer-1"] == (8104, 9204)
    assert planned(dict.fromkeys(STAGES, 10)) == []


def test_a_plan_past_the_range_names_both_processes_and_the_port() -> None:
    assert planned({"inference": 12}) == [
        "inference-0 (metrics) and inference-11 (gRPC) both want port 9103"
    ]


def test_colocate_runs_the_four_stages_as_one_process_on_its_own_ports() -> None:
    mesh = colocated(MESH)
    stages, orchestrator, edge = plan(mesh, Path("/models"), False, {"colocated": 3})
    assert [(s.name, s.module, s.standby) for s in stages] == [
        (f"colocated-{i}", "services.colocated.main", True) for i in range(3)
    ]
    assert (stages[0].grpc_port, stages[0].metrics_port) == (8011, 9101)
    assert "colocated=127.0.0.1:8011" in orchestrator.args
    assert collisions(listeners([*stages, orchestrator, *edge])) == []
    assert colocated(mesh) == mesh  # nothing left to put together


def test_auto_ports_are_never_handed_out_twice_in_one_plan(monkeypatch: Any) -> None:
    # The kernel may give a just-closed probe's port out again: here every port
    # comes back twice in a row, and the stages, the queue's Redis, the trace
    # store and TorchServe's management port must still all differ.
    given = itertools.count(40000)
    twice = itertools.chain.from_iterable((port, port) for port in given)
    monkeypatch.setattr(supervisor, "free_port", lambda: next(twice))
    mesh = copy.deepcopy(MESH)
    mesh["supervisor"]["jobs"] = {"enabled": True}
    mesh["supervisor"]["trace_store"] = True
    mesh["services"].setdefault("envoy", {})["torchserve_management_port"] = 8090
    whole = plan_mesh(mesh, Path("/models"), True, {})
    roles = {(listener.process, listener.role) for listener in whole.listeners}
    assert {("redis", "gRPC"), ("envoy", "TorchServe management")} <= roles
    assert any(listener.process == "tracestore" for listener in whole.listeners)
    assert collisions(whole.listeners) == []


def _wire(specs: list[Any]) -> list[tuple[str, str]]:
    """(process, the wire-door argument it was given) for every process given one."""
    flags = ("--wire-port", "--orchestrator-wire")
    return [(s.name, s.args[s.args.index(f) + 1]) for s in specs for f in flags if f in s.args]


def test_envoy_sends_modelinfer_to_the_grpc_port_unless_a_wire_port_is_set() -> None:
    _, orchestrator, edge = plan(MESH, Path("/models"), False, {})
    assert _wire([orchestrator, *edge]) == [("orchestrator", "-1")]  # the door shut
    mesh = copy.deepcopy(MESH)
    mesh["services"]["orchestrator"]["wire_port"] = 8010
    _, orchestrator, edge = plan(mesh, Path("/models"), False, {})
    assert _wire([orchestrator, *edge]) == [
        ("orchestrator", "8010"),
        ("envoy", "127.0.0.1:8010"),
    ]
    assert ("wire", 8010) in {(port.role, port.port) for port in listeners([orchestrator])}
