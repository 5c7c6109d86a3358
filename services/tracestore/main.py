"""The trace store: OTLP in (gRPC and HTTP), spans in SQLite, Jaeger's query API out.

``python -m services.tracestore.main [--grpc-port 4317] [--otlp-http-port 4318]
[--http-port 16686] [--database FILE] [--max-age-s S] [--max-bytes N]``

It traces nothing of its own: its spans would come back to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from services.tracestore.config import SERVICE, TraceStoreConfig
from services.tracestore.query import json_errors, query_routes
from services.tracestore.receiver import Intake, OtlpTraceService, otlp_http_routes
from services.tracestore.store import Limits, TraceStore
from shared import launch
from shared.config import load_config
from shared.launch import READY_MARKER
from shared.server import setup_logging

log = logging.getLogger(__name__)


async def _prune(store: TraceStore, every_s: float) -> None:
    """Apply the age and size bounds every ``every_s`` seconds."""
    while True:
        await asyncio.sleep(every_s)
        dropped = await store.run(store.prune)
        if dropped:
            log.info("dropped %d trace(s) past the store's age or size bound", dropped)


async def _site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, int(runner.addresses[0][1])


async def serve(config: TraceStoreConfig, folder: Path) -> None:
    """Receive, keep and answer for spans until SIGTERM or SIGINT."""
    path = config.database or folder / "traces.sqlite"
    store = TraceStore(path, Limits(config.max_age_s, config.max_bytes))
    intake = Intake(store, config.forward_endpoint)
    server = grpc.aio.server()
    service = OtlpTraceService(intake)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    grpc_port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    otlp_app = web.Application(middlewares=[json_errors], client_max_size=32 * 1024 * 1024)
    otlp_app.add_routes(otlp_http_routes(intake))
    query_app = web.Application(middlewares=[json_errors])
    query_app.add_routes(query_routes(store))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    pruning = asyncio.create_task(_prune(store, config.prune_interval_s))
    try:
        await server.start()
        otlp_runner, otlp_http_port = await _site(otlp_app, config.host, config.otlp_http_port)
        runners.append(otlp_runner)
        query_runner, http_port = await _site(query_app, config.host, config.http_port)
        runners.append(query_runner)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        info = {
            "service": SERVICE,
            "grpc": f"{config.host}:{grpc_port}",
            "otlp_http": f"http://{config.host}:{otlp_http_port}/v1/traces",
            "http": f"{config.host}:{http_port}",
        }
        print(f"{READY_MARKER} {json.dumps(info)}", flush=True)
        log.info(
            "trace store: OTLP on %s and %s, traces on http://%s/traces (%s)",
            info["grpc"],
            info["otlp_http"],
            info["http"],
            path,
        )
        await stop.wait()
    finally:
        pruning.cancel()
        await asyncio.gather(pruning, return_exceptions=True)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(1.0)
        for runner in runners:
            await runner.cleanup()
        await intake.close()
        store.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and serve until SIGTERM."""
    config = load_config(TraceStoreConfig, argv, service=SERVICE)
    setup_logging(config.log_level, config.log_format, config.service_name)
    try:
        with tempfile.TemporaryDirectory(prefix="meshserve-traces-") as folder:
            launch.run(serve(config, Path(folder)), config)
    except OSError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
