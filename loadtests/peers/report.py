"""The peer benchmark's printout: a line per round, a table per way, the ratios, a plot.

Per way and in-flight level the rounds are summarised as: req/s, the median
of the rounds whose CPU steal stayed at or under ``QUIET_STEAL`` cores (the
hypervisor takes up to 0.5-0.8 cores from a small VM in bursts) beside the
median of all rounds; p50 / p99 and CPU per request, medians over rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common import LoadResult, format_table

QUIET_STEAL = 0.15
"""Cores of steal at or under which a round counts as quiet."""
MESH_PROCESSES = ("envoy", "http_adapter", "orchestrator", "inference-0", "supervisor")


def steal_cores(result: LoadResult) -> float:
    """Cores the hypervisor took on average during the window."""
    first, last = result.probes
    if first is None or last is None:
        return float("nan")
    return float(last - first) / max(result.usage.seconds, 1e-9)


def server_cpu_ms(result: LoadResult) -> float:
    """CPU ms per request of every process of the server."""
    return 1000.0 * sum(result.usage.processes.values()) / result.per()


def round_line(result: LoadResult) -> str:
    """One window, as it finishes."""
    return (
        f"{result.label:<24} @{result.in_flight:<2} {result.rate:7.1f} req/s  "
        f"p50 {result.percentile(50):6.2f} ms  p99 {result.percentile(99):6.2f} ms  "
        f"server {server_cpu_ms(result):5.2f} ms/req  steal {steal_cores(result):.2f} cores  "
        f"others {result.usage.others:.1f} cores"
        + (f"  errors {result.errors}" if result.errors else "")
    )


@dataclass(frozen=True)
class Summary:
    """One way at one in-flight level over all rounds."""

    label: str
    in_flight: int
    rates: list[float]
    steals: list[float]
    p50: float
    p99: float
    cpu_ms: float
    """Server CPU per request, every process."""
    by_process: dict[str, float]
    """CPU ms per request by process (median over rounds)."""
    client_ms: float
    errors: int
    others: float
    """Cores the rest of the machine (neighbours) kept busy, median over rounds."""

    @property
    def rate(self) -> float:
        """Median req/s over every round."""
        return statistics.median(self.rates)

    @property
    def quiet_rate(self) -> float:
        """Median req/s over the quiet rounds (NaN when none was quiet)."""
        quiet = [r for r, s in zip(self.rates, self.steals, strict=True) if s <= QUIET_STEAL]
        return statistics.median(quiet) if quiet else float("nan")

    @property
    def best_rate(self) -> float:
        """The quiet median, else the plain one."""
        quiet = self.quiet_rate
        return self.rate if math.isnan(quiet) else quiet


def summarise(results: Sequence[LoadResult]) -> list[Summary]:
    """Group the rounds by (way, in-flight), in first-seen order."""
    groups: dict[tuple[str, int], list[LoadResult]] = {}
    for result in results:
        groups.setdefault((result.label, result.in_flight), []).append(result)
    summaries = []
    for (label, in_flight), runs in groups.items():
        labels = sorted({k for r in runs for k in r.usage.processes})
        by_process = {
            k: statistics.median(1000.0 * r.usage.processes.get(k, 0.0) / r.per() for r in runs)
            for k in labels
        }
        summaries.append(
            Summary(
                label,
                in_flight,
                [r.rate for r in runs],
                [steal_cores(r) for r in runs],
                statistics.median(r.percentile(50) for r in runs),
                statistics.median(r.percentile(99) for r in runs),
                statistics.median(server_cpu_ms(r) for r in runs),
                by_process,
                statistics.median(r.client_cpu_ms() for r in runs),
                sum(r.errors for r in runs),
                statistics.median(r.usage.others for r in runs),
            )
        )
    return summaries


def _processes(summary: Summary) -> str:
    if not any(k in summary.by_process for k in MESH_PROCESSES):
        return ""
    short = {"http_adapter": "adapter", "inference-0": "stage", "orchestrator": "orch"}
    parts = [
        f"{short.get(k, k)} {summary.by_process[k]:.2f}"
        for k in MESH_PROCESSES
        if summary.by_process.get(k, 0.0) >= 0.005
    ]
    return ", ".join(parts)


def table(summaries: Sequence[Summary]) -> str:
    """Every way: rates, latency, CPU, steal."""
    headers = ["way", "in flight", "req/s quiet", "req/s all", "p50 ms", "p99 ms"]
    headers += [
        "server CPU ms/req",
        "client ms/req",
        "steal by round",
        "others",
        "errors",
        "mesh CPU by process",
    ]
    rows = [
        [
            s.label,
            s.in_flight,
            s.quiet_rate,
            s.rate,
            s.p50,
            s.p99,
            s.cpu_ms,
            s.client_ms,
            " ".join(f"{x:.2f}" for x in s.steals),
            s.others,
            s.errors,
            _processes(s),
        ]
        for s in summaries
    ]
    note = (
        f"(req/s quiet: median of rounds with steal <= {QUIET_STEAL} cores, '-' when none; "
        "steal in cores; others: cores other processes used meanwhile; CPU in ms per request)"
    )
    return format_table(headers, rows) + "\n" + note


def _find(summaries: Sequence[Summary], label: str, in_flight: int) -> Summary | None:
    return next((s for s in summaries if s.label == label and s.in_flight == in_flight), None)


_GOALS = (
    # (what, numerator way, denominator way, goal)
    ("stage direct / KServe gRPC", "stage direct", "KServe gRPC", 1.0),
    ("stage direct b8 / KServe gRPC", "stage direct b8", "KServe gRPC", 1.0),
    ("stage direct b8 / TorchServe REST b8", "stage direct b8", "TorchServe REST b8", 1.0),
    ("Envoy gRPC / stage direct", "Envoy gRPC", "stage direct", 0.8),
    ("Envoy gRPC / KServe gRPC", "Envoy gRPC", "KServe gRPC", 1.0),
    ("Envoy REST JSON / KServe REST JSON", "Envoy REST JSON", "KServe REST JSON", 1.0),
    (
        "in-orch: Envoy REST JSON / KServe REST JSON",
        "in-orch: Envoy REST JSON",
        "KServe REST JSON",
        1.0,
    ),
    ("Envoy REST binary / KServe REST binary", "Envoy REST binary", "KServe REST binary", 1.0),
    ("orchestrator gRPC / stage direct", "orchestrator gRPC", "stage direct", 0.8),
    ("FastAPI JSON / Envoy REST JSON", "FastAPI JSON", "Envoy REST JSON", float("nan")),
)


def ratios(summaries: Sequence[Summary]) -> str:
    """The req/s ratios the project holds itself to, and the orchestrator hop's CPU."""
    levels = sorted({s.in_flight for s in summaries}, reverse=True)
    rows: list[list[object]] = []
    for in_flight in levels:
        for what, top, bottom, goal in _GOALS:
            a, b = _find(summaries, top, in_flight), _find(summaries, bottom, in_flight)
            if a is None or b is None:
                continue
            ratio = a.best_rate / b.best_rate
            verdict = "" if math.isnan(goal) else ("ok" if ratio >= goal else f"below {goal}")
            rows.append([what, in_flight, ratio, a.rate / b.rate, verdict])
    lines = [format_table(["ratio (req/s)", "in flight", "quiet", "all", "goal"], rows)]
    for in_flight in levels:
        # Called on its own gRPC port, and behind Envoy (ModelInfer on its wire door).
        for way, door in (("orchestrator gRPC", "gRPC port"), ("Envoy gRPC", "behind Envoy")):
            orch = _find(summaries, way, in_flight)
            if orch is not None and "orchestrator" in orch.by_process:
                cpu = orch.by_process["orchestrator"]
                lines.append(
                    f"orchestrator hop ({door}) @{in_flight}: {cpu:.2f} ms CPU per request"
                    " (goal <= 0.5)"
                )
    batched, plain = _find(summaries, "stage direct b8", 1), _find(summaries, "stage direct", 1)
    if batched is not None and plain is not None:
        lines.append(
            f"batching at 1 in flight: p50 {batched.p50:.2f} vs {plain.p50:.2f} ms "
            f"= {batched.p50 / plain.p50:.2f}x (goal <= 1.3x)"
        )
    return "\n".join(lines)


def plot(summaries: Sequence[Summary], path: Path) -> None:
    """Bars of req/s (quiet median, all-round median as a tick) and server CPU per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level = max(s.in_flight for s in summaries)
    shown = [s for s in summaries if s.in_flight == level]
    names = [s.label for s in shown]
    colours = ["tab:blue" if _is_mesh(s) else "tab:gray" for s in shown]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(shown) + 1.5))
    left.barh(names, [s.best_rate for s in shown], color=colours)
    left.scatter([s.rate for s in shown], names, color="black", marker="|", s=120, zorder=3)
    left.set_xlabel(f"req/s at {level} in flight (bar: quiet rounds; tick: all rounds)")
    left.invert_yaxis()
    right.barh(names, [s.cpu_ms for s in shown], color=colours)
    right.set_xlabel("server CPU ms per request (all its processes)")
    right.invert_yaxis()
    right.set_yticklabels([])
    figure.suptitle("MLP 128-512-10, batch 1, closed loop (blue: meshserve)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _is_mesh(summary: Summary) -> bool:
    return any(k in summary.by_process for k in MESH_PROCESSES)
