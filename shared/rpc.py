"""The one place where a failed outgoing RPC becomes the mesh's error tree.

Every hop (the orchestrator to its stages, the HTTP adapter to the
orchestrator, a python model's BLS call) makes its gRPC calls inside
``remote()``: a ``grpc.aio.AioRpcError`` leaves it as the ``shared.errors``
class of its status, with the server's message, so callers handle one kind of
error and the HTTP and gRPC answers come from the same tree.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import TypeVar

import grpc

from shared.errors import MeshError, error_for_status

T = TypeVar("T")


@contextlib.contextmanager
def remote(where: str = "") -> Iterator[None]:
    """Run RPCs; a failed one raises its MeshError (``where`` prefixes its message)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise failure(exc, where) from exc


def failure(exc: grpc.aio.AioRpcError, where: str = "") -> MeshError:
    """The MeshError of a failed RPC's status."""
    code = exc.code()
    details = exc.details() or code.name.lower()
    return error_for_status(code, f"{where}{details}")


async def remote_stream(messages: AsyncIterable[T], where: str = "") -> AsyncIterator[T]:
    """The messages of a streaming call; a failure raises its MeshError."""
    with remote(where):
        async for message in messages:
            yield message
