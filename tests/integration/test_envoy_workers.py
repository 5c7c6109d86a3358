"""Envoy runs as many worker threads as the edge's ``concurrency`` setting says; by
default Envoy's own number, one per hardware thread (docs/envoy.md). Its threads
run under the edge's ``cpu_policy`` (shared/cpu_policy.py), which Envoy takes from
its launcher.

The edge alone, pointed at upstreams that are not there: it still starts, and
its threads are read from /proc (Envoy names each worker ``wrk:worker_N``), and
its connections per worker from its admin endpoint.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from deploy.local.procfs import child_pids, tasks
from gateway.envoy.main import _admin
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


def _connections_by_worker(admin: Path) -> dict[str, int]:
    text = _admin(admin, "/stats?filter=^listener\\..*\\.worker_.*\\.downstream_cx_active$")
    counts = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if not name.startswith("listener.admin."):
            counts[name.split(".")[-2]] = int(value)
    return counts


def test_a_client_s_connections_are_spread_evenly_over_the_workers() -> None:
    flags = ["--orchestrator", NOWHERE, "--http-adapter", NOWHERE, "--concurrency", "2"]
    edge = ServiceProcess("gateway.envoy.main", flags)
    host, port = edge.info["grpc"].rsplit(":", 1)
    admin = Path(edge.info["admin"].removeprefix("unix:"))
    sockets = []
    try:
        for _ in range(8):  # a client's long-lived connections (perf_analyzer: 4 to 16)
            sockets.append(socket.create_connection((host, int(port)), timeout=5))
            time.sleep(0.02)
        deadline = time.monotonic() + 5
        while sum((counts := _connections_by_worker(admin)).values()) < 8:
            assert time.monotonic() < deadline, counts
            time.sleep(0.05)
        assert counts == {"worker_0": 4, "worker_1": 4}
    finally:
        for sock in sockets:
            sock.close()
        edge.stop()
