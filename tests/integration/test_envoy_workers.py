"""Envoy runs as many worker threads as the edge's ``concurrency`` setting says; by
default Envoy's own number, one per hardware thread (docs/envoy.md). Its threads
run under the edge's ``cpu_policy`` (shared/cpu_policy.py), which Envoy takes from
its launcher.

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


def _envoy(wrapper_pid: int) -> int:
    (envoy,) = [
        pid for pid in child_pids(wrapper_pid) if Path(f"/proc/{pid}/comm").read_text() == "envoy\n"
    ]
    return envoy


def _workers(wrapper_pid: int) -> int:
    names = [(task / "comm").read_text().strip() for task in tasks(_envoy(wrapper_pid))]
    return sum(name.startswith("wrk:worker_") for name in names)


@pytest.mark.parametrize(("setting", "workers"), [(0, os.cpu_count()), (3, 3)])
def test_envoy_runs_the_worker_threads_it_is_told(setting: int, workers: int) -> None:
    flags = ["--orchestrator", NOWHERE, "--http-adapter", NOWHERE]
    edge = ServiceProcess("gateway.envoy.main", [*flags, "--concurrency", str(setting)])
    try:
        assert _workers(edge.proc.pid) == workers, edge.logs()
    finally:
        edge.stop()


@pytest.mark.parametrize(
    ("flags", "policy"), [([], os.SCHED_BATCH), (["--cpu-policy=normal"], os.SCHED_OTHER)]
)
def test_envoy_s_threads_run_under_the_edge_s_cpu_policy(flags: list[str], policy: int) -> None:
    upstreams = ["--orchestrator", NOWHERE, "--http-adapter", NOWHERE]
    edge = ServiceProcess("gateway.envoy.main", [*upstreams, *flags])
    try:
        threads = [int(task.name) for task in tasks(_envoy(edge.proc.pid))]
        assert len(threads) > 2, edge.logs()  # the main thread, the workers, ...
        assert {os.sched_getscheduler(thread) for thread in threads} == {policy}
    finally:
        edge.stop()
