"""The closed loop's blocking gRPC client (loadtests/grpc_connection.py) against a real
grpc.aio server on port 0: several calls at once on one connection, and what the
server may do to them (fail a call, cap the streams, send more than a window,
go away)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from loadtests.common import GrpcTarget, LoadResult, LoadSettings, closed_loop
from loadtests.grpc_connection import GrpcConnection, Outcome

SERVICE, METHOD = "test.Echo", "/test.Echo/Call"
LOAD = LoadSettings(seconds=1.0, warmup_s=0.3, settle_s=0.0)


@dataclass
class Served:
    """What the server saw."""

    calls: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    peers: set[str] = field(default_factory=set)
    user_agents: set[str] = field(default_factory=set)
    request_sizes: set[int] = field(default_factory=set)


Handler = Callable[[bytes, Any], Awaitable[bytes]]


def counting(served: Served, answer: Handler) -> Handler:
    """``answer``, with every call counted in ``served``."""

    async def handle(request: bytes, context: Any) -> bytes:
        served.in_flight += 1
        served.most_in_flight = max(served.most_in_flight, served.in_flight)
        served.peers.add(context.peer())
        served.request_sizes.add(len(request))
        metadata = dict(context.invocation_metadata())
        served.user_agents.add(str(metadata.get("user-agent", "")))
        try:
            return await answer(request, context)
        finally:
            served.in_flight -= 1
            served.calls += 1

    return handle


def after(seconds: float, reply: bytes = b"ok") -> Handler:
    """A handler that answers ``reply`` after ``seconds``."""

    async def answer(_request: bytes, _context: Any) -> bytes:
        await asyncio.sleep(seconds)
        return reply

    return answer


@contextlib.asynccontextmanager
async def serving(
    handler: Handler, options: Sequence[tuple[str, Any]] = ()
) -> AsyncIterator[tuple[grpc.aio.Server, int]]:
    """A grpc.aio server of ``handler`` (bytes in, bytes out) on a free port."""
    server = grpc.aio.server(options=list(options))
    method = grpc.unary_unary_rpc_method_handler(handler)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Call": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(None)


def run_for(connection: GrpcConnection, streams: int, seconds: float) -> list[Outcome]:
    """How every call ended of ``streams`` at once on one connection for ``seconds``."""
    deadline = time.monotonic() + seconds
    return list(connection.run(streams, lambda: time.monotonic() > deadline))


async def load(
    port: int,
    in_flight: int,
    connections: int,
    payload: bytes = b"x",
    settings: LoadSettings = LOAD,
) -> LoadResult:
    """The closed loop over a GrpcTarget of ``connections``, as the benchmarks run it."""
    target = GrpcTarget(f"127.0.0.1:{port}", METHOD, payload, connections)
    try:
        return await closed_loop("test", target.calls(), in_flight, {}, settings)
    finally:
        await target.close()


def test_sixteen_in_flight_share_four_connections_on_the_lean_client() -> None:
    async def scenario() -> None:
        served = Served()
        async with serving(counting(served, after(0.02))) as (_server, port):
            result = await load(port, in_flight=16, connections=4)
        assert result.errors == 0
        assert result.completed > 100
        assert served.calls == result.total  # every call the server answered was counted
        assert len(served.peers) == 4
        assert served.most_in_flight == 16
        assert served.user_agents == {""}  # not grpc.aio's channels: they name themselves

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(("in_flight", "connections"), [(4, 4), (16, 4)])
def test_client_work_is_spent_between_an_answer_and_the_next_request(
    in_flight: int, connections: int
) -> None:
    # (4, 4): a thread per call; (16, 4): a thread per connection with four calls on it.
    work = dataclasses.replace(LOAD, client_work_us=2000.0)

    async def scenario() -> None:
        async with serving(after(0.0)) as (_server, port):
            result = await load(port, in_flight, connections, settings=work)
        assert result.errors == 0
        assert result.completed > 50
        # The work holds the GIL: at most one worker's 2 ms at a time.
        assert result.rate < 550
        assert result.client_cpu_ms() > 1.5

    asyncio.run(scenario())


def test_a_failed_status_is_counted_as_an_error_and_the_load_goes_on() -> None:
    async def sometimes(_request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.002)
        if time.monotonic_ns() % 3 == 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try later")
        return b"ok"

    async def scenario() -> None:
        async with serving(sometimes) as (_server, port):
            result = await load(port, in_flight=8, connections=2)
        assert result.errors > 0
        assert result.completed > 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_server_allowing_fewer_streams_than_asked_still_serves_every_call() -> None:
    async def scenario() -> None:
        served = Served()
        options = [("grpc.max_concurrent_streams", 2)]
        async with serving(counting(served, after(0.005)), options) as (_server, port):
            connection = GrpcConnection("127.0.0.1", port, METHOD, b"x")
            outcomes = await asyncio.to_thread(run_for, connection, 8, 1.0)
        assert outcomes and all(isinstance(outcome, int) for outcome in outcomes)
        assert served.calls == len(outcomes)
        assert served.most_in_flight <= 2

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_requests_and_answers_larger_than_the_flow_control_windows() -> None:
    request, answer = bytes(600_000), bytes(2_000_000)

    async def scenario() -> None:
        served = Served()
        async with serving(counting(served, after(0.0, answer))) as (_server, port):
            connection = GrpcConnection("127.0.0.1", port, METHOD, request)
            outcomes = await asyncio.to_thread(run_for, connection, 4, 1.0)
            await asyncio.to_thread(connection.call)  # one at a time, too
            connection.close()
        assert len(outcomes) >= 4
        assert all(isinstance(outcome, int) for outcome in outcomes)
        assert served.calls == len(outcomes) + 1
        assert served.request_sizes == {len(request)}

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_server_that_sends_goaway_is_left_for_a_new_connection_without_errors() -> None:
    async def scenario() -> None:
        served = Served()
        options = [("grpc.max_connection_age_ms", 200), ("grpc.max_connection_age_grace_ms", 5000)]
        async with serving(counting(served, after(0.002)), options) as (_server, port):
            connection = GrpcConnection("127.0.0.1", port, METHOD, b"x")
            outcomes = await asyncio.to_thread(run_for, connection, 4, 1.5)
        assert [o for o in outcomes if isinstance(o, Exception)] == []
        assert served.calls == len(outcomes)
        assert len(served.peers) > 1

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_server_that_stops_fails_the_calls_and_the_load_still_ends() -> None:
    async def scenario() -> None:
        async with serving(after(0.005)) as (server, port):
            stopping = asyncio.create_task(stop_later(server, LOAD.warmup_s + 0.4))
            result = await load(port, in_flight=8, connections=2)
            await stopping
        assert result.completed > 0
        assert result.errors > 0

    async def stop_later(server: grpc.aio.Server, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_one_call_at_a_time_raises_on_a_failed_status() -> None:
    async def refuse(_request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        return b""

    async def scenario() -> None:
        async with serving(refuse) as (_server, port):
            connection = GrpcConnection("127.0.0.1", port, METHOD, b"x")
            with pytest.raises(RuntimeError, match="gRPC status b'8'"):
                await asyncio.to_thread(connection.call)
            with pytest.raises(RuntimeError, match="full"):  # the same connection goes on
                await asyncio.to_thread(connection.call)
            connection.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
