"""One service process of the local mesh: what to run, and its start, restarts and stop.

Each runs in a session of its own, so its process group holds everything it
spawns; stopping it ends that whole tree (deploy/local/process_tree.py).

With ``ProcessSpec.standby``, once the service is ready a second process of
the same command waits beside it, its modules imported (deploy/local/standby.py);
a restart turns that one into the service instead of starting an interpreter,
and a new standby is prepared once the restarted service is ready again.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.process_tree import end_process_tree
from deploy.local.procfs import start_ticks
from deploy.local.reaper import Reaper
from deploy.local.standby import GO

READY_MARKER = "MESHSERVE_READY"
HEALTHY_AFTER_S = 30.0
"""A process that ran this long before it exited restarts at once, and a crash after
that restart waits the first delay again."""
ORPHAN_GRACE_S = 2.0
"""After a crash, how long what the process left behind (vLLM's engine) may take to
end on SIGTERM before SIGKILL: nothing can use it any more. The restart does not
wait for it: it holds no port (the listening socket went with the crashed process),
and a restarted stage loads its heavy models (an LLM engine) after the others."""
EXIT_POLL_S = 0.1
"""How often a running process is checked for having exited."""


@dataclass(frozen=True)
class ProcessSpec:
    """One service process: what to run and where it listens."""

    name: str
    stage: str
    module: str
    grpc_port: int
    metrics_port: int
    args: tuple[str, ...] = ()
    port_flag: str = "--grpc-port"
    """The flag that sets the process's listening port."""
    standby: bool = False
    """Keep an imported, idle process ready to take over on a restart (standby.py)."""

    def command(self, config: Path) -> list[str]:
        """The command line (the mesh YAML first, explicit ports after)."""
        return [
            sys.executable,
            "-m",
            self.module,
            "--config",
            str(config),
            self.port_flag,
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            *self.args,
        ]

    def standby_command(self, config: Path) -> list[str]:
        """The same command, started as a standby that waits for its turn."""
        command = self.command(config)
        return [command[0], "-m", "deploy.local.standby", *command[2:]]


@dataclass
class ManagedProcess:
    """A running (and restarted) service process."""

    spec: ProcessSpec
    config: Path
    backoff: tuple[float, float]
    environment: dict[str, str] = field(default_factory=dict)
    """Set in the process's environment, over the supervisor's own."""
    proc: asyncio.subprocess.Process | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    restarts: int = 0
    stopping: bool = False
    address: str = ""
    grace_s: float = 15.0
    """On stop, how long the process may drain before it and all it started are killed."""
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (a second Ctrl-C): whatever is still stopping is killed at once."""
    reaper: Reaper | None = None
    """Told of every process started, to end them should the supervisor be killed."""
    _pumps: list[asyncio.Task[None]] = field(default_factory=list)
    _lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while the process starts or ends, so a stop sees every process started."""
    _leader: tuple[int, int | None] | None = None
    """The running (or exited, not yet cleaned up) process: PID and start ticks."""
    _standby: Standby | None = None
    """The process waiting to take over (``spec.standby``), once prepared."""
    _preparing: asyncio.Task[None] | None = None
    _orphans: set[asyncio.Task[None]] = field(default_factory=set)
    """Ending what crashed processes left behind (a stop waits for them)."""

    async def run(self) -> None:
        """Start, and restart after unexpected exits, until stopped."""
        delay = self.backoff[0]
        while not self.stopping:
            started = time.monotonic()
            if not await self._start():
                return
            if self.spec.standby and self._preparing is None:
                self._preparing = asyncio.create_task(self._prepare_standby())
            code = await self._exit_code()
            self.ready.clear()
            if self.stopping:
                return
            # What the process left behind (an LLM engine holding its memory) ends
            # beside the restart.
            await self._end_left_behind()
            # One crash after a good run is restarted at once; a crash loop backs off.
            healthy = time.monotonic() - started > HEALTHY_AFTER_S
            wait = 0.0 if healthy else delay
            delay = self.backoff[0] if healthy else min(delay * 2, self.backoff[1])
            self.restarts += 1
            log(
                f"{self.spec.name} exited with {code}; restarting in {wait:.1f}s "
                f"(restart {self.restarts})"
            )
            await asyncio.sleep(wait)

    async def _start(self) -> bool:
        """Start the process unless stopping (then False): the standby, when one
        waits, else a new one."""
        async with self._lifecycle:
            if self.stopping:
                return False
            standby, self._standby = self._standby, None
            if standby is not None and standby.go():
                self.proc, pumps = standby.proc, standby.pumps
                log(f"{self.spec.name}: the standby (PID {self.proc.pid}) takes over")
            else:
                if standby is not None:
                    await standby.end()
                self.proc = await self._spawn(self.spec.command(self.config), stdin=None)
                pumps = self._pumps_of(self.proc)
            self._leader = (self.proc.pid, start_ticks(self.proc.pid))
        for pump in self._pumps:
            pump.cancel()
        self._pumps = pumps
        return True

    async def _spawn(self, command: list[str], stdin: int | None) -> asyncio.subprocess.Process:
        env = {**os.environ, **self.environment, "PYTHONUNBUFFERED": "1"}
        # A session of its own: its process group holds whatever it spawns.
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        if self.reaper is not None:
            self.reaper.track(proc.pid)
        return proc

    def _pumps_of(self, proc: asyncio.subprocess.Process) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._pump(proc.stderr, ready=False)),
            asyncio.create_task(self._pump(proc.stdout, ready=True)),
        ]

    async def _prepare_standby(self) -> None:
        """Whenever the service is ready and no standby waits, start one."""
        while not self.stopping:
            await self.ready.wait()
            async with self._lifecycle:
                old = self._standby
                if not self.stopping and (old is None or not old.waiting):
                    if old is not None:
                        await old.end()  # it ended: one try per time the service is ready
                    command = self.spec.standby_command(self.config)
                    proc = await self._spawn(command, stdin=asyncio.subprocess.PIPE)
                    self._standby = Standby(proc, self._pumps_of(proc))
            # Until the service goes (ready is cleared) and comes back.
            while self.ready.is_set() and not self.stopping:  # noqa: ASYNC110
                await asyncio.sleep(EXIT_POLL_S)

    async def _exit_code(self) -> int:
        # Not proc.wait(): it also waits for the pipes to close, and a grandchild
        # left behind holds them open. The returncode is set the moment it exits.
        proc = self.proc
        if proc is None:
            return 1
        while proc.returncode is None:  # noqa: ASYNC110
            await asyncio.sleep(EXIT_POLL_S)
        return proc.returncode

    async def _pump(self, stream: asyncio.StreamReader | None, ready: bool) -> None:
        if stream is None:
            return
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if ready and line.startswith(READY_MARKER):
                self.address = json.loads(line[len(READY_MARKER) :])["grpc"]
                self.ready.set()
                continue
            print(f"[{self.spec.name}] {line}", file=sys.stderr, flush=True)

    async def _end_left_behind(self) -> None:
        """End the exited process's tree in the background (SIGKILL after the grace)."""
        async with self._lifecycle:
            leader, self._leader = self._leader, None
        if leader is None:
            return
        grace_s = min(self.grace_s, ORPHAN_GRACE_S)

        async def end() -> None:
            killed = await end_process_tree(*leader, grace_s, self.hurry)
            if killed:
                log(
                    f"{self.spec.name}: what it left behind did not end within {grace_s:.1f}s: "
                    f"killed PIDs {', '.join(map(str, killed))}"
                )

        task = asyncio.create_task(end())
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _end_tree(self, grace_s: float | None = None) -> None:
        """End the process and all it started (once; a later call waits for the first)."""
        grace_s = self.grace_s if grace_s is None else grace_s
        async with self._lifecycle:
            leader, self._leader = self._leader, None
            if leader is None:
                return
            killed = await end_process_tree(*leader, grace_s, self.hurry)
        if killed:
            log(
                f"{self.spec.name} did not stop within {grace_s:.1f}s: killed PIDs "
                f"{', '.join(map(str, killed))}"
            )

    async def stop(self) -> None:
        """SIGTERM this process (by PID); SIGKILL it and all it started after the grace."""
        self.stopping = True
        preparing, self._preparing = self._preparing, None
        async with self._lifecycle:  # not while a standby is being started
            standby, self._standby = self._standby, None
            if preparing is not None:
                preparing.cancel()
        if preparing is not None:
            await asyncio.gather(preparing, return_exceptions=True)
        if standby is not None:
            await standby.end()
        await self._end_tree()
        await asyncio.gather(*self._orphans, return_exceptions=True)
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


@dataclass
class Standby:
    """A started process waiting to become its service (deploy/local/standby.py)."""

    proc: asyncio.subprocess.Process
    pumps: list[asyncio.Task[None]]
    """Its output, copied into the supervisor's log from the start."""

    @property
    def waiting(self) -> bool:
        """True while it has not exited (it may still be importing: it goes on to wait)."""
        return self.proc.returncode is None

    def go(self) -> bool:
        """Tell it to become the service; False when it is gone (or cannot be told)."""
        stdin = self.proc.stdin
        if not self.waiting or stdin is None:
            return False
        try:
            stdin.write(f"{GO}\n".encode())
            stdin.close()  # the service reads no more of it
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def end(self) -> None:
        """End it: it holds nothing, so SIGKILL at once (with all it may have started)."""
        for pump in self.pumps:
            pump.cancel()
        await end_process_tree(self.proc.pid, start_ticks(self.proc.pid), 0.0)


def log(message: str) -> None:
    """Supervisor messages go to stderr, prefixed."""
    print(f"[supervisor] {message}", file=sys.stderr, flush=True)
