"""The requests of one bidirectional stream, each running as a task of its own.

A stream's requests run concurrently and each writes its own answer; the
stream's handler ends once every one has, and when the caller goes away the
handler is cancelled and so is every request still running (which stops the
generation behind a decoupled model, or an engine's work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

CANCELLED_CLEAN_UP_S = 10.0
"""How long cancelled requests get to finish their clean-up (an engine abort)."""


class StreamTasks:
    """The running requests of one stream."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, request: Coroutine[Any, Any, None]) -> None:
        """Run one request beside the others."""
        task = asyncio.create_task(request)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self) -> None:
        """Wait until every request started (and any started meanwhile) has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    async def cancel(self) -> None:
        """Cancel whatever still runs, and let it clean up first."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CANCELLED_CLEAN_UP_S)
