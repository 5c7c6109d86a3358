"""Triton's own load tool, ``perf_analyzer``, run against the mesh (tests and benchmarks).

It ships inside the ``tritonclient==2.51.0`` wheel (later wheels need a newer
glibc), in its own venv (``make perf-analyzer``: tritonclient 2.51 beside the
project's 2.73 clashes), and needs libcudart from ``nvidia-cuda-runtime-cu12``
on LD_LIBRARY_PATH and Debian's ``libb64-0d``. ``run()`` calls it as a Triton
user would (``-m MODEL -u HOST:PORT -i grpc|http --concurrency-range ...``,
``--streaming`` for a decoupled model) and reads back its CSV and the request
counts it prints (the client's, and the server's from the statistics
extension).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

VENV = "perf-analyzer-2.51.0"
"""Its venv under ``<cache>/venvs``."""
_CUDART = Path("lib/python3.11/site-packages/nvidia/cuda_runtime/lib")
_LIBB64 = "libb64.so.0d"


def binary(cache: Path) -> Path:
    """Where ``make perf-analyzer`` puts it."""
    return cache / "venvs" / VENV / "bin" / "perf_analyzer"


def missing(cache: Path) -> str | None:
    """Why perf_analyzer cannot run here, or None."""
    if not binary(cache).exists():
        return f"perf_analyzer is not installed at {binary(cache)} (make perf-analyzer)"
    if not any(Path(d).glob(f"{_LIBB64}*") for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib")):
        return "Debian's libb64-0d is missing (make system-packages)"
    return None


@dataclass(frozen=True)
class Level:
    """One concurrency level of a run, as perf_analyzer's CSV gives it."""

    concurrency: int
    throughput: float
    """Inferences per second."""
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class Measurement:
    """What one perf_analyzer run reported."""

    levels: list[Level]
    """By concurrency, as they ran."""
    client_requests: list[int]
    """"Request count" per level: requests the client completed in its windows."""
    server_requests: list[int]
    """"Successful request count" per level: the server's statistics over the same windows."""
    response_throughput: list[float]
    """Responses per second per level (decoupled models only: several per request)."""
    output: str


def run(
    cache: Path,
    model: str,
    url: str,
    protocol: str,
    concurrency: str,
    options: Sequence[str] = (),
    timeout_s: float = 120.0,
    folder: Path | None = None,
    env: dict[str, str] | None = None,
) -> Measurement:
    """perf_analyzer against ``url`` (``env``: more environment); raises with its output
    when it fails."""
    folder = folder or Path(os.environ.get("TMPDIR", "/tmp"))
    report = folder / f"perf-{model}-{protocol}-{os.getpid()}.csv"
    command = [str(binary(cache)), "-m", model, "-u", url, "-i", protocol]
    command += ["--concurrency-range", concurrency, "-f", str(report), *options]
    cudart = binary(cache).parent.parent / _CUDART
    environment = {**os.environ, **(env or {}), "LD_LIBRARY_PATH": str(cudart)}
    done = subprocess.run(
        command, check=False, env=environment, capture_output=True, text=True, timeout=timeout_s
    )
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer exited {done.returncode}:\n{output[-4000:]}")
    with report.open() as handle:
        rows = list(csv.DictReader(handle))
    report.unlink()
    # The CSV lists the levels by increasing throughput, not by concurrency: put
    # them back in the order they ran (the windows' counts below come in that order).
    levels = sorted(
        (
            Level(
                int(row["Concurrency"]),
                float(row["Inferences/Second"]),
                float(row["p50 latency"]) / 1000.0,
                float(row["p99 latency"]) / 1000.0,
            )
            for row in rows
        ),
        key=lambda level: level.concurrency,
    )
    return Measurement(
        levels,
        [int(n) for n in re.findall(r"^\s+Request count: (\d+)", output, re.MULTILINE)],
        [int(n) for n in re.findall(r"Successful request count: (\d+)", output)],
        [float(x) for x in re.findall(r"Response Throughput: ([\d.]+)", output)],
        output,
    )


QUICK = (
    "--measurement-interval",
    "250",
    "--stability-percentage",
    "1000",
    "--max-trials",
    "4",
)
"""A short run for tests: windows of 250 ms, any spread accepted as stable."""

GRPC_SHARE = "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"
"""How many of perf_analyzer's client threads share one gRPC channel (one HTTP/2
connection; the client library's default is 6)."""
