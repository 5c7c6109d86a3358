"""Overload and connection abuse: what they leave for the other clients of a mesh.

Parts of ``loadtests/reliability.py`` (``overload``, ``abuse``), on a mesh of
the image models only (no LLM: nothing here needs it):

- ``overload``: ``--overload-in-flight`` (256) requests to ``image_classifier``
  kept in flight on the orchestrator for ``--overload-s``: answers by code (only
  OK and RESOURCE_EXHAUSTED expected), latency of each, RSS of every process
  before and after;
- ``abuse``, against Envoy, each while a well-behaved client calls
  ``image_classifier`` through Envoy 5 times a second (its success rate and
  p99 are the measure):
  - slowloris: connections that send a request's headers a line a second and
    never finish them; Envoy should close each at ``request_headers_timeout_s``;
  - idle: connections that send nothing; closed at ``connection_idle_timeout_s``;
  - half-open: gRPC streams opened and never written, and HTTP/1.1 requests
    that promise a body and send half of it; the well-behaved client keeps its
    answers while they are held.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from common import format_table

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc

IMAGE_MODELS = ["image_classifier", "image_preprocess", "mobilenet_v2_onnx", "imagenet_top5"]
PROBE_EVERY_S = 0.2
OPEN_BATCH = 50
"""Connections opened at once (a burst of thousands trips the kernel's SYN backlog)."""


@dataclass
class Answers:
    """Codes and latencies of a set of calls."""

    codes: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, code: str, took: float) -> None:
        """Count one answer."""
        self.codes[code] += 1
        self.seconds.setdefault(code, []).append(took)

    def p(self, code: str, q: float) -> float:
        """The q-quantile (0..1) of the latencies of answers with ``code`` (NaN: none)."""
        values = sorted(self.seconds.get(code, []))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    def summary(self) -> str:
        """``OK=n RESOURCE_EXHAUSTED=m``."""
        return " ".join(f"{code}={n}" for code, n in sorted(self.codes.items()))

    def success(self) -> float:
        """Share of answers that were OK."""
        total = sum(self.codes.values())
        return self.codes["OK"] / total if total else float("nan")


async def _timed(
    stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest, timeout_s: float
) -> tuple[str, float]:
    started = time.monotonic()
    try:
        await stub.ModelInfer(request, timeout=timeout_s)
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return code, time.monotonic() - started


async def overload(
    orchestrator: str, request: pb.ModelInferRequest, in_flight: int, seconds: float
) -> tuple[Answers, float]:
    """``in_flight`` callers back to back for ``seconds`` (a refused one waits 50 ms); the
    answers, and the seconds until the last call ended."""
    answers = Answers()
    started = time.monotonic()
    channels = [grpc.aio.insecure_channel(orchestrator) for _ in range(8)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    end = time.monotonic() + seconds

    async def caller(index: int) -> None:
        while time.monotonic() < end:
            code, took = await _timed(stubs[index % len(stubs)], request, 60)
            answers.add(code, took)
            if code != "OK":
                await asyncio.sleep(0.05)

    try:
        await asyncio.gather(*(caller(i) for i in range(in_flight)))
    finally:
        for channel in channels:
            await channel.close()
    return answers, time.monotonic() - started


@contextlib.asynccontextmanager
async def probing(edge: str, request: pb.ModelInferRequest) -> AsyncIterator[Answers]:
    """A well-behaved client through Envoy, one call every PROBE_EVERY_S, while inside."""
    answers = Answers()
    stop = asyncio.Event()

    async def probe() -> None:
        async with grpc.aio.insecure_channel(edge) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            while not stop.is_set():
                answers.add(*await _timed(stub, request, 10))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), PROBE_EVERY_S)

    task = asyncio.create_task(probe())
    try:
        yield answers
    finally:
        stop.set()
        await task


@dataclass
class Held:
    """Hostile connections: when each was closed by the other side (None: still open)."""

    opened: int = 0
    refused: int = 0
    closed_after_s: list[float] = field(default_factory=list)

    def still_open(self) -> int:
        """Connections the server had not closed."""
        return self.opened - len(self.closed_after_s)


async def _hold(
    host: str, port: int, held: Held, until: float, talk: Callable[[asyncio.StreamWriter], Any]
) -> None:
    """One connection: ``talk`` writes on it until ``until``; record when the peer answers
    or closes it."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        held.refused += 1
        return
    held.opened += 1
    started = time.monotonic()
    talker = asyncio.create_task(talk(writer))
    try:
        # The server lets go with an answer (408) and a close, or a reset.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                with contextlib.suppress(ConnectionError):
                    await reader.read(4096)
                held.closed_after_s.append(time.monotonic() - started)
    finally:
        talker.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await talker
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def hold_connections(
    edge: str, count: int, seconds: float, talk: Callable[[asyncio.StreamWriter], Any]
) -> Held:
    """``count`` connections to ``edge`` for ``seconds``, opened OPEN_BATCH at a time."""
    host, _, port = edge.rpartition(":")
    held = Held()
    until = time.monotonic() + seconds
    tasks = []
    for first in range(0, count, OPEN_BATCH):
        batch = range(first, min(count, first + OPEN_BATCH))
        tasks += [asyncio.create_task(_hold(host, int(port), held, until, talk)) for _ in batch]
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    return held


async def slowloris(writer: asyncio.StreamWriter) -> None:
    """A request's headers, one line a second, never ended."""
    writer.write(b"POST /v2/models/image_classifier/infer HTTP/1.1\r\nHost: edge\r\n")
    for index in range(10_000):
        await writer.drain()
        await asyncio.sleep(1.0)
        writer.write(f"X-Slow-{index}: a\r\n".encode())


