"""Triton's perf_analyzer as a second load generator, beside the benchmark's own closed loop.

For each way perf_analyzer speaks (v2 gRPC, and v2 HTTP with binary tensors),
right after the closed loop's window on the same running server, it runs the
same load (``--concurrency-range N``, about the same measured time) and its
throughput and latency are set beside the closed loop's: the two load
generators agree when the server, not the client, is what limits.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, format_table
from peers.model import MODEL
from peers.servers import Running
from peers.ways import Way

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests import perf_analyzer

CACHE = Path(os.environ.get("MESHSERVE_CACHE", "~/.cache/meshserve")).expanduser()


@dataclass(frozen=True)
class Agreement:
    """One round of one way: perf_analyzer's figures and the closed loop's."""

    label: str
    in_flight: int
    throughput: float
    p50_ms: float
    p99_ms: float
    closed_loop: float
    """The closed loop's req/s in the same round."""


def missing() -> str | None:
    """Why perf_analyzer cannot run here, or None."""
    return perf_analyzer.missing(CACHE)


async def measure(
    way: Way, running: Running, in_flight: int, seconds: float, closed_loop: float
) -> Agreement | None:
    """perf_analyzer on ``way`` (None where it does not speak it)."""
    if way.perf_analyzer is None:
        return None
    address, protocol = way.perf_analyzer(running)
    # Three windows that together last about as long as the closed loop's one.
    window_ms = str(max(500, int(seconds * 1000 / 3)))
    options = ["--measurement-interval", window_ms, "--stability-percentage", "1000"]
    options += ["--max-trials", "3"]
    try:
        result = await asyncio.to_thread(
            perf_analyzer.run, CACHE, MODEL, address, protocol, str(in_flight), options
        )
    except RuntimeError as exc:  # reported, and the benchmark goes on
        print(f"  perf_analyzer on {way.label}: {str(exc)[-300:]}")
        return None
    level = result.levels[0]
    rate, p50, p99 = level.throughput, level.p50_ms, level.p99_ms
    return Agreement(way.label, in_flight, rate, p50, p99, closed_loop)


def line(agreement: Agreement) -> str:
    """One round, as it finishes."""
    ratio = agreement.throughput / agreement.closed_loop
    return (
        f"{'perf_analyzer ' + agreement.label:<38} @{agreement.in_flight:<2} "
        f"{agreement.throughput:7.1f} infer/s  p50 {agreement.p50_ms:6.2f} ms  "
        f"= {ratio:.2f}x the closed loop"
    )


def table(agreements: Sequence[Agreement]) -> str:
    """Per way: the median of perf_analyzer's rate over its closed loop's, round by round."""
    groups: dict[tuple[str, int], list[Agreement]] = {}
    for item in agreements:
        groups.setdefault((item.label, item.in_flight), []).append(item)
    rows = []
    for (label, in_flight), items in groups.items():
        ratios = [i.throughput / i.closed_loop for i in items]
        ratio = statistics.median(ratios)
        rows.append(
            [
                label,
                in_flight,
                statistics.median(i.throughput for i in items),
                statistics.median(i.closed_loop for i in items),
                ratio,
                " ".join(f"{r:.2f}" for r in ratios),
                "yes" if abs(ratio - 1) <= 0.1 else "no",
            ]
        )
    headers = ["way", "in flight", "perf_analyzer infer/s", "closed loop req/s", "ratio"]
    headers += ["by round", "within 10%"]
    return format_table(headers, rows)
