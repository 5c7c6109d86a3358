"""The ``vllm`` backend's metrics: the mesh's ``meshserve_llm_*`` series and
vLLM's own ``vllm:*`` ones, on the service's /metrics.

Each request's latencies and token counts go to its model's series through a
``RequestTimer``; the engine's scheduler figures (running, waiting, KV cache
use, prefix cache) arrive through a stat logger vLLM calls per engine step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.registry import Collector

from services.inference.vllm_prefix import PrefixCacheMetrics
from shared.exemplars import trace_exemplar

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)


class VllmSeries(Collector):
    """vLLM's own ``vllm:*`` metrics, shown on the service's /metrics.

    vLLM records them for every engine (its Prometheus stat logger is always
    on once any stat logger is) in prometheus_client's global registry, under
    the names its server exports and its users' dashboards read
    (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...,
    label ``model_name``). The service serves its own registry; this relays
    those families into it. vLLM keeps one engine's series per process: where
    a service hosts two LLMs at once, they follow the engine started last
    (``meshserve_llm_*`` keep both).
    """

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family


class LlmMetrics:
    """The ``meshserve_llm_*`` metrics of one service; labels ``model``, ``version``.
    vLLM's own ``vllm:*`` series join the same registry (``VllmSeries``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        registry.register(VllmSeries())
        labels = ["model", "version"]

        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(name, help_text, labels, registry=registry, buckets=_LATENCY_BUCKETS)

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(name, help_text, labels, registry=registry)

        self.time_to_first_token = histogram(
            "meshserve_llm_time_to_first_token_seconds", "Request start to its first token"
        )
        self.inter_token_latency = histogram(
            "meshserve_llm_inter_token_latency_seconds", "Time between streamed tokens"
        )
        self.request_duration = histogram(
            "meshserve_llm_request_duration_seconds", "Request start to its last token (or abort)"
        )
        self.prompt_tokens = Counter(
            "meshserve_llm_prompt_tokens", "Prompt tokens prefilled", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "meshserve_llm_generation_tokens", "Tokens generated", labels, registry=registry
        )
        self.finished = Counter(
            "meshserve_llm_requests_finished",
            "Requests ended, by finish reason (stop, length, abort)",
            [*labels, "finish_reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "meshserve_llm_requests_rejected",
            "Requests refused because max_num_seqs + max_waiting were in flight",
            labels,
            registry=registry,
        )
        self.running = gauge("meshserve_llm_requests_running", "Requests the engine is running")
        self.waiting = gauge("meshserve_llm_requests_waiting", "Requests waiting in the engine")
        self.unfinished = gauge(
            "meshserve_llm_requests_unfinished", "Requests the engine frontend holds, not finished"
        )
        self.kv_cache_usage = gauge(
            "meshserve_llm_kv_cache_usage_ratio", "Share of the KV cache in use (0..1)"
        )
        self.prefix_cache = PrefixCacheMetrics(registry)

    @property
    def gauges(self) -> tuple[Gauge, ...]:
        """The gauges read from the engine at scrape time."""
        return (self.running, self.waiting, self.unfinished, self.kv_cache_usage)


class ModelSeries:
    """One model version's children of the ``LlmMetrics``, looked up once per
    instance rather than per token (as shared/statistics.py does for the Triton
    metrics): a label lookup is a locked dict access, and the first token's path
    through the service is where a lone request waits."""

    def __init__(self, metrics: LlmMetrics, labels: tuple[str, str]) -> None:
        self._finished = metrics.finished
        self._labels = labels
        self.time_to_first_token = metrics.time_to_first_token.labels(*labels)
        self.inter_token_latency = metrics.inter_token_latency.labels(*labels)
        self.request_duration = metrics.request_duration.labels(*labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self.generation_tokens = metrics.generation_tokens.labels(*labels)

    def finished(self, reason: str) -> None:
        """Count an ended request (its series, one per reason, is looked up here)."""
        self._finished.labels(*self._labels, reason).inc()


class RequestTimer:
    """Feeds one request's latencies and token counts to its model's series."""

    def __init__(self, series: ModelSeries) -> None:
        self.series = series
        self.started = time.monotonic()
        self.last: float | None = None

    def tokens(self, count: int, prompt_tokens: int) -> None:
        """``count`` new tokens arrived now."""
        now = time.monotonic()
        series = self.series
        if self.last is None:
            series.time_to_first_token.observe(now - self.started, trace_exemplar())
            series.prompt_tokens.inc(prompt_tokens)
        else:
            for _ in range(count):
                series.inter_token_latency.observe((now - self.last) / count)
        self.last = now
        series.generation_tokens.inc(count)

    def done(self, finish_reason: str) -> None:
        """The request ended (``abort`` when it was cancelled)."""
        series = self.series
        series.request_duration.observe(time.monotonic() - self.started, trace_exemplar())
        series.finished(finish_reason)


def stats_logger_factory(
    record: Callable[[int, int, float], None], prefix: Callable[[Any], None]
) -> Any:
    """A vLLM stat logger (per engine) that hands the scheduler's stats to ``record``
    and its prefix-cache statistics to ``prefix``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                record(
                    scheduler_stats.num_running_reqs,
                    scheduler_stats.num_waiting_reqs,
                    scheduler_stats.kv_cache_usage,
                )
                prefix(scheduler_stats.prefix_cache_stats)

        def log_engine_initialized(self) -> None:
            """Nothing to log: the service logs the engine start."""

    return SchedulerStatsLogger
