"""Lean blocking clients for the closed loop's worker threads (``common.closed_loop``).

    Pool           connections handed to whichever thread calls, one thread each at a time
    KeepAlive      HTTP/1.1: one socket, one request prepared as bytes, the answer read whole
    GrpcUnary      gRPC over cleartext HTTP/2: one socket, one prepared unary call at a time

Why not grpc's or aiohttp's clients: at one request in flight the rate is the
inverse of the latency, and the client's own CPU is on every request's path.
These send a request with one ``sendall`` of prebuilt bytes and read its answer
with a few ``recv`` on the calling thread, with no other thread woken (grpc's
sync API hands each call to its own I/O threads and back). They speak only
what the benchmarks need: plain TCP, no TLS, no redirects, no compression, one
call at a time on a connection; anything but a 200 (and gRPC status 0) raises.
Nothing here knows asyncio.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

from loadtests.hpack import HeaderDecoder, request_headers

SOCKET_TIMEOUT_S = 60.0
"""Longest wait on one socket operation: a worker thread cannot be cancelled, so a hung
server must fail the call."""
RECV_BYTES = 65536


class StaleConnection(ConnectionError):
    """A kept-alive connection the server had closed before it took our request."""


class Connection(Protocol):
    """One connection that sends one prepared request per call."""

    def call(self) -> None:
        """Send the request, read the whole answer; raise unless it succeeded."""
        ...

    def close(self) -> None:
        """Close the socket (the next call opens a new one)."""
        ...


class Pool:
    """Connections made by ``connect``, one per thread that calls at the same time."""

    def __init__(self, connect: Callable[[], Connection]) -> None:
        self._connect = connect
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._every: list[Connection] = []
        self._lock = threading.Lock()

    def call(self) -> None:
        """One request on an idle connection (a new one when none is idle)."""
        try:
            connection = self._idle.get_nowait()
        except queue.Empty:
            connection = self._connect()
            with self._lock:
                self._every.append(connection)
        try:
            connection.call()
        finally:
            self._idle.put(connection)

    def close(self) -> None:
        """Close every connection (once no thread uses the pool)."""
        with self._lock:
            for connection in self._every:
                connection.close()


class _Socket:
    """A TCP socket with a read buffer: what both protocols share."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self._buffer, self._pos = b"", 0
        self._used = False
        """Whether the open socket has carried a request (it may have gone stale since)."""

    def close(self) -> None:
        """Close the socket (the next call opens a new one); a thread blocked on it wakes."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        self._sock, self._buffer, self._pos, self._used = None, b"", 0, False

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self._address, timeout=SOCKET_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return sock

    def _fill(self, stale: bool = False) -> None:
        """Read what the socket has; at its end, raise (StaleConnection when ``stale``)."""
        assert self._sock is not None
        chunk = self._sock.recv(RECV_BYTES)
        if not chunk:
            if stale:
                raise StaleConnection("the server had closed the connection")
            raise ConnectionError("the server closed the connection inside an answer")
        self._buffer = self._buffer[self._pos :] + chunk
        self._pos = 0

    def _take(self, size: int) -> bytes:
        while len(self._buffer) - self._pos < size:
            self._fill()
        out = self._buffer[self._pos : self._pos + size]
        self._pos += size
        return out

    def _line(self) -> bytes:
        """Up to the next CRLF (dropped)."""
        while (end := self._buffer.find(b"\r\n", self._pos)) < 0:
            self._fill()
        line = self._buffer[self._pos : end]
        self._pos = end + 2
        return line


# -- HTTP/1.1 ------------------------------------------------------------------

NO_BODY = (204, 304)
"""Statuses whose answer never has a body, whatever its header fields say."""


def prepared_post(url: str, body: bytes, headers: Mapping[str, str]) -> tuple[str, int, bytes]:
    """(host, port, the whole request as bytes) of a POST of ``body`` to ``url``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"only plain http:// URLs: {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    head = "\r\n".join(lines) + "\r\n\r\n"
    return parts.hostname, parts.port or 80, head.encode("latin-1") + body


