"""The supervisor's placement loop outlives a failed pass."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any

import pytest

from deploy.local import supervisor
from deploy.local.placement import CorePlacer, Placement


def test_a_failed_pass_is_logged_once_and_the_next_look_tries_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    passes: list[list[int]] = []

    def place(self: CorePlacer, roots: list[int]) -> Placement:
        passes.append(roots)
        if len(passes) <= 3:
            raise RuntimeError("a bug in a pass")
        return Placement(frozenset(), frozenset(), 0)

    monkeypatch.setattr(CorePlacer, "place", place)
    monkeypatch.setattr(supervisor, "PLACEMENT_LOOK_S", 0.001)
    monkeypatch.setattr(supervisor, "PLACEMENT_FULL_PASS_LOOKS", 1)  # every look is a pass
    me: Any = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid(), returncode=None))

    async def run() -> None:
        loop = asyncio.create_task(supervisor._keep_placed([me]))
        while len(passes) < 5:
            assert not loop.done(), loop  # the loop ended instead of trying again
            await asyncio.sleep(0.001)
        loop.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert passes[-1] == [os.getpid()]
    failures = [line for line in capsys.readouterr().err.splitlines() if "a pass failed" in line]
    assert failures == [
        "[supervisor] CPU placement: a pass failed, trying again at the next look: "
        "RuntimeError('a bug in a pass')"
    ]
