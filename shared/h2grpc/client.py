"""gRPC stream calls to a cleartext server on asyncio's own sockets: the part of
grpc.aio's client the mesh's busiest hops use, at a fraction of its cost.

grpc.aio hands every message a client writes or reads through its C core and
a poller thread of its own; the orchestrator's streams of forwarded requests
(services/orchestrator/forward_stream.py) spent about a third of its CPU there
(docs/performance.md). ``LeanChannel`` speaks HTTP/2 (connection.py) on the
event loop instead, for serialised messages on stream-stream calls; everything
else, and every hop with TLS, stays on grpc.aio.

    LeanChannel(target, limit)   one connection, opened on the first call and
                                 again once it closed or went away
        .stream_stream(method)   -> ``(metadata=...) -> StreamCall``, as grpc.aio's
        .close()
    StreamCall                   write / done_writing / initial_metadata / read /
                                 ``async for`` / cancel / done, on bytes; a call
                                 that fails raises grpc.aio.AioRpcError as grpc.aio's do

What the server may do, and what the call then says:

    trailers, grpc-status      the call ends with that status (0: OK)
    a :status other than 200   UNAVAILABLE or the code gRPC maps it to
    RST_STREAM                 REFUSED_STREAM: UNAVAILABLE; CANCEL: CANCELLED;
                               ENHANCE_YOUR_CALM: RESOURCE_EXHAUSTED; else INTERNAL
    GOAWAY                     calls above its last stream id: UNAVAILABLE (never
                               seen by the server: safe to retry); new calls go
                               on a new connection
    a closed socket            every call on it: UNAVAILABLE
    a message over the limit   RESOURCE_EXHAUSTED, the stream reset
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc

from shared.grpc_headers import call_metadata, metadata_block
from shared.h2grpc import frames as f
from shared.h2grpc.connection import Buffer, Connection
from shared.h2grpc.stream import (
    MESSAGE_HEAD,
    Compressed,
    ConnectionGone,
    MessageTooLarge,
    Stream,
    message_prefix,
)
from shared.hpack import request_headers

CONNECT_TIMEOUT_S = 5.0
"""How long a connection may take to open before its calls fail UNAVAILABLE."""
_RESETS = {
    f.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
    f.CANCEL: grpc.StatusCode.CANCELLED,
    f.ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""RST_STREAM's error code -> the call's status (gRPC's HTTP/2 mapping; else INTERNAL)."""
_HTTP_STATUS = {
    b"400": grpc.StatusCode.INTERNAL,
    b"401": grpc.StatusCode.UNAUTHENTICATED,
    b"403": grpc.StatusCode.PERMISSION_DENIED,
    b"404": grpc.StatusCode.UNIMPLEMENTED,
    b"429": grpc.StatusCode.UNAVAILABLE,
    b"502": grpc.StatusCode.UNAVAILABLE,
    b"503": grpc.StatusCode.UNAVAILABLE,
    b"504": grpc.StatusCode.UNAVAILABLE,
}
"""An answer's ``:status`` other than 200 -> the call's status (else UNKNOWN)."""
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallStream(Stream):
    """A stream this side opened: the answer's headers and trailers beside the messages."""

    __slots__ = ("headers", "reset_code", "trailers")

    def __init__(self, stream_id: int, send_window: int) -> None:
        super().__init__(stream_id, send_window)
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.reset_code: int | None = None
        """RST_STREAM's error code from the server (None: not reset by it)."""

    async def changed(self) -> None:
        """Wait for anything to arrive on the stream (headers, data, its end)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class ClientConnection(Connection):
    """The client's side of one HTTP/2 connection: this side opens the streams."""

    def __init__(self, max_message_bytes: int, on_closed: Callable[[Any], None]) -> None:
        super().__init__(max_message_bytes, on_closed)
        self._next_stream = 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._out.append(f.PREFACE)  # goes out ahead of the SETTINGS queued below
        super().connection_made(transport)

    def open_stream(self, block: bytes) -> CallStream:
        """A new stream, its request headers (``block``) sent."""
        if self.going_away or self.closed or self._next_stream > f.LAST_STREAM_ID:
            raise ConnectionGone("the connection takes no new streams")
        stream = CallStream(self._next_stream, self._peer_window)
        self._next_stream += 2
        self.streams[stream.id] = stream
        self.write_headers(stream, block, end_stream=False)
        return stream

    def end_writing(self, stream: CallStream) -> None:
        """This side sends nothing more on ``stream`` (END_STREAM)."""
        if not stream.reset and not self.closed:
            self._queue(f.frame(f.DATA, f.END_STREAM, stream.id))

    def _headers(
        self, stream_id: int, flags: int, size: int, pairs: list[tuple[bytes, bytes]]
    ) -> None:
        stream = cast("CallStream | None", self.streams.get(stream_id))
        if stream is None:
            return  # a stream this side reset already
        if stream.headers is None:
            stream.headers = pairs
        else:
            stream.trailers = pairs
        if flags & f.END_STREAM:
            if stream.trailers is None:  # trailers only: the answer is its status
                stream.trailers = pairs
            stream.remote_ended = True
            self._finished(stream)
        stream.wake()

    def _reset_by_peer(self, stream: Stream, code: int) -> None:
        cast("CallStream", stream).reset_code = code
        self._drop(stream)

    def _went_away(self, last_stream: int) -> None:
        for stream in [s for s in self.streams.values() if s.id > last_stream]:
            cast("CallStream", stream).reset_code = f.REFUSED_STREAM
            self._drop(stream)