class KeepAlive(_Socket):
    """One keep-alive HTTP/1.1 connection that sends one prepared request."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        super().__init__((host, port))
        self._request = request

    def call(self) -> None:
        """Send the request, read the whole answer; raise unless 200."""
        try:
            try:
                status, body = self._exchange()
            except StaleConnection:  # an idle keep-alive connection closed: one fresh try
                self.close()
                status, body = self._exchange()
        except BaseException:
            self.close()  # where the answer stopped is unknown: never reuse the socket
            raise
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")

    def _exchange(self) -> tuple[int, bytes]:
        sock = self._sock or self._open()
        reused, self._used = self._used, True
        sock.sendall(self._request)
        status, fields = self._head(reused)
        while 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            status, fields = self._head(False)
        if status in NO_BODY:
            body = b""
        elif b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            body = self._chunked()
        elif b"content-length" in fields:
            body = self._take(int(fields[b"content-length"]))
        else:
            body = self._until_closed()
        if b"close" in fields.get(b"connection", b"").lower():
            self.close()
        return status, body

    def _head(self, reused: bool) -> tuple[int, dict[bytes, bytes]]:
        """The status and the header fields (names lower-cased) of the next answer."""
        while (end := self._buffer.find(b"\r\n\r\n", self._pos)) < 0:
            self._fill(stale=reused and len(self._buffer) == self._pos)
        lines = self._buffer[self._pos : end].split(b"\r\n")
        self._pos = end + 4
        if not lines[0].startswith(b"HTTP/1."):
            raise ConnectionError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        fields: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        return int(lines[0][9:12]), fields

    def _chunked(self) -> bytes:
        parts = []
        while size := int(self._line().split(b";", 1)[0], 16):
            parts.append(self._take(size))
            self._line()  # the CRLF after the chunk
        while self._line():  # trailer fields, up to the empty line
            pass
        return b"".join(parts)

    def _until_closed(self) -> bytes:
        try:
            while True:
                self._fill()
        except ConnectionError:
            body = self._buffer[self._pos :]
        self.close()
        return body


# -- gRPC over HTTP/2 ----------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
CONTINUATION = 0x9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20
DEFAULT_WINDOW = 65535
WINDOW = 1 << 24
"""Our receive window, per stream and per connection: the server never waits on us."""
LAST_STREAM_ID = (1 << 31) - 1
ENABLE_PUSH, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x2, 0x4, 0x5


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
    return head + payload


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


class GrpcUnary(_Socket):
    """One HTTP/2 connection making one prepared unary gRPC call at a time."""

    def __init__(self, host: str, port: int, method: str, payload: bytes) -> None:
        super().__init__((host, port))
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._headers = request_headers(method, authority)
        self._message = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self._next_stream = 1
        self._stream = self._stream_window = self._received = self._stream_received = 0
        self._send_window = self._initial_window = DEFAULT_WINDOW
        self._max_frame = 16384
        self._decoder = HeaderDecoder()
        self._fields: dict[bytes, bytes] = {}
        self._answered = self._ended = self._going_away = False

    def call(self) -> None:
        """One call; raise unless it ends with :status 200 and grpc-status 0."""
        try:
            try:
                fields = self._exchange()
            except StaleConnection:  # the server had closed it, or refused the stream
                self.close()
                fields = self._exchange()
        except BaseException:
            self.close()  # the connection's state is unknown: never reuse it
            raise
        if self._going_away:
            self.close()
        if fields.get(b":status") != b"200":
            raise RuntimeError(f"HTTP {fields.get(b':status', b'?').decode()}")
        if (code := fields.get(b"grpc-status")) != b"0":
            message = fields.get(b"grpc-message", b"")[:200]
            raise RuntimeError(f"gRPC status {code!r}: {message!r}")

    def _exchange(self) -> dict[bytes, bytes]:
        if self._sock is None or self._next_stream > LAST_STREAM_ID:
            self._connect()
        reused, self._used = self._used, True
        self._stream, self._next_stream = self._next_stream, self._next_stream + 2
        self._stream_window, self._stream_received = self._initial_window, 0
        self._fields, self._answered, self._ended = {}, False, False
        out = [_frame(HEADERS, END_HEADERS, self._stream, self._headers)]
        sent = 0
        while sent < len(self._message):
            room = min(self._send_window, self._stream_window, self._max_frame)
            if room <= 0:  # flow control: wait for the server's WINDOW_UPDATE
                self._send(b"".join(out))
                out = []
                self._read_frame(reused)
                if self._ended:  # it answered before taking the whole request
                    self._going_away = True
                    return self._fields
                continue
            chunk = self._message[sent : sent + room]
            sent += len(chunk)
            self._send_window -= len(chunk)
            self._stream_window -= len(chunk)
            flags = END_STREAM if sent == len(self._message) else 0
            out.append(_frame(DATA, flags, self._stream, chunk))
        self._send(b"".join(out))
        while not self._ended:
            self._read_frame(reused)
        return self._fields

    def _connect(self) -> None:
        self.close()
        self._open()
        self._next_stream, self._received = 1, 0
        self._send_window = self._initial_window = DEFAULT_WINDOW
        self._max_frame = 16384
        self._decoder, self._going_away = HeaderDecoder(), False
        settings = ENABLE_PUSH.to_bytes(2, "big") + (0).to_bytes(4, "big")
        settings += INITIAL_WINDOW_SIZE.to_bytes(2, "big") + WINDOW.to_bytes(4, "big")
        grow = (WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")
        # The request may follow at once: no need to wait for the server's SETTINGS.
        self._send(PREFACE + _frame(SETTINGS, 0, 0, settings) + _frame(WINDOW_UPDATE, 0, 0, grow))

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        self._sock.sendall(data)

    def _read_frame(self, reused: bool) -> None:
        """Read one frame and act on it."""
        while len(self._buffer) - self._pos < 9:
            self._fill(stale=reused and not self._answered)
        head = self._take(9)
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & LAST_STREAM_ID
        payload = self._take(int.from_bytes(head[:3], "big"))
        if stream == self._stream:
            self._answered = True
        if kind == DATA:
            self._data(stream, flags, len(payload))
        elif kind == HEADERS:
            self._header_block(stream, flags, payload)
        elif kind == RST_STREAM and stream == self._stream:
            raise ConnectionError(f"the server reset the stream (code {payload.hex()})")
        elif kind == SETTINGS and not flags & ACK:
            self._settings(payload)
        elif kind == PING and not flags & ACK:
            self._send(_frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self._going_away = True
            if int.from_bytes(payload[:4], "big") & LAST_STREAM_ID < self._stream:
                raise StaleConnection("the server is going away and refused the call")
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & LAST_STREAM_ID
            if stream == 0:
                self._send_window += increment
            elif stream == self._stream:
                self._stream_window += increment

    def _data(self, stream: int, flags: int, size: int) -> None:
        """Count a DATA frame against our windows (the message itself is not kept)."""
        self._received += size
        self._stream_received += size
        if self._received >= WINDOW // 2:
            self._send(_frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        if stream == self._stream and flags & END_STREAM:
            self._ended = True
        elif stream == self._stream and self._stream_received >= WINDOW // 2:
            update = self._stream_received.to_bytes(4, "big")
            self._send(_frame(WINDOW_UPDATE, 0, stream, update))
            self._stream_received = 0

    def _header_block(self, stream: int, flags: int, payload: bytes) -> None:
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
        if stream == self._stream:
            self._fields.update(fields)
            self._ended = bool(flags & END_STREAM)

    def _settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - 5, 6):
            key, value = int.from_bytes(payload[at : at + 2], "big"), payload[at + 2 : at + 6]
            if key == INITIAL_WINDOW_SIZE:
                size = int.from_bytes(value, "big")
                self._stream_window += size - self._initial_window
                self._initial_window = size
            elif key == MAX_FRAME_SIZE:
                self._max_frame = int.from_bytes(value, "big")
        self._send(_frame(SETTINGS, ACK, 0, b""))
