"""The gRPC server on asyncio (shared/h2grpc/) against grpc's own client: every
kind of call, flow control, deadlines, statuses, metadata, limits and stopping.

The services' own behaviour on it is what the rest of the suite tests (it is
the default server); here the server alone, on port 0, in this event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from shared.h2grpc import frames
from shared.h2grpc.connection import MAX_FRAME
from shared.h2grpc.server import LeanServer
from shared.hpack import HeaderDecoder, request_headers
from tests.echo_service import LIMIT, SERVICE, Handlers


@dataclass
class Served:
    server: LeanServer
    handlers: Handlers
    channel: grpc.aio.Channel
    port: int


Scenario = Callable[[Served], Awaitable[None]]


async def _serve(scenario: Scenario) -> None:
    handlers = Handlers()
    server = LeanServer(max_message_bytes=LIMIT)
    server.add_generic_rpc_handlers((handlers.generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await scenario(Served(server, handlers, channel, port))
    finally:
        await channel.close()
        await server.stop(0)


def serving(scenario: Scenario) -> Callable[[], None]:
    """A test running ``scenario`` against a fresh server, in an event loop of its own."""

    def test() -> None:
        asyncio.run(asyncio.wait_for(_serve(scenario), 30))

    # Not functools.wraps: pytest would read the scenario's argument as a fixture.
    test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
    return test


def _method(channel: grpc.aio.Channel, name: str) -> Any:
    return channel.unary_unary(f"/{SERVICE}/{name}")


@serving
async def test_unary_call_with_metadata_both_ways(served: Served) -> None:
    handlers, channel = served.handlers, served.channel
    sent = (("x-caller", "me"), ("x-id-bin", b"\x01"), ("x-tag", "a"), ("x-tag", "b"))
    call = _method(channel, "Echo")(b"hello", metadata=sent)
    assert await call == b"hello"
    assert ("x-initial", "yes") in tuple(await call.initial_metadata())
    trailing = dict(tuple(await call.trailing_metadata()))
    assert trailing["x-trailing"] == "done" and trailing["x-raw-bin"] == b"\x00\xff"
    assert handlers.metadata["x-caller"] == "me" and handlers.metadata["x-id-bin"] == b"\x01"
    assert [value for key, value in handlers.pairs if key == "x-tag"] == ["a", "b"]


@serving
async def test_large_messages_cross_flow_control_windows(served: Served) -> None:
    channel = served.channel
    big = bytes(range(256)) * 12_000  # 3 MB each way, far past the 64 KB default windows
    answers = await asyncio.gather(*(_method(channel, "Echo")(big) for _ in range(4)))
    assert all(answer == big for answer in answers)
    several_frames = bytes(range(256)) * 160  # 40 KB: in the window, over one frame
    assert await _method(channel, "Echo")(several_frames) == several_frames


@serving
async def test_many_calls_at_once_on_one_connection(served: Served) -> None:
    channel = served.channel
    answers = await asyncio.gather(*(_method(channel, "Echo")(b"%d" % i) for i in range(200)))
    assert answers == [b"%d" % i for i in range(200)]


@serving
async def test_every_kind_of_streaming_call(served: Served) -> None:
    channel = served.channel
    counted = [m async for m in channel.unary_stream(f"/{SERVICE}/Count")(b"4")]
    assert counted == [b"0", b"1", b"2", b"3"]
    written = [m async for m in channel.unary_stream(f"/{SERVICE}/Written")(b"w")]
    assert written == [b"w0", b"w1", b"w2"]

    async def parts() -> AsyncIterator[bytes]:
        for part in (b"a", b"b", b"c"):
            yield part

    assert await channel.stream_unary(f"/{SERVICE}/Join")(parts()) == b"abc"
    call = channel.stream_stream(f"/{SERVICE}/Reverse")()
    for message in (b"abc", b"xyz"):
        await call.write(message)
        assert await call.read() == message[::-1]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


@serving
async def test_an_abort_reaches_the_client_with_its_code_and_message(served: Served) -> None:
    channel = served.channel
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "Refuse")(b"")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "tensor 'x' is bad: ünïcode 100%"


@serving
async def test_an_unexpected_error_is_unknown_without_its_detail(served: Served) -> None:
    channel = served.channel
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "Crash")(b"")
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "secret" not in (caught.value.details() or "")
    assert await _method(channel, "Echo")(b"still serving") == b"still serving"


@serving
async def test_unknown_method_is_unimplemented(served: Served) -> None:
    channel = served.channel
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "Nothing")(b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


@serving
async def test_the_deadline_ends_the_handler(served: Served) -> None:
    handlers, channel = served.handlers, served.channel
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "Slow")(b"5", timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(handlers.cancelled.wait(), 2)


@serving
async def test_a_client_cancel_cancels_the_handler(served: Served) -> None:
    handlers, channel = served.handlers, served.channel
    call = _method(channel, "Slow")(b"5")
    await asyncio.sleep(0.2)
    call.cancel()
    await asyncio.wait_for(handlers.cancelled.wait(), 2)
    assert await _method(channel, "Echo")(b"after") == b"after"


@serving
async def test_a_message_over_the_limit_is_resource_exhausted(served: Served) -> None:
    channel = served.channel
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "Echo")(b"x" * (LIMIT + 1))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (caught.value.details() or "")


@serving
async def test_an_answer_over_the_limit_is_resource_exhausted(served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(served.channel, "Double")(b"z" * (LIMIT // 2 + 1))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Sent message larger than max" in (caught.value.details() or "")


@serving
async def test_compressed_requests_are_decompressed(served: Served) -> None:
    message = b"compress me " * 1000
    for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
        assert await _method(served.channel, "Echo")(message, compression=compression) == message


@serving
async def test_stop_lets_a_call_in_flight_finish_then_refuses_connections(served: Served) -> None:
    server, channel = served.server, served.channel
    call = _method(channel, "Slow")(b"0.3")
    await asyncio.sleep(0.1)
    await server.stop(2)
    assert await call == b"late"
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", served.port), 1),
    ):
        pass
    assert await server.wait_for_termination(0)


@serving
async def test_garbage_instead_of_http2_closes_only_that_connection(served: Served) -> None:
    channel = served.channel
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
    assert await asyncio.wait_for(reader.read(), 2) is not None  # closed (GOAWAY, then EOF)
    writer.close()
    assert await _method(channel, "Echo")(b"fine") == b"fine"


def _message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


async def _raw_call(
    port: int, method: str, frames_out: list[bytes], piece: int
) -> tuple[bytes, dict[bytes, bytes]]:
    """One call by hand: the preface, windows wide enough for any answer, the
    request's HEADERS, then ``frames_out``, written ``piece`` bytes at a time;
    the answer's DATA and its trailers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    wide = frames.settings_payload({frames.INITIAL_WINDOW_SIZE: 1 << 30})
    opening = frames.frame(frames.SETTINGS, 0, 0, wide) + frames.window_update(0, 1 << 30)
    head = frames.frame(frames.HEADERS, frames.END_HEADERS, 1, request_headers(method, "x"))
    out = frames.PREFACE + opening + head + b"".join(frames_out)
    for at in range(0, len(out), piece):
        writer.write(out[at : at + piece])
        await writer.drain()
    answer, trailers, decoder = bytearray(), None, HeaderDecoder()
    while trailers is None:
        length, kind, flags = _head(await reader.readexactly(frames.HEAD_BYTES))
        payload = await reader.readexactly(length)
        if kind == frames.DATA:
            answer += payload
        elif kind == frames.HEADERS:
            fields = decoder.decode(payload)
            if flags & frames.END_STREAM:
                trailers = fields
    writer.close()
    return bytes(answer), trailers


