"""Per-model statistics (for ModelStatistics) and Prometheus metrics.

Both are fed from the same two events: a request finished (success or failure
with a reason) and a batch executed. The Prometheus names follow Triton's
(``nv_inference_*``, labels ``model`` and ``version``) so existing dashboards
keep working; histograms the mesh adds are prefixed ``meshserve_``.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from shared.exemplars import trace_exemplar

_US = 1_000


@dataclass
class Duration:
    """A count and a total in nanoseconds (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        """Record one occurrence lasting ``ns``."""
        self.count += 1
        self.ns += max(0, ns)


@dataclass
class BatchStats:
    """Per batch size: compute input / infer / output durations."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStats:
    """What ModelStatistics reports for one model version."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchStats] = field(default_factory=lambda: defaultdict(BatchStats))


_COUNTER_TYPE = re.compile(rb"^# TYPE (\S+)_total counter\n(\S+?)[{ ]", re.MULTILINE)


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition with plain counter names kept as they are.

    prometheus_client names every counter family ``<name>_total`` in its HELP
    and TYPE lines. Triton's counters (``nv_*``) and python models' custom
    counters are plain names (their samples carry no ``_total``), and
    dashboards built for Triton query them so: their header lines are put back.
    """
    text = generate_latest(registry)
    plain = {
        family
        for family, sample in _COUNTER_TYPE.findall(text)
        # The sample has the plain name (an empty family: Triton's own names).
        if sample == family or family.startswith(b"nv_")
    }
    for family in plain:
        for kind in (b"HELP", b"TYPE"):
            text = text.replace(b"# %s %s_total " % (kind, family), b"# %s %s " % (kind, family))
    return text


class TritonCounters:
    """Counters exposed under Triton's exact names.

    prometheus_client's Counter always appends ``_total`` to the sample name;
    dashboards built for Triton query ``nv_inference_request_success`` itself,
    so these counters are collected by hand.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._help: dict[str, str] = {}
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._lock = threading.Lock()
        registry.register(self)  # type: ignore[arg-type]

    def declare(self, name: str, help_text: str) -> None:
        """Make ``name`` known so it is listed even before its first increment."""
        self._help[name] = help_text
        self._values.setdefault(name, {})

    def inc(self, name: str, labels: dict[str, str], amount: float = 1.0) -> None:
        """Add ``amount`` to the series of ``name`` with ``labels``."""
        self.add(name, tuple(sorted(labels.items())), amount)

    def add(self, name: str, key: tuple[tuple[str, str], ...], amount: float) -> None:
        """Add ``amount`` to the series of ``name`` whose sorted label items are ``key``."""
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + amount

    def collect(self) -> list[Metric]:
        """The current values (called by the registry on each scrape)."""
        families = []
        with self._lock:
            for name, series in self._values.items():
                family = Metric(name, self._help[name], "counter")
                for key, value in series.items():
                    family.add_sample(name, dict(key), value)
                families.append(family)
        return families


class _Counter:
    """One named counter of a TritonCounters set, with the labels() idiom."""

    def __init__(
        self, counters: TritonCounters, name: str, help_text: str, labels: list[str]
    ) -> None:
        counters.declare(name, help_text)
        self._counters = counters
        self._name = name
        self._labels = labels

    def labels(self, *values: str) -> _Series:
        """The series for these label values."""
        key = tuple(sorted(zip(self._labels, values, strict=True)))
        return _Series(self._counters, self._name, key)


@dataclass(frozen=True)
class _Series:
    counters: TritonCounters
    name: str
    key: tuple[tuple[str, str], ...]

    def inc(self, amount: float = 1.0) -> None:
        self.counters.add(self.name, self.key, amount)


class Metrics:
    """The Prometheus metrics of one service, in its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "version"]
        counters = TritonCounters(registry)
        self.success = _Counter(
            counters, "nv_inference_request_success", "Successful inference requests", labels
        )
        self.failure = _Counter(
            counters,
            "nv_inference_request_failure",
            "Failed inference requests, by reason",
            [*labels, "reason"],
        )
        self.inferences = _Counter(
            counters,
            "nv_inference_count",
            "Inferences performed (rows, batch counted per row)",
            labels,
        )
        self.executions = _Counter(
            counters, "nv_inference_exec_count", "Model executions (batches)", labels
        )
        self.request_us = _Counter(
            counters,
            "nv_inference_request_duration_us",
            "Cumulative end-to-end request time",
            labels,
        )
        self.queue_us = _Counter(
            counters,
            "nv_inference_queue_duration_us",
            "Cumulative time requests waited in the queue",
            labels,
        )
        self.compute_us = _Counter(
            counters,
            "nv_inference_compute_infer_duration_us",
            "Cumulative model compute time",
            labels,
        )
        self.pending = Gauge(
            "nv_inference_pending_request_count",
            "Requests queued, not yet executing",
            labels,
            registry=registry,
        )
        self.queue_capacity = Gauge(
            "meshserve_queue_capacity",
            "Most requests the model's queue holds before refusing (0: unbounded)",
            labels,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "meshserve_request_duration_seconds",
            "Time each successful request took in the service, queue and compute",
            labels,
            registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.queue_seconds = Histogram(
            "meshserve_queue_duration_seconds",
            "Time each request waited in the queue",
            labels,
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.compute_seconds = Histogram(
            "meshserve_compute_duration_seconds",
            "Time each batch spent in the model",
            labels,
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.batch_size = Histogram(
            "meshserve_batch_size",
            "Rows per executed batch",
            labels,
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        # Per model, not per version: a load that fails has no version to name.
        self.load_failures = Counter(
            "meshserve_model_load_failures",
            "Loads of a model that failed (its error is in the log and RepositoryIndex)",
            ["model"],
            registry=registry,
        )
        self.model_ready = Gauge(
            "meshserve_model_ready",
            "1 while some version of the model serves, 0 once it failed to load or unloaded",
            ["model"],
            registry=registry,
        )


class _VersionSeries:
    """One model version's series of every metric, looked up once (a labels()
    lookup per request and metric is a cost every request would pay)."""

    def __init__(self, metrics: Metrics, labels: tuple[str, str]) -> None:
        self._failure = metrics.failure
        self._labels = labels
        self.success = metrics.success.labels(*labels)
        self.request_us = metrics.request_us.labels(*labels)
        self.request_seconds = metrics.request_seconds.labels(*labels)
        self.queue_capacity = metrics.queue_capacity.labels(*labels)
        self.queue_us = metrics.queue_us.labels(*labels)
        self.queue_seconds = metrics.queue_seconds.labels(*labels)
        self.inferences = metrics.inferences.labels(*labels)
        self.executions = metrics.executions.labels(*labels)
        self.compute_us = metrics.compute_us.labels(*labels)
        self.compute_seconds = metrics.compute_seconds.labels(*labels)
        self.batch_size = metrics.batch_size.labels(*labels)
        self.pending = metrics.pending.labels(*labels)

    def failed(self, reason: str) -> None:
        """Count a failure (its series, one per reason, is looked up here)."""
        self._failure.labels(*self._labels, reason).inc()


class StatsRecorder:
    """Feeds one model version's ModelStats and the service's Metrics."""

    def __init__(self, model: str, version: str, metrics: Metrics | None) -> None:
        self.stats = ModelStats()
        self._series = _VersionSeries(metrics, (model, version)) if metrics is not None else None
        self._lock = threading.Lock()

    def request_done(self, duration_ns: int, queue_ns: int, ok: bool, reason: str = "") -> None:
        """One request finished (its whole time, its queue wait, and how)."""
        with self._lock:
            (self.stats.success if ok else self.stats.fail).add(duration_ns)
            if ok:
                self.stats.queue.add(queue_ns)
                self.stats.last_inference_ms = int(time.time() * 1000)
        if self._series is None:
            return
        if ok:
            self._series.success.inc()
            self._series.request_us.inc(duration_ns / _US)
            self._series.queue_us.inc(queue_ns / _US)
            exemplar = trace_exemplar()  # called in the request's span
            self._series.request_seconds.observe(duration_ns / 1e9, exemplar)
            self._series.queue_seconds.observe(queue_ns / 1e9, exemplar)
        else:
            self._series.failed(reason or "OTHER")

    def batch_done(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One batch executed: its rows and its compute phases."""
        with self._lock:
            self.stats.inference_count += rows
            self.stats.execution_count += 1
            for total, ns in (
                (self.stats.compute_input, input_ns),
                (self.stats.compute_infer, infer_ns),
                (self.stats.compute_output, output_ns),
            ):
                total.add(ns)
            batch = self.stats.batches[rows]
            batch.compute_input.add(input_ns)
            batch.compute_infer.add(infer_ns)
            batch.compute_output.add(output_ns)
        if self._series is None:
            return
        self._series.inferences.inc(rows)
        self._series.executions.inc()
        self._series.compute_us.inc(infer_ns / _US)
        self._series.compute_seconds.observe(infer_ns / 1e9)
        self._series.batch_size.observe(rows)

    def set_pending(self, count: int) -> None:
        """The number of queued requests right now."""
        if self._series is not None:
            self._series.pending.set(count)

    def set_queue_capacity(self, count: int) -> None:
        """The queue's bound (0: unbounded), against which pending is measured."""
        if self._series is not None:
            self._series.queue_capacity.set(count)
