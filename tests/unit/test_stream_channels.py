"""Which client carries the orchestrator's streams of forwarded requests
(shared.channels.open_stream_channels): the asyncio one for a plain host:port,
grpc.aio's for anything grpc's own resolvers must read, or when asked."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace

from shared.channels import open_stream_channels
from shared.h2grpc.client import LeanChannel

LIMIT = 4 * 1024 * 1024


@pytest.mark.parametrize(
    ("target", "lean"),
    [
        ("127.0.0.1:8001", True),
        ("[::1]:8001", True),
        ("inference.mesh.svc:8001", True),
        ("dns:///inference.mesh.svc:8001", False),
        ("unix:///run/stage.sock", False),
        ("stage:notaport", False),
    ],
)
def test_a_plain_host_and_port_gets_the_asyncio_client(target: str, lean: bool) -> None:
    async def opened() -> list[object]:
        channels = open_stream_channels(target, 2, LIMIT, trace.get_tracer("test"))
        for channel in channels:
            await channel.close()
        return list(channels)

    channels = asyncio.run(opened())
    assert len(channels) == 2
    kind = LeanChannel if lean else grpc.aio.Channel
    assert all(isinstance(channel, kind) for channel in channels)


def test_grpcio_when_asked() -> None:
    async def opened() -> list[object]:
        channels = open_stream_channels("127.0.0.1:1", 1, LIMIT, trace.get_tracer("t"), lean=False)
        await channels[0].close()
        return list(channels)

    assert isinstance(asyncio.run(opened())[0], grpc.aio.Channel)
