"""A gRPC server on asyncio's own sockets: grpc.aio's server API, a fraction of
its cost per call.

grpc.aio hands every call through its C core, a poller thread and the event
loop; for the small unary calls that make up most of the mesh's traffic that
costs several times what the mesh's own code does per call
(docs/performance.md#a-grpc-server-on-asyncio). This server speaks HTTP/2
(connection.py, stream.py) and gRPC (call.py) itself, on the event loop, for cleartext
connections. It takes the same handlers, generic or registered, and the same
``grpc.aio.ServerInterceptor`` objects, so services and grpc's health and
reflection servicers register on it unchanged; ``MeshServer`` picks it with
``grpc_server: asyncio`` (TLS stays on grpc.aio).

    LeanServer.add_generic_rpc_handlers / add_registered_method_handlers
                      what generated ``add_*Servicer_to_server`` functions call
    add_insecure_port binds at once (port 0 picks one); start() listens
    stop(grace)       GOAWAY to every connection, calls in flight get ``grace``
                      seconds, then are cancelled
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

from shared.h2grpc.call import HandlerCallDetails, run_call
from shared.h2grpc.connection import ServerConnection
from shared.h2grpc.stream import Stream


class LeanServer(grpc.aio.Server):  # type: ignore[misc]
    """grpc.aio's server interface, served on the event loop (cleartext only)."""

    def __init__(
        self,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._interceptors = list(interceptors)
        self._limit = max_message_bytes
        self._registered: dict[str, Any] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.Server] = []
        self._connections: set[ServerConnection] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self._terminated = asyncio.Event()

    # -- registration (grpc.aio.Server) -----------------------------------------

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]
    ) -> None:
        """Handlers asked for each method in turn (``service(details)``)."""
        self._generic.extend(generic_rpc_handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, Any]
    ) -> None:
        """A service's handlers by method name, found without asking."""
        for method, handler in method_handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def add_insecure_port(self, address: str) -> int:
        """Bind ``host:port`` now; the port (0 picks a free one)."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError:
            sock.close()
            return 0
        sock.setblocking(False)
        self._sockets.append(sock)
        return int(sock.getsockname()[1])

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        """Not served here: TLS stays on grpc.aio's server."""
        raise NotImplementedError("the asyncio gRPC server serves cleartext only")

    # -- life -------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on every bound port."""
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            server = await loop.create_server(self._connection, sock=sock, backlog=1024)
            self._servers.append(server)

    async def stop(self, grace: float | None) -> None:
        """Stop taking calls; those in flight get ``grace`` seconds, then are cancelled."""
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.go_away()
        if self._calls and grace:
            await asyncio.wait(set(self._calls), timeout=grace)
        for task in set(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls))
        for connection in list(self._connections):
            connection.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._terminated.set()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 (grpc.aio's signature)
        """Wait until ``stop`` has run; False when ``timeout`` passed first."""
        if self._terminated.is_set():
            return True
        try:
            await asyncio.wait_for(self._terminated.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- calls ------------------------------------------------------------------

    def _connection(self) -> ServerConnection:
        connection = ServerConnection(self._on_stream, self._limit, self._connections.discard)
        self._connections.add(connection)
        return connection

    def _on_stream(self, connection: ServerConnection, stream: Stream) -> None:
        task = asyncio.get_running_loop().create_task(run_call(connection, stream, self._resolve))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _resolve(self, method: str, metadata: tuple[tuple[str, Any], ...]) -> Any:
        details = HandlerCallDetails(method, metadata)
        return await self._through(0, details)

    async def _through(self, index: int, details: HandlerCallDetails) -> Any:
        """The handler as interceptor ``index`` and those after it give it back."""
        if index == len(self._interceptors):
            return self._handler(details)

        async def continuation(next_details: HandlerCallDetails) -> Any:
            return await self._through(index + 1, next_details)

        return await self._interceptors[index].intercept_service(continuation, details)

    def _handler(self, details: HandlerCallDetails) -> Any:
        handler = self._registered.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None
