"""Prefix-cache counters of every vLLM engine in the service, per model.

vLLM counts, at each scheduler step, how many prompt tokens it looked up in
its prefix cache (``queries``) and how many it found there (``hits``); its own
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (relayed by
``VllmSeries``) follow one engine per process. These keep one series per
model and version, under the same names with the mesh's prefix::

    meshserve_llm_prefix_cache_queries_total{model, version}   prompt tokens looked up
    meshserve_llm_prefix_cache_hits_total{model, version}      of them found cached

The hit rate over a window is ``rate(hits) / rate(queries)`` (docs/lora-and-quantization.md).
A step that prefilled nothing adds nothing; an engine with prefix caching off
reports no lookups, so both counters stay at zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

LABELS = ("model", "version")


class PrefixCacheMetrics:
    """The two counters; ``series(model, version)`` is what one engine feeds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(
            "meshserve_llm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            LABELS,
            registry=registry,
        )
        self.hits = Counter(
            "meshserve_llm_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their prefill skipped)",
            LABELS,
            registry=registry,
        )

    def series(self, labels: tuple[str, str]) -> PrefixCacheSeries:
        """One model version's children, looked up once."""
        return PrefixCacheSeries(self.queries.labels(*labels), self.hits.labels(*labels))


class PrefixCacheSeries:
    """Adds one engine's per-step prefix-cache statistics to its model's counters."""

    def __init__(self, queries: Any, hits: Any) -> None:
        self._queries = queries
        self._hits = hits

    def record(self, stats: Any) -> None:
        """``stats``: vLLM's PrefixCacheStats of one step (None or empty: nothing)."""
        if stats is None:
            return
        queries, hits = int(stats.queries), int(stats.hits)
        if queries > 0:
            self._queries.inc(queries)
        if hits > 0:
            self._hits.inc(hits)
