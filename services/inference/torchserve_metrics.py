"""TorchServe's request metrics, under TorchServe's names, beside the mesh's own.

TorchServe's front end exports (Prometheus mode) ``ts_inference_requests_total``
(counter), ``ts_inference_latency_microseconds`` and
``ts_queue_latency_microseconds`` (cumulative sums, exported untyped as its
client library did), labelled ``model_name``, ``model_version``, ``hostname``.
The torchserve backend counts them here, so dashboards built on those names
keep working against the inference stage's /metrics.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric, UnknownMetricFamily

LABELS = ["model_name", "model_version", "hostname"]


class TorchServeMetrics:
    """Cumulative counts and latencies per (model, version); a registry collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hostname = socket.gethostname()
        # (model, version) -> [requests, inference µs, queue µs]
        self._totals: dict[tuple[str, str], list[float]] = {}

    def record(self, model: str, version: str, inference_us: float, queue_us: float) -> None:
        """Count one answered request (called from instance threads)."""
        with self._lock:
            totals = self._totals.setdefault((model, version), [0.0, 0.0, 0.0])
            totals[0] += 1
            totals[1] += inference_us
            totals[2] += queue_us

    def collect(self) -> Iterator[Metric]:
        """The three metric families, one sample per model version."""
        requests = CounterMetricFamily(
            "ts_inference_requests", "Total number of inference requests.", labels=LABELS
        )
        inference = UnknownMetricFamily(
            "ts_inference_latency_microseconds",
            "Cumulative inference duration in microseconds",
            labels=LABELS,
        )
        queue = UnknownMetricFamily(
            "ts_queue_latency_microseconds",
            "Cumulative queue duration in microseconds",
            labels=LABELS,
        )
        with self._lock:
            rows = [(key, list(values)) for key, values in self._totals.items()]
        for (model, version), (count, inference_us, queue_us) in rows:
            labels = [model, version, self._hostname]
            requests.add_metric(labels, count)
            inference.add_metric(labels, inference_us)
            queue.add_metric(labels, queue_us)
        yield requests
        yield inference
        yield queue

    def attach(self, registry: CollectorRegistry) -> None:
        """Export through ``registry`` (the stage's /metrics)."""
        registry.register(self)
