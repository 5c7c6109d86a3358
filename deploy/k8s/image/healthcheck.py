"""The image's HEALTHCHECK: grpc.health.v1 Check on this container's gRPC port.

The port is ``MESHSERVE_GRPC_PORT`` (default 8001, the orchestrator's); exit 0
when the server answers SERVING. Kubernetes uses its native gRPC probes instead.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    """Exit status 0 when the local service is SERVING, 1 otherwise."""
    port = os.environ.get("MESHSERVE_GRPC_PORT", "8001")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError as exc:
            print(f"health check on port {port} failed: {exc}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
