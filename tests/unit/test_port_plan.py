"""The default mesh's port plan: replicas raised meet no other process's port."""

from __future__ import annotations

from pathlib import Path

import yaml

from deploy.local.port_plan import collisions
from deploy.local.supervisor import DEFAULT_CONFIG, listeners, plan

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
