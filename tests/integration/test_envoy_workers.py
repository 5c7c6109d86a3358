"""Envoy runs as many worker threads as the edge's ``concurrency`` setting says; by
default Envoy's own number, one per hardware thread (docs/envoy.md).

The edge alone, pointed at upstreams that are not there: it still starts, and
its threads are read from /proc (Envoy names each worker ``wrk:worker_N``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.local.procfs import child_pids, tasks
from tests.harness import ServiceProcess

NOWHERE = "127.0.0.1:9"


def _workers(wrapper_pid: int) -> int:
    (envoy,) = [
        pid for pid in child_pids(wrapper_pid) if Path(f"/proc/{pid}/comm").read_text() == "envoy\n"
    ]
    names = [(task / "comm").read_text().strip() for task in tasks(envoy)]
    return sum(name.startswith("wrk:worker_") for name in names)


@pytest.mark.parametrize(("setting", "workers"), [(0, os.cpu_count()), (3, 3)])
def test_envoy_runs_the_worker_threads_it_is_told(setting: int, workers: int) -> None:
    flags = ["--orchestrator", NOWHERE, "--http-adapter", NOWHERE]
    edge = ServiceProcess("gateway.envoy.main", [*flags, "--concurrency", str(setting)])
    try:
        assert _workers(edge.proc.pid) == workers, edge.logs()
    finally:
        edge.stop()
