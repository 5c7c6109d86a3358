"""The ``/metrics`` HTTP endpoint, served from a daemon thread.

Prometheus's text format by default; the OpenMetrics format when the scraper
asks for it (``Accept: application/openmetrics-text``), which is the only one
that carries exemplars: the trace id on histogram buckets (shared/exemplars.py).
The service's own CPU time and memory (``process_*``) and its garbage
collector's work (``python_gc_*``, ``meshserve_gc_frozen_objects``) join every
registry served.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from shared.statistics import render


def negotiate(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """The exposition of ``registry`` and its content type, as ``accept`` prefers."""
    if "application/openmetrics-text" in accept:
        body: bytes = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
        return body, openmetrics.CONTENT_TYPE_LATEST
    return render(registry), CONTENT_TYPE_LATEST


class _FrozenHeap(Collector):
    """How many objects the cyclic collector leaves alone: what the service held
    when it became ready, or after its last model load or unload (shared/gc_heap.py)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "meshserve_gc_frozen_objects",
            "Objects frozen out of garbage collection (the heap held once ready)",
            value=gc.get_freeze_count(),
        )


def _with_process_metrics(registry: CollectorRegistry) -> None:
    # Served twice (a test's second server on one registry): already there.
    with contextlib.suppress(ValueError):
        registry.register(ProcessCollector(registry=None))
    with contextlib.suppress(ValueError):
        GCCollector(registry=registry)
    with contextlib.suppress(ValueError):
        registry.register(_FrozenHeap())


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serve ``registry`` at ``http://host:port/metrics``; port 0 picks a free one."""
    _with_process_metrics(registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body, content_type = negotiate(registry, self.headers.get("Accept", ""))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # A scraper that gave up (its timeout) has closed the connection:
            # nothing to answer, and nothing for the service's log.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Scrapes are frequent; keep them out of the service log."""

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
