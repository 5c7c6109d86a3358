"""Keep the mesh off the cores a CPU engine has bound its compute threads to.

On a CPU-only host vLLM starts its model worker with OpenMP threads bound one
per core (``VLLM_CPU_OMP_THREADS_BIND``, "auto" by default) and leaves the
other cores to the serving side, but nothing keeps the serving side away: the
kernel runs the orchestrator, the stages, Envoy and vLLM's own spinning
scheduler process on the worker's cores too, and every such slice stalls the
worker, which sets the pace of every stream (docs/performance.md has the
measurements).

Which cores an engine may take, how it shows the cores it bound, and which
the mesh keeps are one contract, written in shared/engine_cores.py; this
module is its placement side, the vLLM backend its engine side.

A pass (``CorePlacer.place``) finds the *bound* processes among the mesh's
descendants: those whose OpenMP threads are bound (the binding is in their
environment) to fewer cores than the mesh's. While they are busy and the rest
of the mesh is busy too (``BusyRule``), every other thread of the mesh is
allowed only the cores they do not use; otherwise every core, so an idle LLM
does not take a core from the image models beside it, and the placement
holds through requests a few seconds apart.

Both sides must be busy because the contention goes both ways. A worker
keeps its core after each step (vLLM's CPU worker polls for its next step
for a second), so lone requests a few seconds apart count as a busy engine;
kept to the other core, a lone request's stage hops would wait behind each
other on fewer cores and its first token would come later. A mesh that serves
a steady stream of tokens, on the other hand, spills onto the worker's core
and slows every step. A model loaded later spawns its engine from a thread
that may have been narrowed: by the contract, the stage starts it on
``MESHSERVE_ENGINE_CORES``. On GPU hosts nothing is bound, so a pass changes
nothing; nor does it where the bound processes use every core.

The process that drives a bound worker (its parent: vLLM's engine core) waits
for each step by polling, at most of a core while the worker computes, and
every hop of a token on its way through the mesh then waits for a slice of a
core beside it. A pass therefore lowers that driver's priority
(``DRIVER_NICE``): its polling gives way at once to any thread of the mesh
with work to do, and it has the core whenever they have none.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from deploy.local.procfs import descendants, parent_pid, process_cpu_seconds, start_ticks, tasks
from shared.engine_cores import binds_openmp

DRIVER_NICE = 10
"""The nice value a pass gives a bound worker's parent (vLLM's polling engine core)."""


def _affinity(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:  # gone meanwhile
        return None


@dataclass(frozen=True)
class Placement:
    """What one pass found and did."""

    engine_cores: frozenset[int]
    """Cores the bound processes use."""
    service_cores: frozenset[int]
    """Cores the rest of the mesh is kept on (empty: it may use every core)."""
    moved: int
    """Threads whose allowed cores changed in this pass."""
    niced: int = 0
    """Threads of the workers' drivers given ``DRIVER_NICE`` in this pass."""


@dataclass(frozen=True)
class BusyRule:
    """When the bound processes count as busy: quick to engage, slow to release.

    Any generation (even a lone prompt's prefill keeps the worker's core busy
    for much of a second) engages within a second; only ``release_window_s`` of near idleness
    releases, so requests a few seconds apart do not move every thread of the
    mesh back and forth each time.
    """

    engage_window_s: float = 1.0
    engage: float = 0.25
    """Idle -> busy above this share of the bound cores' time over the engage window..."""
    serving_engage: float = 0.1
    """...while the rest of the mesh uses above this share of the other cores' time."""
    release_window_s: float = 3.0
    release: float = 0.1
    """Busy -> idle below this share over the release window..."""
    serving_release: float = 0.05
    """...or when the rest of the mesh uses below this share of the other cores."""


