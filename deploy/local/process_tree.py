"""Ending a service and everything it started, by PID, within a bounded time.

Every service starts in a session of its own (``start_new_session``), so its
process group (PGID = the service's PID) holds the service and whatever it
spawned: vLLM's EngineCore and workers, a python model's subprocesses. Only
that group and the service's own descendants are ever signalled; nothing is
found by name.

Ending one, the service is asked first (SIGTERM to its PID: it drains and
stops its own children, as vLLM stops its engine). Whatever it leaves behind
once it has exited gets SIGTERM too, and whatever is still there when the
grace ends (or at once, when ``hurry`` is set) gets SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from deploy.local.procfs import descendants

POLL_S = 0.1
"""How often the tree is looked at while it ends."""
KILLED_WITHIN_S = 5.0
"""After SIGKILL, how long to wait for the kernel to take the processes away."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start ticks) of ``pid``; None once it is gone."""
    try:
        # The command name may hold spaces or parentheses: split after the last ')'.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2]), int(fields[19])


def _alive(pid: int, started: int) -> bool:
    """``pid`` is the process first seen at ``started`` and has not exited (zombies have)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started


def process_tree(leader: int, started: int | None) -> dict[int, int]:
    """The live processes of ``leader``'s group and below it: PID -> start ticks.

    ``started`` is the leader's start time: below it means below that process
    only, not below a later one that was given its PID again."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            # The kernel keeps a group's ID from being reused while any member lives.
            if stat is not None and stat[1] == leader and stat[0] != "Z":
                found[int(entry.name)] = stat[2]
    if started is None or not _alive(leader, started):
        return found
    for pid in descendants(leader):  # those that left the group for one of their own
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            found.setdefault(pid, stat[2])
    return found


def _signal(leader: int, tree: dict[int, int], sig: signal.Signals) -> None:
    # The group at once (a member forking now cannot slip out), while it has a member
    # seen alive: an empty group's ID may be a stranger's later.
    if any((stat := _stat(pid)) is not None and stat[1] == leader for pid in tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, sig)
    for pid, ticks in tree.items():
        if _alive(pid, ticks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


async def end_process_tree(
    leader: int, started: int | None, grace_s: float, hurry: asyncio.Event | None = None
) -> list[int]:
    """End ``leader`` (a group leader this process started at ``started`` ticks) and
    everything it started.

    Returns the PIDs that needed SIGKILL (empty when all ended on SIGTERM).
    """
    tree = process_tree(leader, started)
    if leader in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(leader, signal.SIGTERM)
    orphans_told = False
    deadline = time.monotonic() + grace_s
    while True:
        tree.update(process_tree(leader, started))  # children started while it stops count too
        tree = {pid: ticks for pid, ticks in tree.items() if _alive(pid, ticks)}
        if not tree:
            return []
        if not orphans_told and leader not in tree:
            # The service is gone; what it left behind gets its own SIGTERM.
            _signal(leader, tree, signal.SIGTERM)
            orphans_told = True
        if time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
            break
        await asyncio.sleep(POLL_S)
    killed = sorted(tree)
    _signal(leader, tree, signal.SIGKILL)
    gone_by = time.monotonic() + KILLED_WITHIN_S
    # Not our children: nothing announces their exit, /proc is looked at.
    while time.monotonic() < gone_by and any(_alive(p, s) for p, s in tree.items()):  # noqa: ASYNC110
        await asyncio.sleep(POLL_S)
    return killed
