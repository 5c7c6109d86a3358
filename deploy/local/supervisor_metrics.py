"""The supervisor's own /metrics: how often it restarted each process.

A process that crashes and comes back looks healthy to its own /metrics (a
fresh counter set); only the supervisor saw it go. ``meshserve_process_restarts_total``
(labels ``process``, ``stage``) feeds the StageRestarting alert and the per-stage
dashboard; ``meshserve_process_up`` says which processes run and are ready now.
In Kubernetes the kubelet restarts containers and kube-state-metrics counts them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deploy.local.service_process import ManagedProcess, log
from shared.metrics_http import start_metrics_server


class ProcessCounts(Collector):
    """Restarts and readiness of the supervisor's processes, read at scrape time."""

    def __init__(self, processes: Sequence[ManagedProcess]) -> None:
        self._processes = list(processes)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["process", "stage"]
        restarts = CounterMetricFamily(
            "meshserve_process_restarts",
            "Times the supervisor restarted the process after it exited",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "meshserve_process_up", "1 while the process runs and is ready", labels=labels
        )
        # Ints and flags read from another thread: a scrape sees a moment's values.
        for process in self._processes:
            names = [process.spec.name, process.spec.stage]
            restarts.add_metric(names, process.restarts)
            running = process.proc is not None and process.proc.returncode is None
            up.add_metric(names, 1.0 if running and process.ready.is_set() else 0.0)
        yield restarts
        yield up


def metrics_port(settings: dict[str, Any], auto_ports: bool) -> int:
    """``supervisor.metrics_port`` of the mesh YAML: -1 (unset) is off; auto picks a free one."""
    port = int(settings.get("metrics_port", -1))
    return 0 if auto_ports and port >= 0 else port


def serve_metrics(
    host: str, port: int, processes: Sequence[ManagedProcess]
) -> ThreadingHTTPServer | None:
    """Serve the counts on ``host:port`` (0: a free port; negative: not at all)."""
    if port < 0:
        return None
    registry = CollectorRegistry()
    registry.register(ProcessCounts(processes))
    try:
        return start_metrics_server(host, port, registry)
    except OSError as exc:  # the mesh runs on without it; say so once
        log(f"restart counts not served: cannot listen on {host}:{port} ({exc.strerror})")
        return None


def stop_metrics(server: ThreadingHTTPServer | None) -> None:
    """Stop serving (if ``serve_metrics`` served at all) and free the port."""
    if server is not None:
        server.shutdown()
        server.server_close()
