"""What one hop costs on this host: a lone message vs one that follows another.

    python loadtests/bench_hops.py [--probes 40] [--gap 0.3]

A lone chat request crosses the mesh one hop at a time, and each process it
reaches has sat idle since the last request. Where waking an idle thread is
dear (a small VM), a hop then costs much more than under load, and the mesh's
added time to first token is mostly that: through Envoy, a chat's first token
crosses eight one-way gRPC hops more than in vLLM's own server (one more each
way through Envoy, and the orchestrator's trips to the tokenizer, the
inference stage and the detokenizer and back), plus each stage's own Python.

Round trips on a connection already open, each measured back to back ("warm")
and after ``--gap`` seconds of idleness ("lone"), all in one process tree:

- ``tcp``: an asyncio TCP echo server; the kernel and one event loop on each
  side, the floor of any hop written in Python;
- ``grpc``: a bare grpc.aio bidirectional-stream echo; gRPC's own threads
  (its event engine, the completion-queue poller) hand each message over;
- ``tokenizer``: the real tokenizer stage answering one chat on a
  ModelStreamInfer stream, as the orchestrator's first step does (needs the
  default repository: ``python -m models.prepare``).

It prints p50s and the ratios lone / warm and lone / the TCP floor's lone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from common import DEFAULT_REPOSITORY, ROOT, format_table, load_average, missing_models

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs

RoundTrip = Callable[[], Awaitable[None]]
"""One message out and its answer back, on an open connection."""

_PAYLOAD = b"x" * 200
_ECHO_METHOD = "/bench.Echo/Stream"
_CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@dataclass(frozen=True)
class Settings:
    """What to measure."""

    probes: int
    """Round trips measured per target and mode."""
    gap_s: float
    """Idle time before each lone round trip."""
    repository: Path
    """The model repository holding ``smollm2_tokenizer``."""


@dataclass(frozen=True)
class HopResult:
    """Round-trip p50s of one target, warm and lone, in ms."""

    target: str
    warm_ms: float
    lone_ms: float


# -- echo servers (each in its own spawned process) ----------------------------


def _serve_tcp(ports: Queue[int]) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)

    async def run() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(run())


def _serve_grpc(ports: Queue[int]) -> None:
    async def echo(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    async def run() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(echo)
        service, method = _ECHO_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


@contextlib.contextmanager
def spawned(serve: Callable[[Queue[int]], None]) -> Iterator[int]:
    """Run ``serve`` in a spawned process (no gRPC state forked); yields its port."""
    context = multiprocessing.get_context("spawn")
    ports: Queue[int] = context.Queue()
    process = context.Process(target=serve, args=(ports,), daemon=True)
    process.start()
    try:
        yield ports.get(timeout=30)
    finally:
        process.terminate()
        process.join(timeout=10)


# -- clients --------------------------------------------------------------------


async def tcp_round_trip(port: int) -> RoundTrip:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def once() -> None:
        writer.write(_PAYLOAD)
        received = 0
        while received < len(_PAYLOAD):
            received += len(await reader.read(4096))

    return once


def grpc_round_trip(channel: grpc.aio.Channel) -> RoundTrip:
    call = channel.stream_stream(_ECHO_METHOD)()

    async def once() -> None:
        await call.write(_PAYLOAD)
        await call.read()

    return once


def tokenizer_round_trip(channel: grpc.aio.Channel) -> RoundTrip:
    request = pb.ModelInferRequest(model_name="smollm2_tokenizer")
    encode_inputs(request, {"MESSAGES": np.array([json.dumps(_CHAT).encode()], dtype=object)})
    call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()  # type: ignore[no-untyped-call]

    async def once() -> None:
        await call.write(request)
        answer = await call.read()
        if answer.error_message:
            raise RuntimeError(f"tokenizer: {answer.error_message}")

    return once


# -- measuring --------------------------------------------------------------------


async def measure(target: str, once: RoundTrip, settings: Settings) -> HopResult:
    """p50 of ``probes`` round trips back to back, then of as many after ``gap_s`` idle."""
    for _ in range(20):
        await once()
    warm = [await _timed(once) for _ in range(settings.probes)]
    lone = []
    for _ in range(settings.probes):
        await asyncio.sleep(settings.gap_s)
        lone.append(await _timed(once))
    return HopResult(target, statistics.median(warm), statistics.median(lone))


async def _timed(once: RoundTrip) -> float:
    started = time.perf_counter()
    await once()
    return (time.perf_counter() - started) * 1000


async def run_all(
    settings: Settings, tcp_port: int, grpc_port: int, stage: str | None
) -> list[HopResult]:
    results = [await measure("tcp", await tcp_round_trip(tcp_port), settings)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        results.append(await measure("grpc", grpc_round_trip(channel), settings))
    if stage is not None:
        async with grpc.aio.insecure_channel(stage) as channel:
            results.append(await measure("tokenizer", tokenizer_round_trip(channel), settings))
    return results


@contextlib.contextmanager
def tokenizer_stage(repository: Path) -> Iterator[str | None]:
    """The tokenizer service on ``repository``; None (and a note) when it lacks the model."""
    if missing_models(repository, ["smollm2_tokenizer"]):
        print(f"no smollm2_tokenizer in {repository}: run `python -m models.prepare` first")
        yield None
        return
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/ is beside the installed packages, not in them
    from tests.harness import ServiceProcess

    service = ServiceProcess("services.tokenizer.main", ["--model-repository", str(repository)])
    try:
        yield service.address
    finally:
        service.stop()
        service.log_path.unlink(missing_ok=True)


def report(results: Sequence[HopResult], settings: Settings) -> str:
    floor = results[0].lone_ms
    rows = [
        [
            r.target,
            f"{r.warm_ms:.3f}",
            f"{r.lone_ms:.3f}",
            f"{r.lone_ms / r.warm_ms:.2f}x",
            f"{r.lone_ms / floor:.2f}x",
        ]
        for r in results
    ]
    headers = ["target", "warm p50 ms", "lone p50 ms", "lone/warm", "lone vs tcp"]
    title = (
        f"round trips on an open connection, {settings.probes} per mode; "
        f"lone = after {settings.gap_s:g} s idle"
    )
    return title + "\n" + format_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=40, help="round trips per target and mode")
    parser.add_argument("--gap", type=float, default=0.3, help="idle seconds before a lone one")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    args = parser.parse_args(argv)
    if args.probes < 1 or args.gap < 0:
        parser.error("--probes must be at least 1 and --gap not negative")
    return Settings(args.probes, args.gap, args.repository.expanduser())


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    print(f"load average before: {load_average()}")
    with (
        spawned(_serve_tcp) as tcp_port,
        spawned(_serve_grpc) as grpc_port,
        tokenizer_stage(settings.repository) as stage,
    ):
        results = asyncio.run(run_all(settings, tcp_port, grpc_port, stage))
    print(report(results, settings))
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
