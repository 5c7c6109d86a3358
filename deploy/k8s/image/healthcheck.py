"""The image's health check: is the service in this container serving?

    python healthcheck.py [--port N]              # grpc.health.v1 Check, service ""
    python healthcheck.py --port N --http PATH    # GET PATH answers 200 (the HTTP adapter)

The port defaults to ``MESHSERVE_GRPC_PORT`` (else 8001, the orchestrator's).
With mutual TLS on (``MESHSERVE_MTLS_CERT``/``_KEY``/``_CA``) the check shows
the pod's own certificate, which Kubernetes' native gRPC and HTTP probes cannot
do: the mtls component runs this as an exec probe instead. Exit 0: serving.
"""

from __future__ import annotations

import argparse
import http.client
import os
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def _mtls() -> tuple[Path, Path, Path] | None:
    paths = [os.environ.get(f"MESHSERVE_MTLS_{part}") for part in ("CERT", "KEY", "CA")]
    if not all(paths):
        return None
    cert, key, ca = (Path(str(p)) for p in paths)
    return cert, key, ca


def check_grpc(port: int) -> bool:
    """grpc.health.v1 says SERVING for the whole server."""
    target = f"127.0.0.1:{port}"
    mtls = _mtls()
    if mtls is None:
        channel = grpc.insecure_channel(target)
    else:
        cert, key, ca = (path.read_bytes() for path in mtls)
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
        name = os.environ.get("MESHSERVE_MTLS_SERVER_NAME") or "localhost"
        options = [("grpc.ssl_target_name_override", name)]
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        reply = stub.Check(request, timeout=TIMEOUT_S)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def check_http(port: int, path: str) -> bool:
    """GET ``path`` answers 200 (over TLS with this pod's certificate under mutual TLS)."""
    mtls = _mtls()
    if mtls is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    else:
        cert, key, ca = mtls
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))
        # The peer is this pod's own process on loopback; the CA check is what counts.
        context.check_hostname = False
        connection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=TIMEOUT_S, context=context
        )
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    finally:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the local service is serving, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("MESHSERVE_GRPC_PORT", "8001"))
    )
    parser.add_argument("--http", metavar="PATH", help="check an HTTP path instead of gRPC health")
    args = parser.parse_args(argv)
    try:
        serving = check_http(args.port, args.http) if args.http else check_grpc(args.port)
    except (grpc.RpcError, OSError) as exc:
        print(f"health check on port {args.port} failed: {exc}", file=sys.stderr)
        return 1
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
