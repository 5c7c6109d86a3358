"""The requests of one bidirectional stream, each running as a task of its own.

A stream's requests run concurrently and each writes its own answer; the
stream's handler ends once every one has, and when the caller goes away the
handler is cancelled and so is every request still running (which stops the
generation behind a decoupled model, or an engine's work). A caller may also
withdraw one request while the stream goes on: that request alone is cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Coroutine
from typing import Any

CANCELLED_CLEAN_UP_S = 10.0
"""How long cancelled requests get to finish their clean-up (an engine abort)."""


class StreamTasks:
    """The running requests of one stream."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._keyed: dict[str, asyncio.Task[None]] = {}
        self._withdrawn: weakref.WeakSet[asyncio.Task[None]] = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, request: Coroutine[Any, Any, None], key: str | None = None) -> None:
        """Run one request beside the others; ``key`` names it for ``withdraw``."""
        task = asyncio.create_task(request)
        self._tasks.add(task)
        if key is None:
            task.add_done_callback(self._tasks.discard)
        else:
            self._keyed[key] = task
            task.add_done_callback(functools.partial(self._ended, key))

    def _ended(self, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._keyed.get(key) is task:
            del self._keyed[key]

    def withdraw(self, key: str) -> None:
        """Cancel the request started as ``key``, its caller gone; the stream goes on."""
        task = self._keyed.pop(key, None)
        if task is not None and not task.done():
            self._withdrawn.add(task)
            task.cancel()

    def withdrawn(self, task: asyncio.Task[Any]) -> bool:
        """True when ``task`` was cancelled by ``withdraw``, not by the stream's end."""
        return task in self._withdrawn

    async def finish(self) -> None:
        """Wait until every request started (and any started meanwhile) has ended;
        a request's failure is raised, a withdrawn request's cancellation is not."""
        while self._tasks:
            running = list(self._tasks)
            outcomes = await asyncio.gather(*running, return_exceptions=True)
            for task, outcome in zip(running, outcomes, strict=True):
                if isinstance(outcome, BaseException) and not (
                    isinstance(outcome, asyncio.CancelledError) and task in self._withdrawn
                ):
                    raise outcome

    async def cancel(self) -> None:
        """Cancel whatever still runs, and let it clean up first."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CANCELLED_CLEAN_UP_S)
