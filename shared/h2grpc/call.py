"""One gRPC call on an HTTP/2 stream: its handler found through the server's
interceptors, run as grpc.aio runs it, and its answer and status written.

    CallContext      what a handler sees: grpc.aio's ServicerContext, as far as
                     the services use it (metadata, deadline, abort, read/write)
    run_call         a stream's whole call: headers checked, the handler found
                     and run, the status written as trailers

Handlers are grpc's own ``RpcMethodHandler`` objects, as generated
``add_*Servicer_to_server`` functions and the interceptors make them, so a
service registers on this server as it does on grpc.aio's.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc

from shared.grpc_headers import call_metadata, grpc_message, grpc_timeout, metadata_block
from shared.h2grpc.connection import ServerConnection
from shared.h2grpc.stream import (
    MESSAGE_HEAD,
    Compressed,
    ConnectionGone,
    MessageTooLarge,
    Stream,
    message_prefix,
)
from shared.hpack import literal

log = logging.getLogger(__name__)

Resolve = Callable[[str, tuple[tuple[str, str | bytes], ...]], Awaitable[Any]]
"""(method path, metadata) -> the RpcMethodHandler through the interceptors, or None."""

_HEADERS_OK = b"\x88" + literal(b"", b"application/grpc", name_index=31)
"""``:status 200`` (static entry 8) and ``content-type: application/grpc``."""
_STATUS_OK = literal(b"grpc-status", b"0")
_ENCODINGS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
"""grpc-encoding -> zlib's wbits for it (gzip: with its header; deflate: zlib's)."""


class HandlerCallDetails(grpc.HandlerCallDetails):  # type: ignore[misc]
    """What interceptors see of a call: its method and metadata."""

    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, Any], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class CallContext:
    """A call's side of grpc.aio's ``ServicerContext``."""

    def __init__(
        self,
        connection: ServerConnection,
        stream: Stream,
        metadata: tuple[tuple[str, str | bytes], ...],
        deadline: float | None,
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._metadata = metadata
        self._deadline = deadline
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._trailing: Sequence[tuple[str, str | bytes]] = ()
        self._headers_sent = False
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []
        self.serializer: Callable[[Any], bytes] | None = None
        self.deserializer: Callable[[bytes], Any] | None = None

    # -- what a handler asks ----------------------------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The client's metadata (header names lowercase; ``-bin`` values as bytes)."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline; None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def peer(self) -> str:
        """``ipv4:host:port`` of the client."""
        return self._connection.peer

    def cancelled(self) -> bool:
        """Whether the client reset the call or went away."""
        return self._stream.reset and not self._done

    def done(self) -> bool:
        """Whether the call has ended."""
        return self._done

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Run ``callback(self)`` once the call ends."""
        self._callbacks.append(callback)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return self._trailing

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> NoReturn:
        """End the call with ``code`` (raises, as grpc.aio's does)."""
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """The response's headers, now, with ``metadata``."""
        if self._headers_sent:
            raise grpc.aio.UsageError("initial metadata was already sent")
        self._send_headers(metadata_block(metadata))

    async def read(self) -> Any:
        """The next request message, or ``grpc.aio.EOF``."""
        message = await self._read()
        return grpc.aio.EOF if message is None else self.decoded(message)

    async def write(self, message: Any) -> None:
        """One response message (a streaming answer's)."""
        data = self.encoded(message)
        if not self._headers_sent:
            self._send_headers(b"")
        connection, stream, size = self._connection, self._stream, len(data) + MESSAGE_HEAD
        if connection.fits(stream, size):  # no copy of the message until the send
            connection.write_parts_now(stream, (message_prefix(len(data)), data), size)
        else:
            await connection.write_data(stream, message_prefix(len(data)) + data)

    def set_compression(self, compression: Any) -> None:
        """Nothing: answers go uncompressed."""

    def disable_next_message_compression(self) -> None:
        """Nothing: answers go uncompressed."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    # -- the call layer's own --------------------------------------------------

    async def _read(self) -> bytes | None:
        try:
            message = await self._stream.read()
        except MessageTooLarge as exc:
            await self.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        self._connection.replenish(self._stream)
        if isinstance(message, Compressed):
            return await self._decompressed(message)
        return message

    async def _decompressed(self, message: bytes) -> bytes:
        """A compressed message as its ``grpc-encoding`` (gzip or deflate) says."""
        encoding = self._stream.fields.get(b"grpc-encoding", b"identity")
        wbits = _ENCODINGS.get(encoding)
        if wbits is None:
            await self.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"compressed messages are taken as gzip or deflate, not {encoding[:40]!r}",
            )
        limit = self._connection.limit
        try:
            inflater = zlib.decompressobj(wbits)
            data = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            await self.abort(grpc.StatusCode.INTERNAL, f"a message did not decompress: {exc}")
        if len(data) > limit:
            await self.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max (over {limit} decompressed)",
            )
        return data

    async def requests(self) -> AsyncIterator[Any]:
        """The request messages, deserialized, until the client ends its side."""
        while (message := await self._read()) is not None:
            yield self.decoded(message)

    def decoded(self, message: bytes) -> Any:
        """A request message as the handler takes it."""
        return self.deserializer(message) if self.deserializer else message

    def encoded(self, response: Any) -> bytes:
        """A response as its bytes, unless they are over the size the server sends
        (then the call fails with RESOURCE_EXHAUSTED)."""
        data: bytes = self.serializer(response) if self.serializer else response
        if len(data) > self._connection.limit:
            self._code = grpc.StatusCode.RESOURCE_EXHAUSTED
            self._details = (
                f"Sent message larger than max ({len(data)} vs. {self._connection.limit})"
            )
            raise grpc.aio.AbortError()
        return data

    def _send_headers(self, extra: bytes) -> None:
        self._headers_sent = True
        self._connection.write_headers(self._stream, _HEADERS_OK + extra, end_stream=False)

    def finish(self, answer: bytes | None = None) -> None:
        """The last message (a unary answer), if any, then the status as trailers."""
        if self._done:
            return
        self._done = True
        connection, stream = self._connection, self._stream
        trailers = _status_block(self._code, self._details, self._trailing)
        if answer is None and not self._headers_sent:  # trailers-only
            connection.write_headers(stream, _HEADERS_OK + trailers, end_stream=True)
        elif answer is None:
            connection.write_headers(stream, trailers, end_stream=True)
        else:
            self._finish_with(answer, trailers)
        for callback in self._callbacks:
            callback(self)

    def _finish_with(self, answer: bytes, trailers: bytes) -> None:
        connection, stream, size = self._connection, self._stream, len(answer) + MESSAGE_HEAD
        if not self._headers_sent:
            self._send_headers(b"")
        if connection.fits(stream, size):
            connection.write_parts_now(stream, (message_prefix(len(answer)), answer), size)
            connection.write_headers(stream, trailers, end_stream=True)
            return

        async def later() -> None:  # flow control holds the answer back
            with contextlib.suppress(ConnectionGone):
                await connection.write_data(stream, message_prefix(len(answer)) + answer)
                connection.write_headers(stream, trailers, end_stream=True)

        task = asyncio.get_running_loop().create_task(later())
        connection.late_writes.add(task)  # held, so it is not collected mid-write
        task.add_done_callback(connection.late_writes.discard)

    def end_cut(self) -> None:
        """The call was cut because the server stops: UNAVAILABLE, as grpc's server
        ends it (a client may retry it elsewhere)."""
        self._code = grpc.StatusCode.UNAVAILABLE
        self._details = "the server is stopping"
        self._trailing = ()
        self.finish()


async def run_call(connection: ServerConnection, stream: Stream, resolve: Resolve) -> None:
    """Serve the call on ``stream``: find its handler, run it, write its status."""
    fields = stream.fields
    path = fields.get(b":path", b"").decode("utf-8", "replace")
    metadata = call_metadata(stream.pairs)
    deadline = _deadline(fields.get(b"grpc-timeout"))
    context = CallContext(connection, stream, metadata, deadline)
    task = asyncio.current_task()
    assert task is not None
    stream.on_reset = task.cancel
    if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(
        b"application/grpc"
    ):
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("not a gRPC request (POST with content-type application/grpc)")
        context.finish()
        return
    answer: bytes | None = None
    timeout = asyncio.timeout_at(deadline)  # None: no deadline
    try:
        async with timeout:
            handler = await resolve(path, metadata)
            if handler is None:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            answer = await _invoke(handler, context)
    except grpc.aio.AbortError:
        pass
    except TimeoutError:
        if not timeout.expired():
            _unexpected(context, path)
        else:
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details("Deadline Exceeded")
    except ConnectionGone:
        return
    except asyncio.CancelledError:
        if stream.reset:
            return  # the client went: nobody to answer
        context.end_cut()
        raise
    except Exception:
        _unexpected(context, path)
    if stream.reset:
        return
    context.finish(answer)


async def _invoke(handler: Any, context: CallContext) -> bytes | None:
    """Run ``handler``; a unary answer's bytes (None when streamed, or no answer)."""
    context.serializer = handler.response_serializer
    context.deserializer = handler.request_deserializer
    if handler.request_streaming:
        request: Any = context.requests()
        behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
    else:
        message = await context._read()
        if message is None:
            await context.abort(grpc.StatusCode.INTERNAL, "the call carried no request message")
        request = context.decoded(message)
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
    result = behavior(request, context)
    if handler.response_streaming:
        if hasattr(result, "__aiter__"):
            async for response in result:
                await context.write(response)
        elif inspect.isawaitable(result):
            await result
        elif result is not None:
            for response in result:
                await context.write(response)
        return None
    if inspect.isawaitable(result):
        result = await result
    if result is None or context.code() != grpc.StatusCode.OK:
        return None
    return context.encoded(result)


def _unexpected(context: CallContext, path: str) -> None:
    log.exception("unexpected error in %s", path)
    context.set_code(grpc.StatusCode.UNKNOWN)
    context.set_details("Unexpected error")


def _deadline(value: bytes | None) -> float | None:
    """``grpc-timeout`` as a loop time; None without one (or a malformed one)."""
    seconds = grpc_timeout(value.decode("ascii", "replace")) if value else None
    if seconds is None:
        return None
    return asyncio.get_running_loop().time() + seconds


def _status_block(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str | bytes]]
) -> bytes:
    if code == grpc.StatusCode.OK and not details and not trailing:
        return _STATUS_OK
    block = literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        block += literal(b"grpc-message", grpc_message(details).encode("ascii"))
    return block + metadata_block(trailing)
