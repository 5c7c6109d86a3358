"""Lean blocking clients for the closed loop's worker threads (``common.closed_loop``).

    Pool               connections handed to whichever thread calls, one thread each at a time
    BufferedSocket     a TCP socket with a read buffer: what every client here builds on
      KeepAlive        HTTP/1.1: one socket, one request prepared as bytes, the answer read whole
      GrpcConnection   gRPC over cleartext HTTP/2 (``grpc_connection.py``): one prepared
                       unary call, one at a time, or several at once on one thread

Why not grpc's or aiohttp's clients: at one request in flight the rate is the
inverse of the latency, and the client's own CPU is on every request's path.
These send a request with one ``sendall`` of prebuilt bytes and read its answer
with a few ``recv`` on the calling thread, with no other thread woken (grpc's
sync API hands each call to its own I/O threads and back). They speak only
what the benchmarks need: plain TCP, no TLS, no redirects, no compression;
anything but a 200 (and gRPC status 0) raises. Nothing here knows asyncio.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

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


class BufferedSocket:
    """A TCP socket with a read buffer: what HTTP/1.1 and HTTP/2 share."""

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


class KeepAlive(BufferedSocket):
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
