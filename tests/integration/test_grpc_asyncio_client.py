"""The gRPC client on asyncio (shared/h2grpc/client.py) against grpc's own server
and the project's: stream calls, metadata, statuses, flow control, limits,
cancels, and servers that go away.

The orchestrator's forwarding streams ride it (the rest of the suite tests
that); here the client alone, against real servers on port 0, in this event loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from shared.h2grpc.client import LeanChannel, StreamCall
from shared.h2grpc.server import LeanServer
from tests.echo_service import LIMIT, SERVICE, Handlers

SERVERS = ("asyncio", "grpcio")


@dataclass
class Served:
    server: Any
    handlers: Handlers
    channel: LeanChannel
    target: str


Scenario = Callable[[Served], Awaitable[None]]


async def _serve(kind: str, scenario: Scenario) -> None:
    handlers = Handlers()
    if kind == "asyncio":
        server: Any = LeanServer(max_message_bytes=LIMIT)
    else:
        limits = [("grpc.max_receive_message_length", LIMIT)]
        server = grpc.aio.server(options=[*limits, ("grpc.max_send_message_length", LIMIT)])
    server.add_generic_rpc_handlers((handlers.generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    channel = LeanChannel(target, LIMIT)
    try:
        await scenario(Served(server, handlers, channel, target))
    finally:
        await channel.close()
        await server.stop(0)


def serving(scenario: Scenario) -> Callable[[str], None]:
    """A test running ``scenario`` against each kind of server, in a loop of its own."""

    @pytest.mark.parametrize("kind", SERVERS)
    def test(kind: str) -> None:
        asyncio.run(asyncio.wait_for(_serve(kind, scenario), 30))

    test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
    return test


def _call(channel: LeanChannel, name: str = "Tagged", **kwargs: Any) -> StreamCall:
    return channel.stream_stream(f"/{SERVICE}/{name}")(**kwargs)


@serving
async def test_a_stream_call_with_metadata_both_ways(served: Served) -> None:
    call = _call(served.channel, metadata=(("x-caller", "me"), ("x-id-bin", "\x01")))
    assert ("x-initial", "yes") in await call.initial_metadata()
    for message in (b"abc", b"", b"xyz"):
        await call.write(message)
        assert await call.read() == message[::-1]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert call.done()
    sent = served.handlers.metadata
    assert sent["x-caller"] == "me" and sent["x-id-bin"] == b"\x01"


@serving
async def test_calls_share_one_connection_and_iterate(served: Served) -> None:
    async def one(index: int) -> list[bytes]:
        call = _call(served.channel)
        for part in range(3):
            await call.write(b"%d-%d" % (index, part))
        await call.done_writing()
        return [message async for message in call]

    answers = await asyncio.gather(*(one(index) for index in range(20)))
    assert answers == [[(b"%d-%d" % (i, p))[::-1] for p in range(3)] for i in range(20)]


@serving
async def test_large_messages_cross_flow_control_windows(served: Served) -> None:
    big = bytes(range(256)) * 12_000  # 3 MB each way, far past the 64 KB default windows
    call = _call(served.channel)
    for _ in range(3):
        await call.write(big)
    await call.done_writing()
    answers = [message async for message in call]
    assert answers == [big[::-1]] * 3


@serving
async def test_an_abort_ends_the_call_with_its_code_and_message(served: Served) -> None:
    call = _call(served.channel)
    await call.write(b"ok")
    assert await call.read() == b"ko"
    await call.write(b"fail")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.value.details() == "tensor 'x' is bad: 100%"
    with pytest.raises(grpc.aio.AioRpcError):  # a write after the end says why it ended
        await call.write(b"more")


@serving
async def test_an_unknown_method_is_unimplemented(served: Served) -> None:
    call = _call(served.channel, "NoSuchMethod")
    await call.write(b"x")
    assert await call.initial_metadata() == ()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


@serving
async def test_a_cancel_reaches_the_server_and_the_caller(served: Served) -> None:
    call = _call(served.channel)
    await call.write(b"hang")
    await asyncio.sleep(0.1)
    assert call.cancel()
    await asyncio.wait_for(served.handlers.cancelled.wait(), 5)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.CANCELLED
    assert not call.cancel()  # ended already
    # The connection serves the next call.
    again = _call(served.channel)
    await again.write(b"on")
    assert await again.read() == b"no"
    again.cancel()


@serving
async def test_an_answer_over_the_limit_is_resource_exhausted(served: Served) -> None:
    small = LeanChannel(served.target, 1024)
    try:
        call = small.stream_stream(f"/{SERVICE}/Tagged")()
        await call.write(b"x" * 4096)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.read()
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4096" in failed.value.details()
    finally:
        await small.close()


@serving
async def test_a_server_that_stops_fails_its_calls_unavailable_then_comes_back(
    served: Served,
) -> None:
    call = _call(served.channel)
    await call.write(b"hang")
    await asyncio.sleep(0.1)
    await served.server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    refused = _call(served.channel)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await refused.write(b"x")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert served.target in failed.value.details()


def test_nothing_listening_is_unavailable_at_once() -> None:
    async def scenario() -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            target = f"127.0.0.1:{holder.getsockname()[1]}"  # bound, never listening
            channel = LeanChannel(target, LIMIT)
            call = channel.stream_stream(f"/{SERVICE}/Tagged")()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call.initial_metadata()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert target in failed.value.details()
            await channel.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_graceful_stop_lets_calls_in_flight_finish_and_sends_new_ones_away() -> None:
    async def scenario() -> None:
        handlers = Handlers()
        server = LeanServer(max_message_bytes=LIMIT)
        server.add_generic_rpc_handlers((handlers.generic(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = LeanChannel(f"127.0.0.1:{port}", LIMIT)
        try:
            call = _call(channel)
            await call.write(b"abc")
            assert await call.read() == b"cba"
            stopping = asyncio.create_task(server.stop(5))
            await asyncio.sleep(0.1)  # the GOAWAY is in
            await call.write(b"def")  # the call it kept goes on
            assert await call.read() == b"fed"
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            late = _call(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await late.write(b"x")
                await late.read()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            await stopping
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 20))
