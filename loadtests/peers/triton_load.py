"""Triton's perf_analyzer as a second load generator, beside the benchmark's own closed loop.

For each way perf_analyzer speaks (v2 gRPC, and v2 HTTP with binary tensors)
it runs the same load on the same running server, right before or right
after the closed loop's window (the order turns from way to way and round to
round), under the same terms:

    load         ``--concurrency-range N`` (N threads, each a request in flight)
    connections  gRPC: as many HTTP/2 connections as the closed loop opens (its
                 client threads share a channel in groups, ``GRPC_SHARE``); HTTP: one
                 per thread, as the closed loop's pool
    warm-up      ``--warmup-request-count`` about the closed loop's warm-up time
    window       three windows that together last the closed loop's one

Both generators' own CPU per request and the server's CPU per request under
each are set side by side: on a 2-core host the load generator takes its CPU
from the server, so a client that costs more leaves the server less.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import ROOT, LoadResult, format_table
from peers.model import MODEL
from peers.report import server_cpu_ms, steal_cores
from peers.servers import Running
from peers.ways import GRPC_CONNECTIONS, Way

from deploy.local.procfs import TICKS, process_cpu_seconds

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests import perf_analyzer

CACHE = Path(os.environ.get("MESHSERVE_CACHE", "~/.cache/meshserve")).expanduser()
AGREE = 0.10
"""How far apart the two generators' req/s may be and still agree."""


@dataclass(frozen=True)
class PerfRun:
    """One perf_analyzer run on one way."""

    throughput: float
    p50_ms: float
    p99_ms: float
    client_ms: float
    """perf_analyzer's own CPU per request over its whole run (start-up and warm-up in)."""
    server_ms: float
    """The server's CPU per request over the same run."""
    steal: float
    """Cores the hypervisor took during the run."""


@dataclass(frozen=True)
class Agreement:
    """One round of one way: perf_analyzer's figures and the closed loop's."""

    label: str
    in_flight: int
    run: PerfRun
    closed: LoadResult
    """The closed loop's window in the same round."""
    first: str
    """Which generator ran first this round: "pa" or "loop"."""

    @property
    def ratio(self) -> float:
        """perf_analyzer's req/s over the closed loop's."""
        return self.run.throughput / max(self.closed.rate, 1e-9)


def missing() -> str | None:
    """Why perf_analyzer cannot run here, or None."""
    return perf_analyzer.missing(CACHE)


def _steal_seconds() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / TICKS


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _server_cpu(pids: Mapping[str, int]) -> float:
    return sum(process_cpu_seconds(pid) for pid in pids.values())


def _options(seconds: float, warmup: int) -> list[str]:
    # Three windows that together last about as long as the closed loop's one.
    window_ms = str(max(500, int(seconds * 1000 / 3)))
    options = ["--measurement-interval", window_ms, "--stability-percentage", "1000"]
    options += ["--max-trials", "3", "--warmup-request-count", str(warmup)]
    return options


def _run(way: Way, running: Running, in_flight: int, seconds: float, warmup: int) -> PerfRun:
    """perf_analyzer on ``way``, its own CPU and the server's read around it."""
    assert way.perf_analyzer is not None
    address, protocol = way.perf_analyzer(running)
    # As many HTTP/2 connections as the closed loop's GrpcTarget opens.
    share = math.ceil(in_flight / min(in_flight, GRPC_CONNECTIONS))
    env = {perf_analyzer.GRPC_SHARE: str(share)}
    options = _options(seconds, warmup)
    client, server = _children_cpu(), _server_cpu(running.pids)
    steal, started = _steal_seconds(), time.perf_counter()
    result = perf_analyzer.run(CACHE, MODEL, address, protocol, str(in_flight), options, env=env)
    wall = time.perf_counter() - started
    client, server = _children_cpu() - client, _server_cpu(running.pids) - server
    level = result.levels[0]
    # Requests over the whole run, warm-up in: its rate times its time (start-up is ~0.1 s).
    requests = max(1.0, level.throughput * wall)
    return PerfRun(
        level.throughput,
        level.p50_ms,
        level.p99_ms,
        1000.0 * client / requests,
        1000.0 * server / requests,
        (_steal_seconds() - steal) / wall,
    )


