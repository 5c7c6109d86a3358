"""Server-sent events: the one writer of ``data:`` events, and the one pump that
moves a gRPC stream's messages into an HTTP response as they arrive.

A route (OpenAI's streamed completions, Triton's ``generate_stream``) says
what each message becomes with an ``EventSource``; the pump does the rest:
the status line and headers, an event per document, the trailer, and an
error after the status line has gone out (as an event: HTTP has no other
way left). The route awaits the first message before calling ``respond``, so
errors found up front keep their own HTTP status. A client that goes away
ends the pump quietly; the route's ``aclosing`` then cancels the gRPC call.
An adapter that shuts down with streams still open cuts them (``Streams``):
each ends with an error event and no trailer, so a client can tell a cut
answer from a finished one.

Nothing here knows gRPC: messages are whatever the route's source reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from aiohttp import web

from shared.errors import MeshError, Unavailable

M_contra = TypeVar("M_contra", contravariant=True)

DONE = b"data: [DONE]\n\n"
"""OpenAI's last event."""


def event(document: Any) -> bytes:
    """One SSE event carrying ``document`` as JSON."""
    return b"data: " + json.dumps(document).encode() + b"\n\n"


def events(documents: Iterable[Any]) -> bytes:
    """Several events, for one write (so none waits behind another's trip to the client)."""
    return b"".join(map(event, documents))


class EventSource(Protocol[M_contra]):
    """What one streamed answer makes of its messages."""

    trailer: bytes
    """Written after the last event (``DONE``, or nothing)."""

    def documents(self, message: M_contra) -> list[Any]:
        """The events' documents one message becomes (none: it adds nothing to say)."""
        ...

    def closing(self) -> list[Any]:
        """The documents after the last message."""
        ...

    def failed(self, error: MeshError) -> Any:
        """The document of an error that comes after the status line."""
        ...


class Streams:
    """The SSE answers being pumped, so that shutdown can end each with an error event."""

    def __init__(self) -> None:
        self._open: set[asyncio.Timeout] = set()
        self.cut_reason = ""
        """Why the streams were cut; empty until they are."""

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def holding(self, limit: asyncio.Timeout) -> Iterator[None]:
        """Count one pump, whose ``limit`` a cut makes expire now."""
        self._open.add(limit)
        if self.cut_reason:
            limit.reschedule(asyncio.get_running_loop().time())
        try:
            yield
        finally:
            self._open.discard(limit)

    def cut(self, reason: str) -> None:
        """End every open stream, and any opened from now on, with ``reason`` as an error."""
        self.cut_reason = reason
        now = asyncio.get_running_loop().time()
        for limit in self._open:
            limit.reschedule(now)


STREAMS = web.AppKey("sse_streams", Streams)
"""The app's ``Streams`` (an app without one pumps uncuttable streams)."""


async def respond(
    request: web.Request,
    source: EventSource[M_contra],
    first: M_contra | None,
    rest: AsyncIterator[M_contra],
    content_type: str = "text/event-stream",
) -> web.StreamResponse:
    """Start an SSE response and pump ``first`` and then ``rest`` into it."""
    response = web.StreamResponse(
        headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    streams = request.app.get(STREAMS)
    if streams is None:  # not `or`: a Streams with none open is falsy
        streams = Streams()
    # A write fails once the client has closed the connection; returning then
    # lets the caller close ``rest``, which cancels the call behind it.
    with contextlib.suppress(ConnectionResetError):
        try:
            async with asyncio.timeout(None) as limit:
                with streams.holding(limit):
                    await _pump(response, source, first, rest)
        except TimeoutError:
            if not limit.expired():
                raise
            # Cut short: the error, and no trailer, which would read as a finished answer.
            await response.write(event(source.failed(Unavailable(streams.cut_reason))))
            await response.write_eof()
    return response


async def _pump(
    response: web.StreamResponse,
    source: EventSource[M_contra],
    first: M_contra | None,
    rest: AsyncIterator[M_contra],
) -> None:
    try:
        message = first
        while message is not None:
            documents = source.documents(message)
            if documents:
                await response.write(events(documents))
            message = await anext(rest, None)
        closing = source.closing()
        if closing:
            await response.write(events(closing))
    except MeshError as exc:
        await response.write(event(source.failed(exc)))
    if source.trailer:
        await response.write(source.trailer)
    await response.write_eof()