@serving
async def test_messages_cut_anywhere_across_frames_and_reads_arrive_whole(served: Served) -> None:
    """Messages that span DATA frames, several in one frame, a padded frame, a
    frame over 16 KB (the server allows MAX_FRAME), all written in odd pieces:
    the handler gets each message whole and in order."""
    parts = [b"a" * 10, b"b" * 70_000, b"", b"c" * 3, b"d" * 200_000, b"e" * 5]
    stream = b"".join(_message(part) for part in parts)
    # 17: inside the second message's 5-byte head; 70_020-70_040: three messages begin
    cuts = [0, 7, 9, 17, 20, 40_000, 70_020, 70_040, 70_041, 150_000, 160_000, len(stream)]
    data = []
    for start, end in itertools.pairwise(cuts):
        chunk = stream[start:end]
        if start == 20:  # padded: a pad-length byte first, padding after
            data.append(frames.frame(frames.DATA, frames.PADDED, 1, b"\x03" + chunk + b"\x00" * 3))
        else:
            data.append(frames.frame(frames.DATA, 0, 1, chunk))
    assert max(len(frame) for frame in data) > frames.DEFAULT_MAX_FRAME
    assert max(len(frame) for frame in data) < MAX_FRAME
    data.append(frames.frame(frames.DATA, frames.END_STREAM, 1, b""))
    for piece in (1_000_003, 4_099, 13):
        answer, trailers = await _raw_call(served.port, f"/{SERVICE}/Join", data, piece)
        assert trailers.get(b"grpc-status") == b"0", trailers
        assert answer == _message(b"".join(parts))


@serving
async def test_small_answers_leave_at_once_while_the_client_delays_its_acks(served: Served) -> None:
    """Nagle's algorithm holds a small write while an earlier one is unacknowledged,
    and a peer that delays its ACKs (Linux: 40 ms) then stalls the answer. A client
    in delayed-ACK mode asks for six small messages written 5 ms apart: the first
    must arrive within a few ms of the request, and each within a few ms of the
    one before."""
    arrivals = await asyncio.to_thread(_paced_arrivals, served.port, 6)
    gaps_ms = [round(1e3 * (b - a), 1) for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) == 7
    assert max(gaps_ms) < 35, gaps_ms  # 5 ms apart as written; 40+ when held for an ACK


def _paced_arrivals(port: int, count: int) -> list[float]:
    """When the request left and each of ``count`` Paced messages arrived, read by a
    blocking client that turns quick ACKs off before every read (Linux turns them
    back on by itself)."""
    head = frames.frame(
        frames.HEADERS, frames.END_HEADERS, 1, request_headers(f"/{SERVICE}/Paced", "x")
    )
    body = frames.frame(frames.DATA, frames.END_STREAM, 1, _message(b"%d" % count))
    arrivals: list[float] = []
    buffer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frames.PREFACE + frames.frame(frames.SETTINGS, 0, 0, b"") + head + body)
        arrivals.append(time.perf_counter())
        while True:
            while not _holds_a_frame(buffer):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection"
                buffer += chunk
            length, kind, flags = _head(buffer)
            buffer = buffer[frames.HEAD_BYTES + length :]
            if kind == frames.DATA and length:
                arrivals.append(time.perf_counter())
            if kind == frames.HEADERS and flags & frames.END_STREAM:
                return arrivals


def _head(data: bytes) -> tuple[int, int, int]:
    """A frame head's payload length, type and flags (``data`` starts with the head)."""
    return int.from_bytes(data[:3], "big"), data[3], data[4]


def _holds_a_frame(buffer: bytes) -> bool:
    """True when ``buffer`` starts with a whole HTTP/2 frame."""
    if len(buffer) < frames.HEAD_BYTES:
        return False
    return len(buffer) >= frames.HEAD_BYTES + _head(buffer)[0]
