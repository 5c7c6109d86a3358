"""One HTTP/2 connection (RFC 9113), as the lean gRPC server and client need it:
gRPC messages cut from DATA, flow control both ways, and the connection's own
frames (SETTINGS, PING, GOAWAY).

    Connection          what both sides do: frames in, frames out, windows;
                        what is written while one event-loop turn runs leaves
                        in one ``send``
    ServerConnection    streams the client opens go to ``on_stream`` (the gRPC
                        call layer, call.py) as soon as their headers are in;
                        answers go out through ``write_headers`` and
                        ``write_parts_now`` (or ``write_data``, which waits for
                        the windows)
    (client.py)         ClientConnection, the side that opens streams

No gRPC status codes here, and nothing about handlers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeAlias, cast

from shared.h2grpc import frames as f
from shared.h2grpc.stream import HELD_LIMIT, ConnectionGone, Stream
from shared.hpack import HeaderDecoder

log = logging.getLogger(__name__)

Buffer: TypeAlias = bytes | bytearray | memoryview

RECEIVE_WINDOW = 1 << 22
"""What each stream may send us ahead of our reading it (4 MiB)."""
CONNECTION_WINDOW = 1 << 24
"""What the whole connection may send us ahead (16 MiB)."""
MAX_FRAME = 1 << 20
"""Largest frame a client may send us (1 MiB)."""
MAX_HEADER_BLOCK = 1 << 16
"""Largest header block taken (a longer one resets its stream)."""
MIN_PING_INTERVAL_S = 0.5
"""Pings closer together than this, while we send nothing, are strikes (as grpc's
``grpc.http2.min_ping_interval_without_data_ms``; shared/server.py gives grpc.aio's
server the same)."""
MAX_PING_STRIKES = 2
"""Strikes allowed; the next one is answered GOAWAY ENHANCE_YOUR_CALM "too_many_pings"."""


class Connection(asyncio.Protocol):
    """What both sides of an HTTP/2 connection do; the side that takes or opens
    streams is a subclass (``_headers``, ``_went_away``)."""

    _ACTIONS: ClassVar[dict[int, Callable[[Connection, int, int, bytes], None]]]
    """Frame type -> what to do with it (set below the class); DATA is _frame's own."""

    def __init__(self, max_message_bytes: int, on_closed: Callable[[Any], None]) -> None:
        self._on_closed = on_closed
        self.limit = max_message_bytes
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface = True
        """False while the client's preface is still to come (the server's side)."""
        self._decoder = HeaderDecoder()
        self.streams: dict[int, Stream] = {}
        self._last_stream = 0
        """The last stream the peer opened (a GOAWAY names it)."""
        self._partial: tuple[int, int, bytearray] | None = None
        """A header block waiting for its CONTINUATION frames: (stream, flags, block)."""
        self._peer_window = f.DEFAULT_WINDOW
        self._send_window = f.DEFAULT_WINDOW
        self._max_frame = f.DEFAULT_MAX_FRAME
        self._received = 0
        self._out: list[Buffer] = []
        self._flush_handle: asyncio.Handle | None = None
        self._paused = False
        self._window_waiters: list[asyncio.Future[None]] = []
        self.going_away = False
        self.closed = False
        self.peer = ""

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but the same API.
        self._transport = cast(asyncio.Transport, transport)
        # Nagle's algorithm would hold a small answer while an earlier write is
        # unacknowledged, and a peer delaying its ACK (40 ms on Linux) stalls it that
        # long. asyncio turns it off only on sockets whose protocol number it knows,
        # and a listening socket bound by hand (server.py) accepts with none.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            family = "ipv6" if ":" in str(address[0]) else "ipv4"
            self.peer = f"{family}:{address[0]}:{address[1]}"
        ours = {
            f.ENABLE_PUSH: 0,
            f.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
            f.MAX_FRAME_SIZE: MAX_FRAME,
            f.MAX_HEADER_LIST_SIZE: MAX_HEADER_BLOCK,
        }
        self._queue(f.frame(f.SETTINGS, 0, 0, f.settings_payload(ours)))
        self._queue(f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW))

    def data_received(self, data: bytes) -> None:
        # Frames are cut from the read itself, and only a frame cut off at its end is
        # kept: a large message costs a copy per step it takes, so DATA goes on as a
        # view (the stream copies what it keeps) and nothing else holds one past here.
        buffer = self._buffer
        rest: bytes | memoryview = data
        if buffer and self._preface and len(buffer) >= f.HEAD_BYTES:
            # The frame held from the last read takes only what it lacks from this
            # one (rather than the whole read joining it), then the rest is cut in place.
            # Its length passed _frames' check when its head was whole.
            missing = f.HEAD_BYTES + int.from_bytes(buffer[:3], "big") - len(buffer)
            if 0 < missing <= len(data):
                buffer += memoryview(data)[:missing]
                if self._frames(buffer, 0) < 0:
                    return
                buffer.clear()
                rest = memoryview(data)[missing:]
        source: bytes | bytearray | memoryview = rest
        if buffer:
            buffer += rest
            source = buffer
        pos = 0
        if not self._preface:
            if len(source) < len(f.PREFACE):
                self._keep(source, pos)
                return
            if source[: len(f.PREFACE)] != f.PREFACE:
                self._fail(f.PROTOCOL_ERROR, b"not an HTTP/2 connection preface")
                return
            pos, self._preface = len(f.PREFACE), True
        pos = self._frames(source, pos)
        if pos < 0:
            return
        self._keep(source, pos)
        if self._received >= CONNECTION_WINDOW // 2:
            self._queue(f.window_update(0, self._received))
            self._received = 0
        self._flush()

    def _frames(self, source: bytes | bytearray | memoryview, pos: int) -> int:
        """Act on each whole frame of ``source`` from ``pos``; where the first one not
        whole begins, or -1 once the connection failed."""
        size = len(source)
        with memoryview(source) as view:
            try:
                while size - pos >= f.HEAD_BYTES and not self.closed:
                    length = int.from_bytes(view[pos : pos + 3], "big")
                    if length > f.LARGEST_FRAME:
                        raise _ProtocolError(f.FRAME_SIZE_ERROR, "frame too large")
                    end = pos + f.HEAD_BYTES + length
                    if end > size:
                        break
                    kind, flags = view[pos + 3], view[pos + 4]
                    stream = int.from_bytes(view[pos + 5 : pos + 9], "big") & f.LAST_STREAM_ID
                    start, pos = pos + f.HEAD_BYTES, end
                    with view[start:end] as payload:
                        self._frame(kind, flags, stream, payload)
            except _ProtocolError as exc:
                self._fail(exc.code, exc.args[0].encode())
                return -1
        return pos

    def _keep(self, source: bytes | bytearray | memoryview, pos: int) -> None:
        """Hold what follows ``pos`` (a frame not yet whole) for the next read."""
        if source is self._buffer:
            del self._buffer[:pos]
        elif pos < len(source):
            with memoryview(source) as view:
                self._buffer += view[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for stream in list(self.streams.values()):
            self._drop(stream)
        self._wake_writers()
        self._on_closed(self)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers()

    # -- frames in -------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream: int, payload: memoryview) -> None:
        if self._partial is not None and kind != f.CONTINUATION:
            raise _ProtocolError(f.PROTOCOL_ERROR, "a header block was not continued")
        if kind == f.DATA:  # the view itself: the stream copies what it keeps
            self._on_data(stream, flags, payload)
            return
        act = self._ACTIONS.get(kind)
        if act is not None:  # PRIORITY and unknown types are ignored, as RFC 9113 allows
            act(self, stream, flags, payload.tobytes())

    def _on_headers(self, stream: int, flags: int, payload: bytes) -> None:
        block = f.header_block(payload, flags)
        if not flags & f.END_HEADERS:
            self._partial = (stream, flags, bytearray(block))
            return
        self._header_block(stream, flags, block)

    def _on_rst_stream(self, stream: int, flags: int, payload: bytes) -> None:
        if (known := self.streams.get(stream)) is not None:
            self._reset_by_peer(known, int.from_bytes(payload[:4], "big"))

    def _reset_by_peer(self, stream: Stream, code: int) -> None:
        self._drop(stream)

    def _on_settings(self, stream: int, flags: int, payload: bytes) -> None:
        if not flags & f.ACK:
            self._settings(payload)

    def _on_ping(self, stream: int, flags: int, payload: bytes) -> None:
        if not flags & f.ACK:
            self._ping(payload)

    def _on_goaway(self, stream: int, flags: int, payload: bytes) -> None:
        self.going_away = True
        self._went_away(int.from_bytes(payload[:4], "big") & f.LAST_STREAM_ID)
        self._close_when_idle()

    def _went_away(self, last_stream: int) -> None:
        """The peer sent GOAWAY: it takes no new streams, nor ours above ``last_stream``."""

    def _on_push_promise(self, stream: int, flags: int, payload: bytes) -> None:
        raise _ProtocolError(f.PROTOCOL_ERROR, "no push was asked for")

    def _on_data(self, stream_id: int, flags: int, payload: memoryview) -> None:
        self._received += len(payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_ended:
            return  # a stream already reset or ended on our side: its data is dropped
        try:
            data = f.unpadded(payload, flags)
        except ValueError as exc:
            raise _ProtocolError(f.PROTOCOL_ERROR, str(exc)) from exc
        stream.take_data(data, self.limit)
        stream.pending_credit += len(payload)
        self.replenish(stream)
        if flags & f.END_STREAM:
            stream.remote_ended = True
            stream.wake()

    def replenish(self, stream: Stream) -> None:
        """Give ``stream`` back the window its DATA used, unless too many of its messages
        wait unread (the call layer calls it after each read, this side on each DATA)."""
        if (
            stream.pending_credit >= RECEIVE_WINDOW // 4
            and stream.held <= HELD_LIMIT
            and not stream.remote_ended
        ):
            self._queue(f.window_update(stream.id, stream.pending_credit))
            stream.pending_credit = 0

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        if self._partial is None or self._partial[0] != stream_id:
            raise _ProtocolError(f.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, block = self._partial
        block += payload
        if len(block) > MAX_HEADER_BLOCK * 2:
            raise _ProtocolError(f.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self._partial = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            pairs = self._decoder.decode_pairs(block)  # always, to keep the table in step
        except (ValueError, IndexError) as exc:
            raise _ProtocolError(f.PROTOCOL_ERROR, f"bad header block: {exc}") from exc
        self._headers(stream_id, flags, len(block), pairs)

    def _headers(
        self, stream_id: int, flags: int, size: int, pairs: list[tuple[bytes, bytes]]
    ) -> None:
        """A whole header block (``size`` bytes encoded) arrived on ``stream_id``."""
        raise NotImplementedError

    def _ping(self, payload: bytes) -> None:
        self._queue(f.frame(f.PING, f.ACK, 0, payload))

    def _settings(self, payload: bytes) -> None:
        values = f.parse_settings(payload)
        if (window := values.get(f.INITIAL_WINDOW_SIZE)) is not None:
            if window > f.LAST_STREAM_ID:
                raise _ProtocolError(f.FLOW_CONTROL_ERROR, "initial window too large")
            delta, self._peer_window = window - self._peer_window, window
            for stream in self.streams.values():
                stream.send_window += delta
        if (largest := values.get(f.MAX_FRAME_SIZE)) is not None:
            self._max_frame = max(f.DEFAULT_MAX_FRAME, min(largest, f.LARGEST_FRAME))
        self._queue(f.frame(f.SETTINGS, f.ACK, 0))
        self._wake_writers()

    def _on_window_update(self, stream_id: int, flags: int, payload: bytes) -> None:
        increment = int.from_bytes(payload[:4], "big") & f.LAST_STREAM_ID
        if stream_id == 0:
            self._send_window += increment
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
        self._wake_writers()

    # -- frames out ------------------------------------------------------------

    def write_headers(self, stream: Stream, block: bytes, end_stream: bool) -> None:
        """A header block on ``stream`` (split into CONTINUATION frames when long)."""
        if stream.reset or self.closed:
            return
        self._sent_answer()
        flags = f.END_STREAM if end_stream else 0
        first, rest = block[: self._max_frame], block[self._max_frame :]
        if not rest:
            self._queue(f.frame(f.HEADERS, flags | f.END_HEADERS, stream.id, first))
        else:
            self._queue(f.frame(f.HEADERS, flags, stream.id, first))
            while rest:
                piece, rest = rest[: self._max_frame], rest[self._max_frame :]
                last = f.END_HEADERS if not rest else 0
                self._queue(f.frame(f.CONTINUATION, last, stream.id, piece))
        if end_stream:
            self._finished(stream)

    def fits(self, stream: Stream, size: int) -> bool:
        """Whether ``size`` bytes of DATA can go now without waiting for the client."""
        return not self._paused and size <= self._send_window and size <= stream.send_window

    def write_parts_now(self, stream: Stream, parts: Sequence[Buffer], size: int) -> None:
        """DATA that ``fits``, made of ``parts`` (``size`` bytes in all), in frames of
        the peer's largest size. The parts are queued as they are, so a large message
        is copied once, into the send, however many frames and pieces it spans."""
        if stream.reset or self.closed:
            return
        self._sent_answer()
        self._send_window -= size
        stream.send_window -= size
        out, room, largest = self._out, 0, self._max_frame
        for part in parts:
            view = memoryview(part)
            while view:
                if not room:
                    room = min(largest, size)
                    size -= room
                    out.append(f.frame_head(f.DATA, 0, stream.id, room))
                piece, view = view[:room], view[room:]
                out.append(piece)
                room -= len(piece)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    async def write_data(self, stream: Stream, data: bytes) -> None:
        """DATA on ``stream``, as the windows let it go; waits for WINDOW_UPDATEs."""
        view = memoryview(data)
        while view:
            if stream.reset or self.closed:
                raise ConnectionGone("the stream was reset")
            room = min(self._send_window, stream.send_window, self._max_frame)
            if room <= 0 or self._paused:
                waiter = asyncio.get_running_loop().create_future()
                self._window_waiters.append(waiter)
                await waiter
                continue
            piece, view = view[:room], view[room:]
            self.write_parts_now(stream, (piece,), len(piece))

    def reset_stream(self, stream: Stream, code: int) -> None:
        """End ``stream`` abruptly (the client sees RST_STREAM)."""
        if not stream.reset and not self.closed:
            self._queue(f.rst_stream(stream.id, code))
        self._drop(stream, notify=False)

    def close(self) -> None:
        """Close now: every open stream is dropped."""
        if self._transport is not None and not self.closed:
            self._flush()
            self._transport.close()

    def _finished(self, stream: Stream) -> None:
        self.streams.pop(stream.id, None)
        stream.reset = True  # nothing more goes out on it
        self._close_when_idle()

    def _drop(self, stream: Stream, notify: bool = True) -> None:
        self.streams.pop(stream.id, None)
        if stream.reset:
            return
        stream.reset = True
        stream.wake()
        if notify and stream.on_reset is not None:
            stream.on_reset()
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        if self.going_away and not self.streams and self._transport is not None:
            self._flush()
            self._transport.close()

    def _sent_answer(self) -> None:
        """HEADERS or DATA went out (the server's side counts pings afresh)."""

    def _queue(self, data: Buffer) -> None:
        self._out.append(data)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _wake_writers(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, code: int, debug: bytes) -> None:
        log.info(
            "closing an HTTP/2 connection with %s: %s", self.peer, debug.decode(errors="replace")
        )
        self._queue(f.goaway(self._last_stream, code, debug[:200]))
        self._flush()
        if self._transport is not None:
            self._transport.close()


class ServerConnection(Connection):
    """The server's side of one HTTP/2 connection: the client opens the streams."""

    def __init__(
        self,
        on_stream: Callable[[ServerConnection, Stream], None],
        max_message_bytes: int,
        on_closed: Callable[[ServerConnection], None],
    ) -> None:
        super().__init__(max_message_bytes, on_closed)
        self._on_stream = on_stream
        self._preface = False
        self._last_ping: float | None = None
        self._strikes = 0
        self.late_writes: set[asyncio.Task[None]] = set()
        """Answers waiting on flow control (call.py), held until written."""

    def _headers(
        self, stream_id: int, flags: int, size: int, pairs: list[tuple[bytes, bytes]]
    ) -> None:
        known = self.streams.get(stream_id)
        if known is not None:  # trailers from the client: its side ends
            known.remote_ended = True
            known.wake()
            return
        if stream_id <= self._last_stream:
            return  # a stream we already closed
        if stream_id % 2 == 0:
            raise _ProtocolError(f.PROTOCOL_ERROR, "a client stream id must be odd")
        self._last_stream = stream_id
        if self.going_away:
            self._queue(f.rst_stream(stream_id, f.REFUSED_STREAM))
            return
        if size > MAX_HEADER_BLOCK:
            self._queue(f.rst_stream(stream_id, f.ENHANCE_YOUR_CALM))
            return
        stream = Stream(stream_id, self._peer_window)
        stream.pairs = pairs
        stream.fields = dict(pairs)
        stream.remote_ended = bool(flags & f.END_STREAM)
        self.streams[stream_id] = stream
        self._on_stream(self, stream)

    def _ping(self, payload: bytes) -> None:
        now = asyncio.get_running_loop().time()
        if self._last_ping is not None and now - self._last_ping < MIN_PING_INTERVAL_S:
            self._strikes += 1
            if self._strikes > MAX_PING_STRIKES:
                raise _ProtocolError(f.ENHANCE_YOUR_CALM, "too_many_pings")
        self._last_ping = now
        super()._ping(payload)

    def go_away(self) -> None:
        """Take no new streams; close once the open ones end."""
        if self.going_away or self.closed:
            return
        self.going_away = True
        self._queue(f.goaway(self._last_stream, f.NO_ERROR))
        self._flush()
        self._close_when_idle()

    def _sent_answer(self) -> None:
        """HEADERS or DATA went out: pings count afresh (as grpc's server counts them)."""
        self._last_ping, self._strikes = None, 0


Connection._ACTIONS = {
    f.HEADERS: Connection._on_headers,
    f.CONTINUATION: Connection._on_continuation,
    f.RST_STREAM: Connection._on_rst_stream,
    f.SETTINGS: Connection._on_settings,
    f.PING: Connection._on_ping,
    f.WINDOW_UPDATE: Connection._on_window_update,
    f.GOAWAY: Connection._on_goaway,
    f.PUSH_PROMISE: Connection._on_push_promise,
}


class _ProtocolError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
