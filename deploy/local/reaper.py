"""What the supervisor started ends even when the supervisor is killed outright.

Every service starts in a session of its own (process_tree.py), so a SIGKILL of
the supervisor, which no handler sees, would leave the whole mesh running with
nobody to stop it. The supervisor therefore starts this small process first,
in a session of its own too, and writes it each service's PID and start time
as it starts one. The reaper only reads: its standard input ends when the
supervisor exits, however it exits. A supervisor that stopped cleanly has
ended everything by then and the reaper leaves quietly; otherwise each
service's group still there gets SIGTERM, and SIGKILL after the grace period,
as the supervisor's own stop would have done.

A PID is signalled only while it is still the process that was started (same
start time), or, once that process is gone, for the members of its group that
it left behind: the kernel gives no new process a PID that is still a group's ID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Sequence

from deploy.local.process_tree import end_process_tree, process_tree
from deploy.local.procfs import start_ticks


class Reaper:
    """The supervisor's side: the reaper process and the PIDs it is told."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    @classmethod
    def start(cls, grace_s: float) -> Reaper:
        """Start the reaper; it ends what is left ``grace_s`` after SIGTERM."""
        command = [sys.executable, "-m", "deploy.local.reaper", "--grace-s", str(grace_s)]
        # A session of its own: a Ctrl-C at the terminal is the supervisor's to handle.
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
        return cls(proc)

    def track(self, pid: int) -> None:
        """Tell the reaper of a new service process (the leader of its own group)."""
        ticks = start_ticks(pid)
        if ticks is None or self._proc.stdin is None:
            return  # gone already: the supervisor's own bookkeeping sees to it
        with contextlib.suppress(OSError):  # a reaper that died cannot be helped here
            self._proc.stdin.write(f"{pid} {ticks}\n".encode())
            self._proc.stdin.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        """After a clean stop: the reaper finds nothing left and exits."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def left_behind(started: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (PID, start ticks) of ``started`` whose group still has a live process."""
    found = []
    for pid, ticks in started:
        now = start_ticks(pid)
        if now is not None and now != ticks:
            continue  # the PID is another process's now, and so is any group it leads
        if process_tree(pid, ticks if now is not None else None):
            found.append((pid, ticks))
    return found


async def reap(started: Sequence[tuple[int, int]], grace_s: float) -> int:
    """End every group of ``started`` that is left; how many there were."""
    left = left_behind(started)
    if left:
        pids = ", ".join(str(pid) for pid, _ in left)
        print(
            f"meshserve: the supervisor exited and left {len(left)} service(s) running "
            f"(PIDs {pids}); ending them",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.gather(*(end_process_tree(pid, ticks, grace_s) for pid, ticks in left))
    return len(left)


def read_started(lines: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """The supervisor's lines ("PID TICKS"), read until its end of the pipe closes."""
    started = []
    for line in lines if lines is not None else sys.stdin:
        parts = line.split()
        if len(parts) == 2 and all(part.isdigit() for part in parts):
            started.append((int(parts[0]), int(parts[1])))
    return started


def main(argv: Sequence[str] | None = None) -> None:
    """Wait for the supervisor to exit, then end what it left running."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--grace-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = read_started()
    asyncio.run(reap(started, max(0.0, args.grace_s)))


if __name__ == "__main__":
    main()
