"""What each route's targets did: Prometheus metrics and sliding windows.

The metrics (labelled by ``route`` and ``target``) make the canary comparison
one query; the windows answer ``meshserve route status`` and feed the
automatic rollback policy (route_table.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.orchestrator.route_shadow import Comparison

DEFAULT_WINDOW_S = 60.0
"""The window of a route without a rollback policy."""
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DIFF_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)


class RouteMetrics:
    """The routes' Prometheus series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("route", "target")
        self.requests = Counter(
            "meshserve_route_requests",
            "Requests a route sent to a target, by outcome (success, failure)",
            [*labels, "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "meshserve_route_request_duration_seconds",
            "Latency of a route's requests, by the target that served them",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.weight = Gauge(
            "meshserve_route_weight", "A target's current weight", labels, registry=registry
        )
        self.rollbacks = Counter(
            "meshserve_route_rollbacks",
            "Targets taken out of a route's traffic by its rollback policy",
            [*labels, "reason"],
            registry=registry,
        )
        self.shadow = Counter(
            "meshserve_route_shadow_requests",
            "Requests mirrored to a route's shadow target, by outcome (compared, failure)",
            [*labels, "outcome"],
            registry=registry,
        )
        self.shadow_diff = Histogram(
            "meshserve_route_shadow_max_abs_diff",
            "Largest absolute difference between a shadow's and the served answer's tensors",
            labels,
            buckets=_DIFF_BUCKETS,
            registry=registry,
        )
        self.shadow_top1 = Counter(
            "meshserve_route_shadow_top1",
            "Mirrored classifications, by whether the shadow's top-1 class agreed",
            [*labels, "agree"],
            registry=registry,
        )
        self.shadow_exact = Counter(
            "meshserve_route_shadow_exact_match",
            "Mirrored text answers, by whether the shadow's text matched exactly",
            [*labels, "match"],
            registry=registry,
        )

    def comparison(self, route: str, target: str, result: Comparison) -> None:
        """Record one mirrored request's comparison."""
        self.shadow.labels(route, target, "compared").inc()
        if result.max_abs_diff is not None:
            self.shadow_diff.labels(route, target).observe(result.max_abs_diff)
        if result.top1_agree is not None:
            self.shadow_top1.labels(route, target, str(result.top1_agree).lower()).inc()
        if result.exact_match is not None:
            self.shadow_exact.labels(route, target, str(result.exact_match).lower()).inc()


@dataclass(frozen=True)
class WindowStats:
    """A target's requests over the window."""

    requests: int
    errors: int
    rate_per_s: float
    p50_s: float
    p99_s: float

    @property
    def error_ratio(self) -> float:
        """Errors per request (0 without requests)."""
        return self.errors / self.requests if self.requests else 0.0


@dataclass
class Window:
    """A target's recent requests: (time, succeeded, seconds), and how many failed."""

    samples: deque[tuple[float, bool, float]] = field(default_factory=deque)
    since: float = field(default_factory=time.monotonic)
    errors: int = 0

    def add(self, ok: bool, seconds: float, window_s: float) -> None:
        """Record one request and forget those older than ``window_s``."""
        now = time.monotonic()
        self.samples.append((now, ok, seconds))
        self.errors += not ok
        self._prune(now, window_s)

    def _prune(self, now: float, window_s: float) -> None:
        while self.samples and self.samples[0][0] < now - window_s:
            self.errors -= not self.samples.popleft()[1]

    def counts(self, window_s: float) -> tuple[int, int]:
        """Requests and errors over the last ``window_s`` (no sorting: cheap per request)."""
        self._prune(time.monotonic(), window_s)
        return len(self.samples), self.errors

    def stats(self, window_s: float) -> WindowStats:
        """Counts, rate and latency percentiles over the last ``window_s``."""
        now = time.monotonic()
        self._prune(now, window_s)
        latencies = sorted(s for _, _, s in self.samples)
        span = max(1e-3, min(window_s, now - self.since))
        return WindowStats(
            requests=len(self.samples),
            errors=self.errors,
            rate_per_s=len(self.samples) / span,
            p50_s=_percentile(latencies, 0.50),
            p99_s=_percentile(latencies, 0.99),
        )


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


@dataclass
class ShadowTally:
    """A route's mirrored requests so far (for the status; the metrics hold the rest)."""

    compared: int = 0
    failures: int = 0
    max_abs_diff: float = 0.0
    top1_agreed: int = 0
    top1_total: int = 0
    exact_matched: int = 0
    exact_total: int = 0

    def add(self, result: Comparison) -> None:
        """Count one comparison."""
        self.compared += 1
        if result.max_abs_diff is not None:
            self.max_abs_diff = max(self.max_abs_diff, result.max_abs_diff)
        if result.top1_agree is not None:
            self.top1_total += 1
            self.top1_agreed += int(result.top1_agree)
        if result.exact_match is not None:
            self.exact_total += 1
            self.exact_matched += int(result.exact_match)
