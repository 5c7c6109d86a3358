"""The event loop a service process runs on.

uvloop (libuv behind asyncio's API) by default, as vLLM's OpenAI server and
uvicorn run theirs. The project's gRPC server and client (shared/h2grpc/), the
wire door and the HTTP adapter are asyncio protocols and aiohttp handlers: on
uvloop their reads, writes, callbacks and timers cost less CPU per call
(docs/performance.md has the measurements). ``event_loop: asyncio`` runs
Python's own loop instead.

One difference to know: uvloop's timers count whole milliseconds, so a wait
shorter than half of one fires on the loop's next pass (Python's loop sleeps
to the next millisecond instead). Nothing here waits that precisely.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeAlias, TypeVar

import uvloop

__all__ = ["EventLoop", "run", "running"]

EventLoop: TypeAlias = Literal["uvloop", "asyncio"]

T = TypeVar("T")


def _factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop]:
    return uvloop.new_event_loop if kind == "uvloop" else asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: EventLoop) -> T:
    """Run ``main`` to its end on a new event loop of ``kind``, as ``asyncio.run`` does."""
    with asyncio.Runner(loop_factory=_factory(kind)) as runner:
        return runner.run(main)


def running() -> EventLoop:
    """The kind of the event loop this coroutine runs on."""
    return "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"
