"""What /proc says about a process: CPU time, start time, children.

One reader for the supervisor's CPU placement, the benchmarks' CPU accounting
and the GPU check; every function answers for a process that is gone (0, None
or nothing) instead of raising.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second: the unit of /proc's CPU and start times."""


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (field 3 is index 0)."""
    # The command name may hold spaces or parentheses: split after the last ')'.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds; 0 once it is gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), to tell it from a reused PID."""
    try:
        return int(_stat_fields(pid)[19])
    except OSError:
        return None


def parent_pid(pid: int) -> int | None:
    """The PID of ``pid``'s parent; None once it is gone."""
    try:
        return int(_stat_fields(pid)[1])
    except OSError:
        return None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc/<pid>/task/*/children."""
    children: list[int] = []
    for task in tasks(pid):
        with contextlib.suppress(OSError):
            children += [int(part) for part in (task / "children").read_text().split()]
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending += child_pids(current)
    return found


def tasks(pid: int) -> list[Path]:
    """The /proc/<pid>/task/<tid> folders of ``pid``'s threads (none once it is gone)."""
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
