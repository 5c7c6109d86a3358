"""A test service of every call kind, for the gRPC server and client on asyncio
(shared/h2grpc/): each method says in its name what it does with a call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

SERVICE = "test.Echo"
LIMIT = 4 * 1024 * 1024
PACE_S = 0.005


class Handlers:
    """The test service's methods, and what they saw."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.metadata: dict[str, Any] = {}
        self.pairs: list[tuple[str, Any]] = []

    async def echo(self, request: bytes, context: Any) -> bytes:
        self.pairs = list(context.invocation_metadata())
        self.metadata = dict(self.pairs)
        await context.send_initial_metadata((("x-initial", "yes"),))
        context.set_trailing_metadata((("x-trailing", "done"), ("x-raw-bin", b"\x00\xff")))
        return request

    async def refuse(self, request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tensor 'x' is bad: ünïcode 100%")

    async def slow(self, request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(float(request or b"5"))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"late"

    async def count(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for index in range(int(request)):
            yield b"%d" % index

    async def join(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"".join([message async for message in requests])

    async def reverse(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message[::-1]

    async def tagged(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        """Reverse: headers first, then each message reversed; ``fail`` aborts the
        call, ``hang`` waits to be cancelled."""
        self.metadata = dict(context.invocation_metadata())
        await context.send_initial_metadata((("x-initial", "yes"),))
        async for message in requests:
            if message == b"fail":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tensor 'x' is bad: 100%")
            if message == b"hang":
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            yield message[::-1]

    async def written(self, request: bytes, context: Any) -> None:
        for index in range(3):
            await context.write(request + b"%d" % index)

    async def paced(self, request: bytes, context: Any) -> None:
        for index in range(int(request)):
            if index:
                await asyncio.sleep(PACE_S)
            await context.write(b"m%d" % index)

    async def double(self, request: bytes, context: Any) -> bytes:
        return request * 2

    async def crash(self, request: bytes, context: Any) -> bytes:
        raise RuntimeError("secret detail")

    def generic(self) -> grpc.GenericRpcHandler:
        unary, server_stream = (
            grpc.unary_unary_rpc_method_handler,
            grpc.unary_stream_rpc_method_handler,
        )
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": unary(self.echo),
                "Refuse": unary(self.refuse),
                "Slow": unary(self.slow),
                "Crash": unary(self.crash),
                "Double": unary(self.double),
                "Count": server_stream(self.count),
                "Written": server_stream(self.written),
                "Paced": server_stream(self.paced),
                "Join": grpc.stream_unary_rpc_method_handler(self.join),
                "Reverse": grpc.stream_stream_rpc_method_handler(self.reverse),
                "Tagged": grpc.stream_stream_rpc_method_handler(self.tagged),
            },
        )
