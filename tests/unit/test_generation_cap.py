"""The generation time cap (``max_generation_s``): how the vLLM stage cuts a generation.

The engine's output stream is read through ``_until``: past the deadline the
reader gets one None (the stage then aborts the request and answers finish
reason ``length``) and nothing more, however the engine behaves; the cut never
fires inside the caller's own code between outputs. A real
engine with a tiny cap would be a second vLLM engine in the suite (tens of
seconds, GBs); the cut itself is this function, driven here by a stream that
produces outputs on the engine's schedule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from services.inference.vllm import _until


async def _engine(every_s: float, count: int) -> AsyncGenerator[Any, None]:
    for index in range(count):
        await asyncio.sleep(every_s)
        yield index


async def _read(
    every_s: float, count: int, cap_s: float | None, pause_s: float = 0.0
) -> tuple[list[Any], float]:
    loop = asyncio.get_running_loop()
    deadline = None if cap_s is None else loop.time() + cap_s
    started = time.monotonic()
    seen = []
    async for output in _until(_engine(every_s, count), deadline):
        seen.append(output)
        await asyncio.sleep(pause_s)
    return seen, time.monotonic() - started


def test_a_generation_past_the_cap_is_cut_with_one_none_at_the_cap() -> None:
    seen, took = asyncio.run(_read(every_s=0.05, count=1000, cap_s=0.3))
    assert seen[-1] is None and None not in seen[:-1]
    assert len(seen) >= 2, seen  # the outputs made before the cap came through
    assert took < 2.0  # cut at the cap, not after the engine's 50 s


def test_a_generation_within_the_cap_or_without_one_runs_to_its_end() -> None:
    assert asyncio.run(_read(every_s=0.01, count=5, cap_s=2.0))[0] == [0, 1, 2, 3, 4]
    assert asyncio.run(_read(every_s=0.01, count=5, cap_s=None))[0] == [0, 1, 2, 3, 4]


def test_an_output_waiting_on_the_engine_at_the_cap_is_cut_there() -> None:
    # The engine stalls (a long prefill, a stuck step): the cap still ends the wait.
    seen, took = asyncio.run(_read(every_s=5.0, count=2, cap_s=0.2))
    assert seen == [None]
    assert took < 2.0


def test_the_cut_waits_for_the_caller_to_ask_for_the_next_output() -> None:
    # The caller is still busy with output 0 when the cap passes: nothing is raised
    # in its code; its next read gets the None.
    seen, _ = asyncio.run(_read(every_s=0.01, count=100, cap_s=0.1, pause_s=0.3))
    assert seen == [0, None]
