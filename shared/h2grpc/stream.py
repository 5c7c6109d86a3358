"""One HTTP/2 stream opened by a client, as the server's connection keeps it
(connection.py): its request headers, the gRPC messages cut from its DATA, and
the window the client gave it. No sockets here."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

HELD_LIMIT = 1 << 22
"""Whole messages a stream may have waiting to be read before its window stops
being replenished (backpressure on a client that streams faster than the handler reads)."""
MESSAGE_HEAD = 5
"""A gRPC message's prefix: a compressed flag and a 4-byte length."""
GATHER_BYTES = 1 << 16
"""A message this large that goes on past its first frame is gathered piece by
piece and joined once, rather than grown and then copied out."""


def message_prefix(size: int) -> bytes:
    """The prefix of an uncompressed gRPC message of ``size`` bytes."""
    return b"\x00" + size.to_bytes(4, "big")


class ConnectionGone(ConnectionError):
    """The connection closed while a write waited."""


class MessageTooLarge(ValueError):
    """A request message longer than the server takes."""


class Compressed(bytes):
    """A request message sent with the compressed flag (call.py decompresses it)."""


class Stream:
    """One client-opened stream: its request headers, its messages, its send window."""

    __slots__ = (
        "_flag",
        "_missing",
        "_parts",
        "_waiter",
        "body",
        "error",
        "fields",
        "held",
        "id",
        "messages",
        "on_reset",
        "pairs",
        "pending_credit",
        "remote_ended",
        "reset",
        "send_window",
    )

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.fields: dict[bytes, bytes] = {}
        """The request's header fields (a repeated name: its last value)."""
        self.pairs: list[tuple[bytes, bytes]] = []
        """The same, in order, repeated names and all (the call's metadata)."""
        self.body = bytearray()
        """DATA received and not yet cut into whole messages."""
        self._parts: list[bytes | memoryview] | None = None
        """The pieces of a large message being gathered (``GATHER_BYTES``)."""
        self._missing = 0
        """Bytes the gathered message still lacks."""
        self._flag = 0
        """The gathered message's compressed flag."""
        self.messages: collections.deque[bytes] = collections.deque()
        self.remote_ended = False
        """The client ended its side (END_STREAM)."""
        self.reset = False
        """Reset by either side, or its connection went away: nothing more is written."""
        self.error: Exception | None = None
        """Why the request's messages cannot be read (one over the size limit)."""
        self.send_window = send_window
        self.on_reset: Callable[[], object] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.held = 0
        """Bytes of whole messages waiting to be read."""
        self.pending_credit = 0
        """Bytes received that the client's window has not been given back."""

    async def read(self) -> bytes | None:
        """The next request message; None once the client ended its side."""
        while not self.messages:
            if self.error is not None:
                raise self.error
            if self.remote_ended or self.reset:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self.messages.popleft()
        self.held -= len(message) + MESSAGE_HEAD
        return message

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take_data(self, data: bytes | memoryview, limit: int) -> None:
        """Cut whole messages from DATA; the first bad one sets ``error``. A message
        is copied once out of the frame (a large one spanning frames, once out of
        them all), or once more where it spans frames."""
        if self._parts is not None:
            data = self._gather(memoryview(data))
            if not data:
                self.wake()
                return
        body = self.body
        if body:
            body += data
            source: bytes | bytearray | memoryview = body
        else:
            source = data
        pos, end = 0, len(source)
        with memoryview(source) as view:
            while end - pos >= MESSAGE_HEAD and self.error is None:
                size = int.from_bytes(view[pos + 1 : pos + MESSAGE_HEAD], "big")
                if size > limit:
                    self.error = MessageTooLarge(
                        f"Received message larger than max ({size} vs. {limit})"
                    )
                    break
                stop = pos + MESSAGE_HEAD + size
                if stop > end:
                    if source is not body and size >= GATHER_BYTES:
                        self._parts = [_kept(view[pos + MESSAGE_HEAD : end])]
                        self._missing, self._flag, pos = stop - end, view[pos], end
                    break
                message = view[pos + MESSAGE_HEAD : stop].tobytes()
                self.messages.append(Compressed(message) if view[pos] else message)
                self.held += MESSAGE_HEAD + size
                pos = stop
            if source is not body and pos < end and self.error is None:
                body += view[pos:]  # a message that goes on in the next frame
        if source is body:
            del body[:pos]
        self.wake()

    def _gather(self, data: memoryview) -> memoryview:
        """Add what the gathered message lacks from ``data``; once it is whole, queue
        it. What follows it in ``data``."""
        assert self._parts is not None
        taken = min(self._missing, len(data))
        self._parts.append(_kept(data[:taken]))
        self._missing -= taken
        if not self._missing:
            message = b"".join(self._parts)
            self._parts = None
            self.messages.append(Compressed(message) if self._flag else message)
            self.held += MESSAGE_HEAD + len(message)
        return data[taken:]


def _kept(piece: memoryview) -> bytes | memoryview:
    """``piece`` as it may be kept: a view of a read (bytes never change), a copy of
    anything else (the connection reuses its own buffer)."""
    return piece if isinstance(piece.obj, bytes) else piece.tobytes()