async def measure(
    way: Way, running: Running, in_flight: int, seconds: float, warmup: int
) -> PerfRun | None:
    """perf_analyzer on ``way`` (None where it does not speak it, or failed: reported)."""
    if way.perf_analyzer is None:
        return None
    try:
        return await asyncio.to_thread(_run, way, running, in_flight, seconds, warmup)
    except RuntimeError as exc:  # reported, and the benchmark goes on
        print(f"  perf_analyzer on {way.label}: {str(exc)[-300:]}")
        return None


def line(agreement: Agreement) -> str:
    """One round, as it finishes."""
    run = agreement.run
    return (
        f"{'perf_analyzer ' + agreement.label:<38} @{agreement.in_flight:<2} "
        f"{run.throughput:7.1f} infer/s  p50 {run.p50_ms:6.2f} ms  "
        f"server {run.server_ms:5.2f} ms/req  client {run.client_ms:5.2f} ms/req  "
        f"steal {run.steal:.2f}  = {agreement.ratio:.2f}x the closed loop ({agreement.first} first)"
    )


def _cpu_bound_ratio(item: Agreement) -> float:
    """perf_analyzer's rate over the closed loop's if CPU alone limited both runs."""
    loop = server_cpu_ms(item.closed) + item.closed.client_cpu_ms()
    return loop / max(item.run.server_ms + item.run.client_ms, 1e-9)


def table(agreements: Sequence[Agreement]) -> str:
    """Per way: the median of perf_analyzer's rate over its closed loop's, round by round,
    and what each generator and the server spent per request under each."""
    groups: dict[tuple[str, int], list[Agreement]] = {}
    for item in agreements:
        groups.setdefault((item.label, item.in_flight), []).append(item)
    rows = []
    for (label, in_flight), items in groups.items():
        ratio = statistics.median(i.ratio for i in items)
        rows.append(
            [
                label,
                in_flight,
                statistics.median(i.run.throughput for i in items),
                statistics.median(i.closed.rate for i in items),
                ratio,
                " ".join(f"{i.ratio:.2f}{'p' if i.first == 'pa' else 'c'}" for i in items),
                statistics.median(i.run.client_ms for i in items),
                statistics.median(i.closed.client_cpu_ms() for i in items),
                statistics.median(i.run.server_ms for i in items),
                statistics.median(server_cpu_ms(i.closed) for i in items),
                statistics.median(_cpu_bound_ratio(i) for i in items),
                " ".join(f"{max(i.run.steal, steal_cores(i.closed)):.2f}" for i in items),
                "yes" if abs(ratio - 1) <= AGREE else "no",
            ]
        )
    headers = ["way", "in flight", "perf_analyzer /s", "closed loop /s", "ratio", "by round"]
    headers += ["PA client ms", "loop client ms", "server ms (PA)", "server ms (loop)"]
    headers += ["CPU-bound ratio", "steal", f"within {AGREE:.0%}"]
    note = (
        "(ratio: perf_analyzer's req/s over the closed loop's, median over rounds; by round: "
        "p = perf_analyzer ran first, c = the closed loop did; client and server: CPU ms per "
        "request under each generator; CPU-bound ratio: the ratio to expect if the machine's "
        "CPU were all that limited both, (server + client) under the closed loop over the "
        "same under perf_analyzer; steal: the larger of the two runs', in cores)"
    )
    return "\n".join([format_table(headers, rows), note, _verdict(headers, rows)])


def _verdict(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """How many ways agree, and whether the two clients cost alike: the check's
    terms are equal client cost (``--client-work-us``; docs/performance.md)."""
    if not rows:
        return "perf_analyzer: no way measured"

    def column(name: str) -> list[Any]:
        index = headers.index(name)
        return [row[index] for row in rows]

    agreed = column(f"within {AGREE:.0%}").count("yes")
    pa, loop = column("PA client ms"), column("loop client ms")
    return (
        f"perf_analyzer within {AGREE:.0%} of the closed loop on {agreed} of {len(rows)} ways; "
        f"client CPU ms per request: perf_analyzer {min(pa):.2f}-{max(pa):.2f}, "
        f"closed loop {min(loop):.2f}-{max(loop):.2f}"
    )