async def silent(writer: asyncio.StreamWriter) -> None:
    """Nothing at all."""
    await asyncio.sleep(86_400)


async def half_body(writer: asyncio.StreamWriter) -> None:
    """A request that promises a 10,000-byte body and sends half of it."""
    writer.write(
        b"POST /v2/models/image_classifier/infer HTTP/1.1\r\nHost: edge\r\n"
        b"Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n" + b" " * 5000
    )
    await writer.drain()
    await asyncio.sleep(86_400)


async def unwritten_streams(edge: str, count: int, seconds: float) -> int:
    """``count`` gRPC streams through ``edge`` opened and never written; how many were
    still open after ``seconds``."""
    channels = [grpc.aio.insecure_channel(edge) for _ in range(4)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    never = asyncio.Event()

    async def nothing() -> AsyncIterator[pb.ModelInferRequest]:
        await never.wait()
        yield pb.ModelInferRequest()

    calls = [stubs[i % len(stubs)].ModelStreamInfer(nothing()) for i in range(count)]
    reads = [asyncio.create_task(_first(call)) for call in calls]
    await asyncio.sleep(seconds)
    still = sum(not task.done() for task in reads)
    for call in calls:
        call.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return still


async def _first(call: Any) -> None:
    async for _ in call:
        return


def rss_table(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """RSS per process, before and after, with growth."""
    rows = [
        [name, before[name], after[name], 100 * (after[name] / before[name] - 1)]
        for name in sorted(before)
    ]
    return format_table(["process", "RSS before MiB", "RSS after MiB", "growth %"], rows)


def overload_row(name: str, answers: Answers, seconds: float) -> list[Any]:
    """One table row of an overload run that took ``seconds`` (wall)."""
    return [
        name,
        sum(answers.codes.values()),
        answers.summary(),
        seconds,
        answers.codes["OK"] / seconds,
        answers.p("OK", 0.5),
        answers.p("OK", 0.99),
        answers.p("RESOURCE_EXHAUSTED", 0.99),
    ]


OVERLOAD_HEADERS = [
    "run",
    "answers",
    "codes",
    "wall s",
    "OK/s",
    "OK p50 s",
    "OK p99 s",
    "refused p99 s",
]
ABUSE_HEADERS = [
    "abuse",
    "held",
    "refused",
    "closed by Envoy",
    "median close s",
    "probe codes",
    "probe p99 s",
]


def abuse_row(name: str, held: Held | int, total: int, probe: Answers) -> list[Any]:
    """One table row of an abuse run (``held`` is a count for gRPC streams)."""
    if isinstance(held, Held):
        closes = held.closed_after_s
        closed = f"{len(closes)}/{held.opened}"
        median = statistics.median(closes) if closes else float("nan")
        refused = held.refused
    else:
        closed, median, refused = f"{total - held}/{total}", float("nan"), 0
    return [name, total, refused, closed, median, probe.summary(), probe.p("OK", 0.99)]


async def run_abuse(
    edge: str,
    request: pb.ModelInferRequest,
    counts: Mapping[str, int],
    limits: Mapping[str, float],
) -> tuple[list[list[Any]], bool]:
    """Slowloris, idle and half-open connections in turn, each under a probe."""
    rows, fine = [], True
    runs: list[tuple[str, Callable[[], Awaitable[Held | int]], int, float | None]] = [
        (
            "slowloris headers",
            lambda: hold_connections(edge, counts["slow"], limits["headers_s"] + 5, slowloris),
            counts["slow"],
            limits["headers_s"],
        ),
        (
            "idle connections",
            lambda: hold_connections(edge, counts["idle"], limits["idle_s"] + 5, silent),
            counts["idle"],
            limits["idle_s"],
        ),
        (
            "half-sent bodies",
            lambda: hold_connections(edge, counts["half_open"], 15, half_body),
            counts["half_open"],
            None,
        ),
        (
            "unwritten gRPC streams",
            lambda: unwritten_streams(edge, counts["half_open"], 15),
            counts["half_open"],
            None,
        ),
    ]
    for name, attack, total, closes_within in runs:
        async with probing(edge, request) as probe:
            held = await attack()
        ok = probe.codes["OK"] > 0 and probe.success() == 1.0
        if closes_within is not None and isinstance(held, Held):
            ok = ok and held.still_open() == 0 and held.refused == 0
            ok = ok and max(held.closed_after_s, default=0) <= closes_within + 3
        fine &= ok
        rows.append([*abuse_row(name, held, total, probe), "yes" if ok else "NO"])
    return rows, fine


def image_repository(source: Path, target: Path) -> Path:
    """A repository of links to the image models of ``source`` (no LLM to start)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in IMAGE_MODELS:
        (target / name).symlink_to(source.expanduser() / name, target_is_directory=True)
    return target
