"""Process entry glue shared by every service's ``main``: how the process runs,
logging and readiness.

Once a service is ready it prints one line ``MESHSERVE_READY {json}`` with its
bound ports on stdout; supervisors and tests read it to learn ports chosen
with port 0.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from shared import cpu_policy, event_loop
from shared.config import ServiceConfig
from shared.server import MeshServer, ServiceParts, serve, setup_logging

READY_MARKER = "MESHSERVE_READY"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], config: ServiceConfig) -> T:
    """Run ``main`` to its end, the process's threads under the service's CPU policy
    (shared/cpu_policy.py), on its event loop (shared/event_loop.py)."""
    cpu_policy.apply(config.cpu_policy)
    return event_loop.run(main, config.event_loop)


def announce(server: MeshServer) -> None:
    """Print the readiness line with the bound ports."""
    info = {
        "service": server.config.service_name,
        "grpc": server.address,
        "metrics_port": server.metrics_port if server.config.metrics_port >= 0 else None,
    }
    if server.wire_address is not None:
        info["wire"] = server.wire_address
    print(f"{READY_MARKER} {json.dumps(info)}", flush=True)


async def run_service(config: ServiceConfig, parts: ServiceParts) -> None:
    """Set up logging, serve, and announce readiness."""
    setup_logging(config.log_level, config.log_format, config.service_name)
    try:
        await serve(config, parts, on_ready=announce)
    except Exception as exc:
        print(f"{config.service_name}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from exc
