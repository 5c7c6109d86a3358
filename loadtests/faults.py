"""Fault runs against a running mesh: a signal to one process while requests are in flight.

The path of one fault run, one line per piece::

    ProcessTable     the mesh's processes (PID and start time) from the supervisor's ready
                     line; ``restarted()`` names those that are no longer the same process
    load_with_fault  N threads call back to back (taking turns over the kinds of call,
                     when given several); at ``fault_at_s`` one signal (SIGKILL, SIGTERM,
                     SIGSTOP) goes to one process; every answer is timed
    FaultResult      failures by status code, the end of the last failed call after the
                     fault, and per kind of call its recovery: from the fault to the first
                     success of a call that began after that kind's first failure

Imported by ``tests/integration/test_reliability.py`` and ``loadtests/reliability.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deploy.local.procfs import child_pids, start_ticks
from deploy.local.standby import STANDBY_NAME

Call = Callable[[], None]
"""One request; raises grpc.RpcError on failure."""
Calls = Call | Mapping[str, Call]
"""One kind of call, or several by name (each timed apart)."""


@dataclass(frozen=True)
class ProcessTable:
    """The mesh's processes as started: label -> (PID, start time in ticks)."""

    started: dict[str, tuple[int, int | None]]

    @classmethod
    def from_ready(cls, ready: Mapping[str, Any]) -> ProcessTable:
        """From the supervisor's MESHSERVE_MESH_READY info (Envoy's real binary included)."""
        pids = {name: int(item["pid"]) for name, item in ready["processes"].items()}
        for child in child_pids(pids.get("envoy", -1)) if "envoy" in pids else []:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/comm").read_text().strip() == "envoy":
                    pids["envoy-binary"] = child
        return cls({name: (pid, start_ticks(pid)) for name, pid in pids.items()})

    def pid(self, label: str) -> int:
        """The PID ``label`` started with."""
        return self.started[label][0]

    def restarted(self) -> list[str]:
        """Labels whose process is gone or was replaced (a restart gets a new PID)."""
        return sorted(
            name
            for name, (pid, ticks) in self.started.items()
            if ticks is None or start_ticks(pid) != ticks
        )


def stage_pids(supervisor_pid: int, module: str) -> list[int]:
    """The supervisor's children running ``module`` now (restarted ones included;
    a standby still waiting to take over is not one)."""
    pids = []
    for child in child_pids(supervisor_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == STANDBY_NAME:
                continue
            if module in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(child)
    return sorted(pids)


def standby_pids(supervisor_pid: int) -> list[int]:
    """The supervisor's standbys (importing, or waiting to take over a restart)."""
    pids = []
    for child in child_pids(supervisor_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == STANDBY_NAME:
                pids.append(child)
    return sorted(pids)


@dataclass
class FaultResult:
    """Every answer of a fault run: codes, and when the failures ended."""

    name: str
    requests: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    last_failure_s: float = 0.0
    """Seconds from the fault to the end of the last failed call (0: none failed)."""
    failed_at: dict[str, float] = field(default_factory=dict)
    """Kind of call -> seconds from the fault to the end of its first failed call."""
    recovered_s: dict[str, float] = field(default_factory=dict)
    """Kind of call -> seconds from the fault to the end of its first success that
    began after its first failure (absent: it never failed, or never recovered)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failures(self) -> dict[str, int]:
        """Failed calls by status code name."""
        return {code: n for code, n in self.codes.items() if code != "OK"}

    def unrecovered(self) -> list[str]:
        """Kinds of call that failed after the fault and never succeeded again."""
        return sorted(set(self.failed_at) - set(self.recovered_s))

    def recovery_s(self) -> float:
        """The slowest kind's recovery (0: none failed; inf: one never recovered)."""
        if self.unrecovered():
            return float("inf")
        return max(self.recovered_s.values(), default=0.0)

    def add(self, code: str, window: tuple[float, float] | None, kind: str = "") -> None:
        """Count one answer; ``window``: when it began and ended, in seconds from the
        fault (None: it ended before the fault)."""
        with self.lock:
            self.requests += 1
            self.codes[code] += 1
            if window is None:
                return
            began, ended = window
            if code != "OK":
                self.last_failure_s = max(self.last_failure_s, ended)
                self.failed_at.setdefault(kind, ended)
            elif began >= self.failed_at.get(kind, float("inf")):
                self.recovered_s.setdefault(kind, ended)


@dataclass(frozen=True)
class FaultPlan:
    """A fault run's shape: the load, the signal and when it goes."""

    name: str
    call: Calls
    pid: int | None
    """Where the signal goes (None: no fault, load only)."""
    signum: signal.Signals = signal.SIGKILL
    in_flight: int = 16
    fault_at_s: float = 1.0
    duration_s: float = 4.0
    watch: Callable[[float, threading.Event], None] | None = None
    """Run in a thread of its own from the fault (its time.monotonic(), and an event
    set when the run ends): e.g. restart_watch.RestartWatch.run."""


def load_with_fault(plan: FaultPlan) -> FaultResult:
    """``plan.in_flight`` threads call back to back; the signal goes at ``fault_at_s``."""
    result = FaultResult(plan.name)
    stop = threading.Event()
    fault_at: list[float] = []
    kinds = list(plan.call.items()) if isinstance(plan.call, Mapping) else [("", plan.call)]

    def worker(first: int) -> None:
        for turn in itertools.count(first):
            if stop.is_set():
                return
            kind, call = kinds[turn % len(kinds)]
            code, began = "OK", time.monotonic()
            try:
                call()
            except grpc.RpcError as exc:
                code = exc.code().name
            ended = time.monotonic()
            window = (began - fault_at[0], ended - fault_at[0]) if fault_at else None
            result.add(code, window, kind)
            if code != "OK":
                time.sleep(0.05)  # a refused call returns at once: do not spin

    threads = [
        threading.Thread(target=worker, args=(i,), daemon=True) for i in range(plan.in_flight)
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        time.sleep(plan.fault_at_s)
        fault_at.append(time.monotonic())
        if plan.pid is not None:
            os.kill(plan.pid, plan.signum)
        if plan.watch is not None:
            watcher = threading.Thread(target=plan.watch, args=(fault_at[0], stop), daemon=True)
            watcher.start()
            threads.append(watcher)
        time.sleep(max(0.0, plan.duration_s - (time.monotonic() - start)))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return result


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """SIGSTOP ``pids``; SIGCONT them on exit, whatever happened."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def wait_until(check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``check()`` is true; raises TimeoutError after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not true within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - start
