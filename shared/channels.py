"""Client side of every hop: pools of grpc.aio channels to one target.

One HTTP/2 connection caps throughput under load, so callers keep a few
channels per target and spread calls over them; each carries the trace
context through the shared client interceptors. The streams that carry
forwarded requests (which bring their own trace context) go on channels of the
event loop's own (``open_stream_channels``, shared/h2grpc/client.py) where the
hop is cleartext.

With mutual TLS configured (``shared.mtls``) every channel the process opens
shows the process's certificate and checks the peer's. A process has one
identity, so it is set once, by the server bootstrap or a service's ``main``
(``use_mesh_tls``), rather than threaded through every caller.
"""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import trace

from shared.h2grpc.client import LeanChannel
from shared.mtls import MeshTls
from shared.trace_interceptors import client_interceptors

RECONNECT_BACKOFF_MS = (250, 1000)
"""First and longest wait between attempts to reconnect to a peer that went away."""

_identity: list[MeshTls] = []
"""The process's mutual TLS identity, when it has one (at most one entry)."""


def use_mesh_tls(tls: MeshTls | None) -> None:
    """Open every later channel with ``tls`` (None: plaintext again)."""
    _identity[:] = [tls] if tls is not None else []


def mesh_tls() -> MeshTls | None:
    """The identity channels are opened with, if any."""
    return _identity[0] if _identity else None


def open_channels(
    target: str, count: int, max_message_bytes: int, tracer: trace.Tracer, *, traced: bool = True
) -> list[grpc.aio.Channel]:
    """``count`` channels to ``target``, each on its own connection (call in a loop).

    ``traced=False``: without the trace interceptors, for calls that never carry
    a trace (an intercepted stream routes every message it writes through a
    queue and a task of grpc's own)."""
    interceptors = client_interceptors(tracer) if traced else None
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Without a local subchannel pool, channels to one target share one
        # connection, which is exactly what the pool is meant to avoid.
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.keepalive_time_ms", 30_000),
        # A peer that restarted is back within seconds; gRPC's default backoff
        # (1 s growing 1.6x) would reconnect to it only after up to twice that.
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    tls = mesh_tls()
    if tls is None:
        return [
            grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
            for _ in range(count)
        ]
    credentials = tls.channel_credentials()
    return [
        grpc.aio.secure_channel(
            target,
            credentials,
            options=[*options, *tls.channel_options()],
            interceptors=interceptors,
        )
        for _ in range(count)
    ]


def open_stream_channels(
    target: str, count: int, max_message_bytes: int, tracer: trace.Tracer, lean: bool = True
) -> list[grpc.aio.Channel | LeanChannel]:
    """``count`` channels to ``target`` for stream calls on serialised messages
    that carry their own trace context: ``LeanChannel`` on a cleartext hop (with
    ``lean``), else grpc.aio's without the trace interceptors."""
    if lean and mesh_tls() is None and _host_and_port(target):
        return [LeanChannel(target, max_message_bytes) for _ in range(count)]
    return open_channels(target, count, max_message_bytes, tracer, traced=False)


def _host_and_port(target: str) -> bool:
    """Whether ``target`` is a plain ``host:port`` (a gRPC URI such as
    ``dns:///name:port`` or ``unix:path`` stays with grpc's resolvers)."""
    host, _, port = target.rpartition(":")
    return bool(host) and "/" not in host and port.isdigit()