class LeanChannel:
    """Stream calls to one cleartext gRPC server, over one connection of the event loop's."""

    def __init__(self, target: str, max_message_bytes: int) -> None:
        host, _, port = target.rpartition(":")
        self._host, self._port = host.removeprefix("[").removesuffix("]"), int(port)
        self._target = target
        self._limit = max_message_bytes
        self._connection: ClientConnection | None = None
        self._connecting: asyncio.Task[ClientConnection] | None = None
        self._blocks: dict[tuple[str, tuple[tuple[str, str], ...]], bytes] = {}
        self._closed = False

    def stream_stream(self, method: str) -> Callable[..., StreamCall]:
        """Calls of ``method`` on serialised messages (grpc.aio's ``stream_stream``
        without (de)serialisers)."""

        def call(metadata: Sequence[tuple[str, str]] = ()) -> StreamCall:
            key = (method, tuple(metadata))
            block = self._blocks.get(key)
            if block is None:
                block = request_headers(method, self._target) + metadata_block(metadata)
                self._blocks[key] = block
            return StreamCall(self, block)

        return call

    async def connection(self) -> ClientConnection:
        """The open connection, or a new one (UNAVAILABLE if it cannot be opened)."""
        live = self._connection
        if live is not None and not live.closed and not live.going_away:
            return live
        if self._closed:
            raise _error(grpc.StatusCode.UNAVAILABLE, "the channel is closed")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.create_task(self._connect(), name="lean-channel-connect")
            self._connecting.add_done_callback(_retrieved)
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> ClientConnection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: ClientConnection(self._limit, self._lost), self._host, self._port
                ),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise _error(
                grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self._target}: {detail}"
            ) from None
        if self._closed:
            connection.close()
            raise _error(grpc.StatusCode.UNAVAILABLE, "the channel is closed")
        self._connection = connection
        return connection

    def _lost(self, connection: ClientConnection) -> None:
        if self._connection is connection:
            self._connection = None

    async def close(self) -> None:
        """Close the connection: calls still on it end UNAVAILABLE."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._connection is not None:
            self._connection.close()


class StreamCall:
    """One stream-stream call: messages out and in as bytes."""

    def __init__(self, channel: LeanChannel, block: bytes) -> None:
        self._block = block
        self._connection: ClientConnection | None = None
        self._stream: CallStream | None = None
        self._cancelled = False
        self._opened = asyncio.get_running_loop().create_task(self._open(channel))
        self._opened.add_done_callback(_retrieved)

    async def _open(self, channel: LeanChannel) -> None:
        for _ in range(2):  # the connection may go away as the stream opens: once more
            connection = await channel.connection()
            try:
                self._stream = connection.open_stream(self._block)
            except ConnectionGone:
                continue
            self._connection = connection
            return
        raise _error(grpc.StatusCode.UNAVAILABLE, "the connection went away as the call opened")

    async def _ready(self) -> tuple[ClientConnection, CallStream]:
        if not self._opened.done():
            await asyncio.shield(self._opened)
        if self._opened.cancelled():
            raise self._ended()
        self._opened.result()  # the failure to connect, if that is what happened
        assert self._connection is not None and self._stream is not None
        return self._connection, self._stream

    async def write(self, message: bytes) -> None:
        """Send one message (it waits only where flow control holds it back)."""
        await self.write_parts((message,))

    async def write_parts(self, parts: Sequence[Buffer]) -> None:
        """Send one message made of ``parts``, joined only as it goes out."""
        connection, stream = await self._ready()
        if stream.reset or connection.closed:
            raise self._unwritable()
        size = sum(map(len, parts))
        framed = (message_prefix(size), *parts)
        if connection.fits(stream, size + MESSAGE_HEAD):
            connection.write_parts_now(stream, framed, size + MESSAGE_HEAD)
            return
        try:
            await connection.write_data(stream, b"".join(framed))
        except ConnectionGone:
            raise self._unwritable() from None

    def _unwritable(self) -> Exception:
        """What a write to an ended call raises: its error, as grpc.aio does (and
        InvalidStateError where it ended OK)."""
        status = self._ended()
        if status.code() == grpc.StatusCode.OK:
            return asyncio.InvalidStateError("the call has ended")
        return cast("Exception", status)

    async def done_writing(self) -> None:
        """Half-close: the server's handler sees the end of the requests."""
        connection, stream = await self._ready()
        connection.end_writing(stream)

    async def initial_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The server's response headers as metadata (empty if it answered trailers only)."""
        _, stream = await self._ready()
        while stream.headers is None:
            if stream.reset:
                raise self._ended()
            await stream.changed()
        if stream.trailers is stream.headers:
            return ()
        return call_metadata(stream.headers)

    async def read(self) -> bytes | Any:
        """The next message, or grpc.aio.EOF once the call ended OK; a failed call raises."""
        connection, stream = await self._ready()
        try:
            message = await stream.read()
        except MessageTooLarge as exc:
            self.cancel()
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if isinstance(message, Compressed):  # never asked for: no grpc-accept-encoding sent
            self.cancel()
            raise _error(grpc.StatusCode.INTERNAL, "a compressed message that was not asked for")
        if message is not None:
            connection.replenish(stream)  # the window it held back while unread
            return message
        status = self._ended()
        if status.code() == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise status

    async def _messages(self) -> AsyncIterator[bytes]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._messages()

    def cancel(self) -> bool:
        """End the call now (RST_STREAM CANCEL); False if it had ended already."""
        if self.done():
            return False
        self._cancelled = True
        if not self._opened.done():
            self._opened.cancel()
        elif self._connection is not None and self._stream is not None:
            self._connection.reset_stream(self._stream, f.CANCEL)
        return True

    def done(self) -> bool:
        """True once the call has ended (its status known)."""
        if self._cancelled:
            return True
        if not self._opened.done():
            return False
        return self._stream is None or self._stream.reset

    def _ended(self) -> grpc.aio.AioRpcError:
        """The call's status (as an error, OK included) once it has ended."""
        stream = self._stream
        if self._cancelled:
            return _error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if stream is None:
            return _error(grpc.StatusCode.UNAVAILABLE, "the call was never opened")
        if stream.trailers is not None:
            return _status(stream.headers or [], stream.trailers)
        if stream.reset_code is not None:
            code = _RESETS.get(stream.reset_code, grpc.StatusCode.INTERNAL)
            return _error(code, f"the stream was reset (HTTP/2 error {stream.reset_code})")
        return _error(grpc.StatusCode.UNAVAILABLE, "the connection to the server closed")


def _status(
    headers: list[tuple[bytes, bytes]], trailers: list[tuple[bytes, bytes]]
) -> grpc.aio.AioRpcError:
    fields = dict(headers)
    http_status = fields.get(b":status", b"200")
    if http_status != b"200":
        code = _HTTP_STATUS.get(http_status, grpc.StatusCode.UNKNOWN)
        return _error(code, f"the server answered HTTP {http_status.decode(errors='replace')}")
    fields = dict(trailers)
    raw = fields.get(b"grpc-status")
    if raw is None or not raw.isdigit():
        return _error(grpc.StatusCode.UNKNOWN, "the call ended without a grpc-status")
    code = _CODES.get(int(raw), grpc.StatusCode.UNKNOWN)
    details = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("latin-1"))
    return _error(code, details, call_metadata(trailers))


def _error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str | bytes], ...] = ()
) -> grpc.aio.AioRpcError:
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, empty, grpc.aio.Metadata(*trailing), details=details)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a task's failure as seen: its awaiters (if any) got it already."""
    if not task.cancelled():
        task.exception()
