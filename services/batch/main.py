"""The batch worker service: runs the lines of queued jobs through the orchestrator.

``python -m services.batch.main --orchestrator 127.0.0.1:8001 --redis-url redis://...
--jobs-dir DIR [--worker-name batch-0]``

Several workers share the queue (each under its own ``worker_name``; a
restarted one keeps its name and so takes up the lines it held). When ready it
prints ``MESHSERVE_READY {json}`` like every service, its metrics address
under ``grpc`` (it serves no gRPC). On SIGTERM it claims no more lines and
gives the ones running ``grace_period_s`` to finish; the rest stay claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import Field

from services.batch.runner import LineRunner
from services.batch.store import JobStore
from services.batch.worker import Worker, WorkerMetrics
from shared import launch
from shared.channels import open_channels, use_mesh_tls
from shared.config import ServiceConfig, load_config
from shared.launch import READY_MARKER
from shared.metrics_http import start_metrics_server
from shared.mtls import MeshTls
from shared.server import setup_logging
from shared.tracing import make_tracer_provider, tracer_for

log = logging.getLogger(__name__)

SERVICE = "batch"


class BatchConfig(ServiceConfig):
    """Settings of a batch worker (also read by the HTTP adapter's /v1/batches)."""

    orchestrator: str = Field("127.0.0.1:8001", pattern=r"^\S+:\d{1,5}$")
    """The orchestrator's gRPC address (host:port)."""
    redis_url: str = Field("redis://127.0.0.1:8009/0", pattern=r"^rediss?://")
    """The job queue's Redis (env MESHSERVE_REDIS_URL)."""
    jobs_dir: Path = Path("~/.cache/meshserve/jobs")
    """Where input and result files are kept (env MESHSERVE_JOBS_DIR)."""
    worker_name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128)
    """This worker's consumer name in the queue: unique per worker, kept across restarts."""
    concurrency: int = Field(4, ge=1, le=256)
    """Lines this worker runs at once."""
    priority: int = Field(2, ge=0, le=1000)
    """Priority level of v2 lines (1 is the highest; 0: the model's default)."""
    claim_idle_s: float = Field(30.0, ge=1.0, le=3600.0)
    """A line claimed and not touched this long (its worker died) is taken over."""
    retention_s: int = Field(7 * 86400, ge=60, le=365 * 86400)
    """Files and finished jobs are removed this long after they were created."""
    request_timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """Deadline of one line's call to the orchestrator."""


def open_store(config: BatchConfig) -> JobStore:
    """The job store that ``config`` names."""
    return JobStore(config.redis_url, config.jobs_dir.expanduser(), config.retention_s)


async def serve(config: BatchConfig) -> None:
    """Run the worker until SIGTERM or SIGINT."""
    registry = CollectorRegistry()
    store = open_store(config)
    # The channel every front door opens: the trace context travels with each
    # line's call, and under mutual TLS the worker shows the mesh certificate.
    provider = make_tracer_provider(
        config.service_name, config.otlp_endpoint, sample_ratio=config.trace_sample_ratio
    )
    use_mesh_tls(MeshTls.from_config(config))
    (channel,) = open_channels(
        config.orchestrator, 1, config.max_message_bytes, tracer_for(provider, "meshserve.batch")
    )
    runner = LineRunner(channel, config.priority, config.request_timeout_s)
    worker = Worker(
        store, runner, config.worker_name, config.concurrency, config.claim_idle_s,
        WorkerMetrics(registry),
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    metrics = None
    if config.metrics_port >= 0:
        metrics = start_metrics_server(config.host, config.metrics_port, registry)
    await store.redis.ping()
    port = metrics.server_address[1] if metrics else 0
    info = {"service": config.service_name, "grpc": f"{config.host}:{port}", "metrics_port": port}
    print(f"{READY_MARKER} {json.dumps(info)}", flush=True)
    log.info(
        "batch worker %s: queue %s -> %s", config.worker_name, config.redis_url, config.orchestrator
    )
    work = asyncio.create_task(worker.run())
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        worker.stop()
    finally:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(work, config.grace_period_s)
        await channel.close()
        await store.close()
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the config once and work until SIGTERM."""
    config = load_config(BatchConfig, argv, service=SERVICE)
    setup_logging(config.log_level, config.log_format, SERVICE)
    launch.run(serve(config), config)


if __name__ == "__main__":
    main(sys.argv[1:])
