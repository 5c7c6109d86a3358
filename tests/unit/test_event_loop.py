"""shared/event_loop.py: a coroutine run on the loop its service is configured with."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from shared import event_loop
from shared.config import ServiceConfig
from shared.errors import ConfigError


async def _answer() -> tuple[str, type[asyncio.AbstractEventLoop], int]:
    await asyncio.sleep(0.001)
    return event_loop.running(), type(asyncio.get_running_loop()), 42


def test_a_service_runs_on_uvloop_by_default() -> None:
    config = ServiceConfig()
    kind, loop_type, value = event_loop.run(_answer(), config.event_loop)
    assert (kind, value) == ("uvloop", 42)
    assert issubclass(loop_type, uvloop.Loop)


def test_python_s_own_loop_where_asked() -> None:
    kind, loop_type, value = event_loop.run(_answer(), "asyncio")
    assert (kind, value) == ("asyncio", 42)
    assert not issubclass(loop_type, uvloop.Loop)


def test_an_unknown_loop_is_refused_naming_the_setting() -> None:
    with pytest.raises((ConfigError, ValueError), match="event_loop"):
        ServiceConfig(event_loop="trio")  # type: ignore[arg-type]
