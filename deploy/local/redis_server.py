"""The batch job queue of the local mesh: Redis on loopback, and the batch workers.

Run by the supervisor as a service process like any other (so it is restarted
when it dies and stopped with the mesh)::

    python -m deploy.local.redis_server --grpc-port PORT --jobs-dir DIR

It runs Debian's ``redis-server`` on ``127.0.0.1:PORT`` with append-only-file
persistence (fsync every second) in ``DIR/redis``, prints ``MESHSERVE_READY``
once Redis answers, and on SIGTERM lets Redis write its AOF and exit.

``plan_jobs`` says which processes the supervisor adds (mesh YAML
``supervisor.jobs``) and the environment that points the HTTP adapter and the
workers at the queue (``MESHSERVE_REDIS_URL``, ``MESHSERVE_JOBS_DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.local.service_process import ProcessSpec
from shared.ports import free_port

REDIS_BINARY = "redis-server"
DEFAULT_WORKERS = 1


@dataclass(frozen=True)
class JobsPlan:
    """The queue's processes and the environment that finds it."""

    redis: list[ProcessSpec] = field(default_factory=list)
    workers: list[ProcessSpec] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)


def plan_jobs(
    mesh: Mapping[str, Any],
    auto_ports: bool,
    orchestrator: str,
    fresh_port: Callable[[], int],
) -> JobsPlan:
    """Redis and the workers, when ``supervisor.jobs.enabled`` says so (default: off);
    with ``auto_ports``, their ports from ``fresh_port`` (the plan's: never one of its
    other ports)."""
    services = mesh.get("services") or {}

    def ports(service: str) -> tuple[int, int]:
        if auto_ports:
            return fresh_port(), fresh_port()
        settings = services.get(service) or {}
        return int(settings.get("grpc_port", 0)), int(settings.get("metrics_port", -1))

    jobs = (mesh.get("supervisor") or {}).get("jobs") or {}
    enabled = jobs.get("enabled", False)
    # auto: a mesh on its configured ports, with redis-server installed. A mesh on
    # --ports auto (tests, trials) would share the jobs folder of the user's own
    # mesh: it runs jobs only when told to (enabled: true, best with its own dir).
    usable = shutil.which(REDIS_BINARY) is not None and not auto_ports
    if enabled is not True and not (enabled == "auto" and usable):
        return JobsPlan()
    cache = Path(os.environ.get("MESHSERVE_CACHE", Path.home() / ".cache" / "meshserve"))
    directory = Path(str(jobs.get("dir") or cache / "jobs")).expanduser().resolve()
    redis_port, _ = ports("redis")
    url = f"redis://127.0.0.1:{redis_port}/0"
    redis = ProcessSpec(
        "redis",
        "redis",
        "deploy.local.redis_server",
        redis_port,
        -1,
        ("--jobs-dir", str(directory)),
    )
    workers = []
    for index in range(int(jobs.get("workers", DEFAULT_WORKERS))):
        _, metrics = ports("batch")
        metrics = metrics + index if metrics > 0 else metrics
        workers.append(
            ProcessSpec(
                f"batch-{index}",
                "batch",
                "services.batch.main",
                0,
                metrics,
                ("--orchestrator", orchestrator, "--worker-name", f"batch-{index}"),
            )
        )
    environment = {"MESHSERVE_REDIS_URL": url, "MESHSERVE_JOBS_DIR": str(directory)}
    return JobsPlan([redis], workers, environment)


def redis_command(port: int, directory: Path) -> list[str]:
    """``redis-server`` on loopback with the AOF in ``directory``."""
    return [
        REDIS_BINARY,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--protected-mode", "yes",
        "--daemonize", "no",
        "--loglevel", "warning",
    ]  # fmt: skip


async def _answers(port: int, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"PING\r\n")
            await writer.drain()
            reply = await reader.readline()
            writer.close()
            if reply.startswith(b"+PONG"):
                return True
        except OSError:
            pass
        await asyncio.sleep(0.05)
    return False


async def run(port: int, directory: Path) -> int:
    """Run Redis until SIGTERM; its exit status."""
    redis_dir = directory / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    lock = (redis_dir / "meshserve.lock").open("w")
    try:
        # Two Redis servers appending to one AOF would corrupt it.
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another mesh's Redis uses {redis_dir}: give this mesh its own "
              "supervisor.jobs.dir", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    port = port or free_port()
    proc = await asyncio.create_subprocess_exec(*redis_command(port, redis_dir))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, proc.terminate)
    # Loading a large AOF takes a while: give it time before calling Redis dead.
    if await _answers(port, 120.0):
        info = {
            "service": "redis",
            "grpc": f"127.0.0.1:{port}",
            "url": f"redis://127.0.0.1:{port}/0",
        }
        print(f"MESHSERVE_READY {json.dumps(info)}", flush=True)
    return await proc.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """Run Redis for the mesh (the flags every service process gets are accepted)."""
    parser = argparse.ArgumentParser(prog="meshserve-redis", description=__doc__)
    parser.add_argument("--grpc-port", type=int, default=0, help="Redis port (0: a free one)")
    parser.add_argument("--jobs-dir", type=Path, required=True, help="AOF under DIR/redis")
    parser.add_argument("--config", type=Path, help="ignored (the mesh YAML)")
    parser.add_argument("--metrics-port", type=int, help="ignored")
    args = parser.parse_args(argv)
    if shutil.which(REDIS_BINARY) is None:
        print(
            "redis-server is not installed (Debian: apt-get install redis-server)", file=sys.stderr
        )
        raise SystemExit(2)
    raise SystemExit(asyncio.run(run(args.grpc_port, args.jobs_dir)))


if __name__ == "__main__":
    main()
