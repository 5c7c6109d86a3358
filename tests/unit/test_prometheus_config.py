"""The checked-in scrape configuration and dashboards are what their generators make."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.grafana.dashboards import FOLDER, rendered
from deploy.local.prometheus_config import (
    render,
    scrape_config,
    targets_from_mesh,
    targets_from_ready,
)

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local"


def test_the_local_scrape_config_is_fresh_and_valid() -> None:
    mesh = yaml.safe_load((LOCAL / "mesh.yaml").read_text())
    expected = render(scrape_config(targets_from_mesh(mesh), [Path("../prometheus/rules.yml")]))
    assert (LOCAL / "prometheus.yml").read_text() == expected, (
        "regenerate: python -m deploy.local.prometheus_config"
        " --config deploy/local/mesh.yaml --out deploy/local/prometheus.yml"
    )
    jobs = {job["job_name"] for job in yaml.safe_load(expected)["scrape_configs"]}
    assert {"orchestrator", "inference", "tokenizer", "supervisor"} <= jobs
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    done = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=LOCAL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_running_mesh_gets_one_job_per_stage_and_a_target_per_replica() -> None:
    ready = {
        "orchestrator": "127.0.0.1:5000",
        "supervisor_metrics_port": 5009,
        "processes": {
            "orchestrator": {"grpc": "127.0.0.1:5000", "metrics_port": 5001},
            "inference-0": {"grpc": "127.0.0.1:5002", "metrics_port": 5003},
            "inference-1": {"grpc": "127.0.0.1:5004", "metrics_port": 5005},
            "envoy": {"grpc": "127.0.0.1:5006", "metrics_port": -1},
        },
    }
    jobs = {
        job["job_name"]: [
            (group["targets"][0], group.get("labels", {}).get("process"))
            for group in job["static_configs"]
        ]
        for job in scrape_config(targets_from_ready(ready))["scrape_configs"]
    }
    assert jobs == {
        "inference": [("127.0.0.1:5003", "inference-0"), ("127.0.0.1:5005", "inference-1")],
        "orchestrator": [("127.0.0.1:5001", "orchestrator")],
        # No target label: the supervisor's series name their own process.
        "supervisor": [("127.0.0.1:5009", None)],
    }


def test_the_dashboards_are_fresh() -> None:
    for name, text in rendered().items():
        assert (FOLDER / name).read_text() == text, "run: python -m deploy.grafana.dashboards"
