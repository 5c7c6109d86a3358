"""Custom metrics of python models (Triton's ``pb_utils.MetricFamily`` / ``Metric``).

A model declares a family (name, description, COUNTER / GAUGE / HISTOGRAM)
and a metric per label set, then increments, sets or observes it; the values
are served on the stage's ``/metrics`` under the family's own name, as Triton
serves them (a counter is ``name{labels} value``, no ``_total``). Every
instance of every python model shares one ``CustomMetrics`` collector, so two
instances that declare the same family and labels update the same series.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as PromMetric

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass
class _Series:
    value: float = 0.0
    buckets: list[float] = field(default_factory=list)
    """Histogram: per-bucket counts (not cumulative) for each upper bound, +Inf last."""
    total: float = 0.0
    count: int = 0


@dataclass
class _Family:
    name: str
    description: str
    kind: str
    bounds: tuple[float, ...] = ()
    series: dict[tuple[tuple[str, str], ...], _Series] = field(default_factory=dict)


class CustomMetrics:
    """The families python models declared, collected on every scrape."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()
        self._registries: list[CollectorRegistry] = []

    def attach(self, registry: CollectorRegistry) -> None:
        """Serve the families on ``registry`` (a stage's /metrics)."""
        if registry not in self._registries:
            registry.register(self)  # type: ignore[arg-type]
            self._registries.append(registry)

    def detach(self, registry: CollectorRegistry) -> None:
        """Stop serving on ``registry`` (its stage stopped)."""
        if registry in self._registries:
            registry.unregister(self)  # type: ignore[arg-type]
            self._registries.remove(registry)

    def family(self, name: str, description: str, kind: str, bounds: Sequence[float]) -> _Family:
        """The family ``name``, declared now or earlier with the same kind."""
        if not _NAME.match(name):
            raise ValueError(f"metric family name {name!r} is not a valid Prometheus name")
        with self._lock:
            existing = self._families.get(name)
            if existing is not None:
                if existing.kind != kind:
                    raise ValueError(
                        f"metric family '{name}' exists as a {existing.kind}, not a {kind}"
                    )
                return existing
            if any(name in registry._names_to_collectors for registry in self._registries):
                raise ValueError(f"metric family '{name}' is a name the server already serves")
            created = _Family(name, description, kind, tuple(sorted(bounds)))
            self._families[name] = created
            return created

    def update(
        self, family: _Family, key: tuple[tuple[str, str], ...], how: str, value: float
    ) -> None:
        """Apply one change (``add``, ``set`` or ``observe``) to a series."""
        with self._lock:
            series = family.series.setdefault(key, _new_series(family))
            if how == "add":
                series.value += value
            elif how == "set":
                series.value = value
            else:
                series.buckets[bisect.bisect_left(family.bounds, value)] += 1
                series.total += value
                series.count += 1

    def read(self, family: _Family, key: tuple[tuple[str, str], ...]) -> float:
        """The series' current value."""
        with self._lock:
            return family.series.setdefault(key, _new_series(family)).value

    def collect(self) -> list[PromMetric]:
        """Every family's series (called by the registry on each scrape)."""
        with self._lock:
            return [_exposed(family) for family in self._families.values()]


def _new_series(family: _Family) -> _Series:
    return _Series(buckets=[0.0] * (len(family.bounds) + 1))


def _exposed(family: _Family) -> PromMetric:
    metric = PromMetric(family.name, family.description, family.kind)
    for key, series in family.series.items():
        labels = dict(key)
        if family.kind != "histogram":
            metric.add_sample(family.name, labels, series.value)
            continue
        cumulative = 0.0
        for bound, count in zip([*family.bounds, float("inf")], series.buckets, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            metric.add_sample(f"{family.name}_bucket", {**labels, "le": le}, cumulative)
        metric.add_sample(f"{family.name}_count", labels, float(series.count))
        metric.add_sample(f"{family.name}_sum", labels, series.total)
    return metric


METRICS = CustomMetrics()
"""The stage's collector: the python backend attaches it to the stage's registry."""


class MetricFamily:
    """A named metric with a kind; ``Metric(labels)`` makes one series of it."""

    COUNTER: ClassVar[str] = "counter"
    GAUGE: ClassVar[str] = "gauge"
    HISTOGRAM: ClassVar[str] = "histogram"

    def __init__(
        self, name: str, description: str, kind: str, buckets: Sequence[float] | None = None
    ) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise ValueError(f"metric family '{name}': kind must be COUNTER, GAUGE or HISTOGRAM")
        if kind == self.HISTOGRAM and not buckets:
            raise ValueError(f"metric family '{name}': a HISTOGRAM needs buckets")
        self._family = METRICS.family(name, description, kind, buckets or ())

    def Metric(self, labels: dict[str, str] | None = None, buckets: Any = None) -> Metric:
        """The series of this family with ``labels``."""
        return Metric(self._family, labels or {})


class Metric:
    """One series of a MetricFamily."""

    def __init__(self, family: _Family, labels: dict[str, str]) -> None:
        for key in labels:
            if not _LABEL.match(str(key)):
                raise ValueError(f"metric '{family.name}': label {key!r} is not a valid name")
        self._family = family
        self._key = tuple(sorted((str(k), str(v)) for k, v in labels.items()))

    def increment(self, value: float) -> None:
        """Add ``value`` (a counter only goes up)."""
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise ValueError(f"metric '{self._family.name}' is a histogram: use observe")
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise ValueError(f"counter '{self._family.name}' cannot be decremented")
        METRICS.update(self._family, self._key, "add", float(value))

    def set(self, value: float) -> None:
        """Set a gauge."""
        if self._family.kind != MetricFamily.GAUGE:
            raise ValueError(
                f"metric '{self._family.name}' is a {self._family.kind}; only gauges set"
            )
        METRICS.update(self._family, self._key, "set", float(value))

    def observe(self, value: float) -> None:
        """Record one value in a histogram."""
        if self._family.kind != MetricFamily.HISTOGRAM:
            raise ValueError(
                f"metric '{self._family.name}' is a {self._family.kind}, not a histogram"
            )
        METRICS.update(self._family, self._key, "observe", float(value))

    def value(self) -> float:
        """The current value (counters and gauges)."""
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise ValueError(f"metric '{self._family.name}' is a histogram: it has no single value")
        return METRICS.read(self._family, self._key)
