"""Unary gRPC over cleartext HTTP/2 on a blocking socket, for the closed loop's threads.

    GrpcConnection            one connection, one prepared unary call (request bytes) reused
        .call()               one call at a time: the calling thread waits for its end
        .run(streams, stop)   ``streams`` calls in flight at once, each restarted as it
                              ends, on the one thread that drives the connection

The two share everything but the loop: the frames, HPACK (``hpack.py``), the
server's SETTINGS, flow control both ways, and a table of the calls in flight
keyed by stream id. ``call()`` is the ``run`` of one stream where the caller
times the call; it stands in a ``blocking_clients.Pool``. ``run`` is how one
thread carries several of the closed loop's workers, as perf_analyzer's and
grpc's own clients multiplex an HTTP/2 connection, without an event loop: a
thread per call would need a connection per call, and grpc.aio costs about
twice the CPU per call.

What the server may do, and what follows:

    SETTINGS           its window and frame size are used; MAX_CONCURRENT_STREAMS
                       caps the calls in flight (``run`` waits for it before the
                       first call)
    WINDOW_UPDATE      a request held back by flow control goes on
    PING               acknowledged
    RST_STREAM         that call fails, the others go on; REFUSED_STREAM (which a
                       server may send while it frees a stream it counts against
                       its limit) starts the call again
    GOAWAY             calls above its last stream id are started again on a new
                       connection, once the ones it kept have ended
    a closed socket    every call in flight fails; ``run`` reconnects

Only what the benchmarks need: no TLS, no compression, no server push, the
answer's message counted and dropped. A call succeeds on ``:status`` 200 and
``grpc-status`` 0. Nothing here knows asyncio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from loadtests.blocking_clients import BufferedSocket, StaleConnection
from shared.h2grpc.frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    LAST_STREAM_ID,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame_head,
)
from shared.h2grpc.frames import frame as _frame
from shared.hpack import HeaderDecoder, request_headers

WINDOW = 1 << 24
"""Our receive window, per stream and per connection: the server never waits on us."""
ERROR_PAUSE_NS = 50_000_000
"""After a failed call its stream waits this long before the next call (as the closed
loop's other workers do): no hot loop against a failing server."""

Outcome = int | Exception
"""How one call ended: its latency in ns, or what it failed with."""


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target ``host:port`` or ``[v6]:port``; None for other forms."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host or "/" in host:  # a scheme (unix:, dns:///, ipv4:...) we do not speak
        return None
    if not host or not port.isdigit():
        return None
    return host, int(port)


def status_error(fields: dict[bytes, bytes]) -> Exception | None:
    """What a call whose answer carried ``fields`` (headers and trailers) failed with."""
    if fields.get(b":status") != b"200":
        return RuntimeError(f"HTTP {fields.get(b':status', b'?').decode()}")
    if (code := fields.get(b"grpc-status")) != b"0":
        message = fields.get(b"grpc-message", b"")[:200]
        return RuntimeError(f"gRPC status {code!r}: {message!r}")
    return None


@dataclass(slots=True)
class _Call:
    """One call in flight on its stream."""

    started: int
    """perf_counter_ns when it was first sent (kept when a GOAWAY makes us resend it)."""
    window: int
    """Bytes the server lets us send on this stream."""
    sent: int = 0
    """Bytes of the request message sent so far."""
    received: int = 0
    """Bytes received on this stream since our last WINDOW_UPDATE for it."""
    fields: dict[bytes, bytes] = field(default_factory=dict)


class GrpcConnection(BufferedSocket):
    """One HTTP/2 connection making one prepared unary gRPC call, once or many at a time."""

    def __init__(self, host: str, port: int, method: str, payload: bytes) -> None:
        super().__init__((host, port))
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._headers = request_headers(method, authority)
        self._message = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self._refused: list[int] = []
        """Start times of calls a GOAWAY turned away: sent again on the next connection."""
        self._answered = False
        self._reset()

    def _reset(self) -> None:
        """The state of a new connection."""
        self._calls: dict[int, _Call] = {}
        self._blocked: list[int] = []
        """Streams whose request waits for the server's window, oldest first."""
        self._finished: list[Outcome] = []
        self._out: list[bytes | memoryview] = []
        """Frames to send: they go in one write before we next wait for the server."""
        self._next_stream = 1
        self._send_window = self._initial_window = DEFAULT_WINDOW
        self._max_frame, self._max_streams = 16384, LAST_STREAM_ID
        self._received = 0
        self._decoder = HeaderDecoder()
        self._settled = self._going_away = False

    def close(self) -> None:
        """Close the socket and forget the calls on it (the next call opens a new one)."""
        super().close()
        self._reset()

    # -- one call at a time ----------------------------------------------------

    def call(self) -> None:
        """One call; raise unless it ends with :status 200 and grpc-status 0."""
        try:
            try:
                outcome = self._one()
            except StaleConnection:  # the server had closed it, or refused the stream
                self.close()
                outcome = self._one()
        except BaseException:
            self.close()  # the connection's state is unknown: never reuse it
            raise
        if isinstance(outcome, Exception):
            raise outcome

    def _one(self) -> Outcome:
        if self._sock is None or self._going_away or self._next_stream > LAST_STREAM_ID:
            self._connect(settle=False)  # the request may follow the preface at once
        reused, self._used = self._used, True
        self._refused.clear()
        self._answered = False
        self._start(time.perf_counter_ns())
        while not self._finished:
            if self._refused:
                raise StaleConnection("the server is going away and refused the call")
            self._read_frame(stale=reused and not self._answered)
        return self._finished.pop()

    # -- many calls at once ----------------------------------------------------

    def run(self, streams: int, stop: Callable[[], bool]) -> Iterator[Outcome]:
        """Keep ``streams`` calls in flight until ``stop()``, then let those in flight end;
        yield how each ended. Each run starts on a new connection and closes it."""
        self.close()
        self._refused.clear()
        paused: list[int] = []  # when each stream that failed may start its next call
        try:
            while self._calls or not stop():
                try:
                    self._keep_up(streams, paused, stop)
                    if self._calls:
                        self._read_frame()
                except Exception as exc:  # the connection is lost: so is every call on it
                    failed = len(self._calls) or 1
                    self.close()
                    yield from [exc] * failed
                    time.sleep(ERROR_PAUSE_NS / 1e9)
                    continue
                finished, self._finished = self._finished, []
                for outcome in finished:
                    if isinstance(outcome, Exception):
                        paused.append(time.perf_counter_ns() + ERROR_PAUSE_NS)
                    yield outcome
        finally:
            self.close()

    def _keep_up(self, streams: int, paused: list[int], stop: Callable[[], bool]) -> None:
        """Connect where needed; start calls until ``streams`` are in flight (less the
        paused ones), within the server's limit."""
        if self._sock is None or (not self._calls and not self._can_start()):
            self._connect(settle=True)
        now = time.perf_counter_ns()
        while paused and paused[0] <= now:
            paused.pop(0)
        room = min(streams - len(paused), self._max_streams) - len(self._calls)
        if stop() or not self._can_start():
            return
        if room <= 0 and not self._calls:
            if paused:  # every stream waits after an error
                time.sleep((paused[0] - now) / 1e9)
            else:  # the server allows no stream for now: wait for its SETTINGS
                self._read_frame()
            return
        for _ in range(room):
            self._start(self._refused.pop() if self._refused else now)

    def _can_start(self) -> bool:
        """Whether this connection takes new calls (not going away, stream ids left)."""
        return not self._going_away and self._next_stream <= LAST_STREAM_ID

    # -- the connection --------------------------------------------------------

    def _connect(self, settle: bool) -> None:
        """A new connection; with ``settle``, wait for the server's SETTINGS (its limit
        on streams) before any call."""
        self.close()
        self._open()
        settings = ENABLE_PUSH.to_bytes(2, "big") + (0).to_bytes(4, "big")
        settings += INITIAL_WINDOW_SIZE.to_bytes(2, "big") + WINDOW.to_bytes(4, "big")
        grow = (WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")
        self._out.append(PREFACE + _frame(SETTINGS, 0, 0, settings))
        self._out.append(_frame(WINDOW_UPDATE, 0, 0, grow))
        while settle and not self._settled:
            self._read_frame()

    def _fill(self, stale: bool = False) -> None:
        """Send what waits to be sent, then read what the socket has."""
        if self._out:
            self._flush()
        super()._fill(stale)

    def _flush(self) -> None:
        assert self._sock is not None
        out, self._out = self._out, []
        self._sock.sendall(b"".join(out))

    def _start(self, started: int) -> None:
        """Queue a new call's HEADERS and as much of its request as the windows allow."""
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        call = self._calls[stream] = _Call(started, self._initial_window)
        self._out.append(_frame(HEADERS, END_HEADERS, stream, self._headers))
        if not self._send_request(stream, call):
            self._blocked.append(stream)

    def _send_request(self, stream: int, call: _Call) -> bool:
        """Queue DATA frames of the request while the windows allow; whether all went."""
        message = self._message
        while call.sent < len(message):
            room = min(self._send_window, call.window, self._max_frame)
            if room <= 0:
                return False
            chunk = memoryview(message)[call.sent : call.sent + room]  # joined once, in _flush
            call.sent += len(chunk)
            self._send_window -= len(chunk)
            call.window -= len(chunk)
            flags = END_STREAM if call.sent == len(message) else 0
            self._out += (frame_head(DATA, flags, stream, len(chunk)), chunk)
        return True

    def _unblock(self) -> None:
        """Send more of the requests that waited, after the server's window grew."""
        self._blocked = [
            stream
            for stream in self._blocked
            if stream in self._calls and not self._send_request(stream, self._calls[stream])
        ]

    def _finish(self, stream: int, error: Exception | None, reset: bool = False) -> None:
        """The call on ``stream`` ended (``reset``: by the server's RST_STREAM): its outcome;
        cancel what it had left to send."""
        call = self._calls.pop(stream)
        if call.sent < len(self._message):  # answered before it took the whole request
            self._blocked.remove(stream)
            if not reset:
                self._out.append(_frame(RST_STREAM, 0, stream, CANCEL.to_bytes(4, "big")))
        if error is None:
            error = status_error(call.fields)
        self._finished.append(error or time.perf_counter_ns() - call.started)

    # -- frames from the server ------------------------------------------------

    def _read_frame(self, stale: bool = False) -> None:
        """Read one frame and act on it."""
        while len(self._buffer) - self._pos < 9:
            self._fill(stale)
        head = self._take(9)
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & LAST_STREAM_ID
        payload = self._take(int.from_bytes(head[:3], "big"))
        call = self._calls.get(stream)
        if call is not None:
            self._answered = True
        if kind == DATA:
            self._data(stream, call, flags, len(payload))
        elif kind == HEADERS:
            self._header_block(stream, call, flags, payload)
        elif kind == RST_STREAM and call is not None:
            self._reset_stream(stream, int.from_bytes(payload[:4], "big"))
        elif kind == SETTINGS and not flags & ACK:
            self._settings(payload)
        elif kind == PING and not flags & ACK:
            self._out.append(_frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self._goaway(int.from_bytes(payload[:4], "big") & LAST_STREAM_ID)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, int.from_bytes(payload[:4], "big") & LAST_STREAM_ID)

    def _data(self, stream: int, call: _Call | None, flags: int, size: int) -> None:
        """Count a DATA frame against our windows (the message itself is not kept)."""
        self._received += size
        if self._received >= WINDOW // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        if call is None:
            return
        if flags & END_STREAM:
            self._finish(stream, None)
            return
        call.received += size
        if call.received >= WINDOW // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, stream, call.received.to_bytes(4, "big")))
            call.received = 0

    def _header_block(self, stream: int, call: _Call | None, flags: int, payload: bytes) -> None:
        """A HEADERS frame and its CONTINUATION frames: decode (HPACK state is shared)."""
        start = 1 if flags & PADDED else 0
        end = len(payload) - (payload[0] if flags & PADDED else 0)
        block = payload[start + (5 if flags & PRIORITY else 0) : end]
        more = flags
        while not more & END_HEADERS:
            head = self._take(9)
            if head[3] != CONTINUATION:
                raise ConnectionError("a header block was not continued")
            more = head[4]
            block += self._take(int.from_bytes(head[:3], "big"))
        fields = self._decoder.decode(block)
        if call is not None:
            call.fields.update(fields)
            if flags & END_STREAM:
                self._finish(stream, None)

    def _settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - 5, 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == INITIAL_WINDOW_SIZE:
                for call in self._calls.values():
                    call.window += value - self._initial_window
                self._initial_window = value
            elif key == MAX_FRAME_SIZE:
                self._max_frame = value
            elif key == MAX_CONCURRENT_STREAMS:
                self._max_streams = value
        self._out.append(_frame(SETTINGS, ACK, 0, b""))
        self._settled = True
        self._unblock()

    def _window_update(self, stream: int, increment: int) -> None:
        if stream == 0:
            self._send_window += increment
        elif (call := self._calls.get(stream)) is not None:  # not a call that has ended
            call.window += increment
        if self._blocked:
            self._unblock()

    def _reset_stream(self, stream: int, code: int) -> None:
        """The server's RST_STREAM: that call fails, unless the server refused it unread."""
        if code == REFUSED_STREAM:  # never processed: start it again (RFC 9113 8.7)
            self._refuse(stream)
        else:
            error = ConnectionResetError(f"the server reset the stream (code {code})")
            self._finish(stream, error, reset=True)

    def _goaway(self, last_stream: int) -> None:
        """No new calls here; those above ``last_stream`` never reached the server."""
        self._going_away = True
        for stream in [s for s in self._calls if s > last_stream]:
            self._refuse(stream)

    def _refuse(self, stream: int) -> None:
        """A call the server did not take: it is sent again, its start time kept."""
        self._refused.append(self._calls.pop(stream).started)
        if stream in self._blocked:
            self._blocked.remove(stream)
