"""Client side of every hop: pools of grpc.aio channels to one target.

One HTTP/2 connection caps throughput under load, so callers keep a few
channels per target and spread calls over them; each carries the trace
context through the shared client interceptors.
"""

from __future__ import annotations

import grpc
from opentelemetry import trace

from shared.interceptors import client_interceptors


def open_channels(
    target: str, count: int, max_message_bytes: int, tracer: trace.Tracer
) -> list[grpc.aio.Channel]:
    """``count`` channels to ``target``, each on its own connection (call in a loop)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Without a local subchannel pool, channels to one target share one
        # connection, which is exactly what the pool is meant to avoid.
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    return [
        grpc.aio.insecure_channel(target, options=options, interceptors=client_interceptors(tracer))
        for _ in range(count)
    ]