class CorePlacer:
    """Passes over one process tree; remembers what it moved and the engines' CPU time."""

    def __init__(self, all_cores: frozenset[int], rule: BusyRule = BusyRule()) -> None:
        self.all_cores = all_cores
        self.rule = rule
        self._moved: set[tuple[int, int | None]] = set()
        """(pid, start time) of processes a pass narrowed: never taken for bound ones."""
        self._bound: dict[int, frozenset[int]] = {}
        self._serving: list[int] = []
        # (wall, CPU s of the bound processes, CPU s of the others)
        self._samples: deque[tuple[float, float, float]] = deque()
        self.busy = False

    def place(self, roots: Iterable[int]) -> Placement:
        """Find the bound processes under ``roots``; keep every other thread off their
        cores while they are busy, and let it use every core again once they are idle."""
        services = set(roots)
        processes = {pid: start_ticks(pid) for root in services for pid in descendants(root)}
        self._moved &= set(processes.items())
        bound = {
            pid: cores
            for pid, started in processes.items()
            if (cores := _affinity(pid)) is not None
            and cores < self.all_cores
            and (pid, started) not in self._moved
            and _binds_openmp(pid)
        }
        niced = sum(
            _lower_priority(driver)
            for pid in bound
            # Never a service itself (an engine run in the service's own process).
            if (driver := parent_pid(pid)) in processes and driver not in bound.keys() | services
        )
        serving = sorted(processes.keys() - bound.keys())
        if bound.keys() != self._bound.keys() or serving != self._serving:
            self._bound, self._serving = bound, serving
            self._samples.clear()  # a process that ended would read as negative CPU time
        self.busy = self._engines_busy()
        engine = frozenset().union(*bound.values())
        service = self.all_cores - engine
        target = service if (self.busy and engine and service) else self.all_cores
        moved = 0
        for pid, started in processes.items():
            if pid in bound:
                continue
            if target != self.all_cores:
                self._moved.add((pid, started))
            elif (pid, started) not in self._moved:
                continue  # never narrowed by us: not ours to widen
            for task in tasks(pid):
                tid = int(task.name)
                if _affinity(tid) != target:
                    with contextlib.suppress(OSError):  # a thread that ended meanwhile
                        os.sched_setaffinity(tid, target)
                        moved += 1
        return Placement(engine, target if target != self.all_cores else frozenset(), moved, niced)

    def busy_changed(self) -> bool:
        """Whether the bound processes went busy or idle since the last pass (cheap:
        reads their CPU time only)."""
        return bool(self._bound) and self._engines_busy() != self.busy

    def _engines_busy(self) -> bool:
        """Busy or idle by ``rule``, from a new sample of the bound processes' CPU time."""
        if not self._bound:
            return False
        now = (
            time.monotonic(),
            sum(process_cpu_seconds(pid) for pid in self._bound),
            sum(process_cpu_seconds(pid) for pid in self._serving),
        )
        samples = self._samples
        if samples and now[0] - samples[-1][0] < MIN_SAMPLE_GAP_S:
            samples.pop()  # a look just now (busy_changed, then place): this one replaces it
        samples.append(now)
        while len(samples) > 2 and now[0] - samples[1][0] >= self.rule.release_window_s:
            samples.popleft()
        rule = self.rule
        if self.busy:
            shares = self._shares(rule.release_window_s)
            return shares is None or (shares[0] > rule.release and shares[1] > rule.serving_release)
        shares = self._shares(rule.engage_window_s)
        return shares is not None and shares[0] > rule.engage and shares[1] > rule.serving_engage

    def _shares(self, window_s: float) -> tuple[float, float] | None:
        """The bound processes' share of their cores' time, and the others' share of
        the remaining cores, over about the last ``window_s`` (None while the
        samples span too little time to judge)."""
        now = self._samples[-1]
        then = next(
            (s for s in reversed(self._samples) if now[0] - s[0] >= window_s), self._samples[0]
        )
        elapsed = now[0] - then[0]
        if elapsed < MIN_WINDOW_S:
            return None  # /proc counts in 10 ms ticks
        engine_cores = len(frozenset().union(*self._bound.values()))
        other_cores = max(1, len(self.all_cores) - engine_cores)
        return (
            (now[1] - then[1]) / elapsed / engine_cores,
            (now[2] - then[2]) / elapsed / other_cores,
        )


MIN_WINDOW_S = 0.5
"""Shortest time over which the engines' CPU use is judged."""
MIN_SAMPLE_GAP_S = 0.2
"""Samples closer than this replace the previous one."""


def _lower_priority(pid: int) -> int:
    """Give every thread of ``pid`` at least ``DRIVER_NICE``; how many changed.

    Niceness is per thread on Linux (a thread started later takes its creator's);
    raising it needs no privilege.
    """
    changed = 0
    for task in tasks(pid):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) < DRIVER_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, DRIVER_NICE)
                changed += 1
    return changed


def _binds_openmp(pid: int) -> bool:
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return binds_openmp(environment)
