"""The one place where a failed outgoing RPC becomes the mesh's error tree.

Every hop (the orchestrator to its stages, the HTTP adapter to the
orchestrator, a python model's BLS call) makes its gRPC calls inside
``remote()``: a ``grpc.aio.AioRpcError`` leaves it as the ``shared.errors``
class of its status, with the server's message, so callers handle one kind of
error and the HTTP and gRPC answers come from the same tree.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from types import TracebackType
from typing import TypeVar

import grpc

from shared.errors import MeshError, error_for_status

T = TypeVar("T")


class remote:  # a lower-case name: used as a function, ``with remote():``
    """Run RPCs; a failed one raises its MeshError (``where`` prefixes its message).

    A class rather than ``contextlib.contextmanager``: it is entered on every
    forwarded request, and a generator-based manager costs about three times as much.
    """

    __slots__ = ("_where",)

    def __init__(self, where: str = "") -> None:
        self._where = where

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            raise failure(exc, self._where) from exc


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
