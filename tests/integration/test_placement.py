"""CPU placement: while an OpenMP-bound worker is busy and so is the rest of the
mesh, the mesh's threads leave the worker's cores; the process driving the
worker yields to the mesh."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local.placement import DRIVER_NICE, BusyRule, CorePlacer
from deploy.local.procfs import parent_pid

ALL_CORES = frozenset(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALL_CORES) < 2, reason="placement needs 2 cores or more")

# A stand-in for an engine worker: binds itself to one core (argv[1], or stays
# unbound when it is -1), starts a few threads, then computes while its stdin
# says "busy" and sleeps after "idle".
WORKER = """
import os, sys, threading, time
core = int(sys.argv[1])
if core >= 0:
    os.sched_setaffinity(0, {core})
state = {"busy": False}
def listen():
    for line in sys.stdin:
        state["busy"] = line.strip() == "busy"
        print(line.strip(), flush=True)
threading.Thread(target=listen, daemon=True).start()
for _ in range(2):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
while True:
    if not state["busy"]:
        time.sleep(0.01)
"""


# A stand-in for the inference service: runs the command in argv[1:] as its child.
SERVICE = "import subprocess, sys; subprocess.run(sys.argv[1:])"
# A stand-in for vLLM's engine core: starts the worker (argv[1]) bound to one
# core (argv[2]) as its child, prints its PID, and ends it when stdin closes.
DRIVER = """
import os, subprocess, sys
core = sys.argv[2]
env = {**os.environ, "OMP_PLACES": "{" + core + "}"}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], core], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
child.wait()
"""


class Worker:
    def __init__(self, core: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(core)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        self.pid = self.proc.pid
        self.expect("ready")

    def expect(self, line: str) -> None:
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == line

    def tell(self, state: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(state + "\n")
        self.proc.stdin.flush()
        self.expect(state)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def thread_cores(pid: int) -> set[frozenset[int]]:
    return {
        frozenset(os.sched_getaffinity(int(task.name)))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


# Short windows keep the test short; the thresholds are the supervisor's.
RULE = BusyRule(engage_window_s=0.5, release_window_s=1.0)


def look_again(placer: CorePlacer, roots: list[int]) -> tuple[frozenset[int], int]:
    """One pass after a window long enough to judge the engine's CPU use."""
    time.sleep(RULE.release_window_s + 0.2)
    placement = placer.place(roots)
    return placement.service_cores, placement.moved


def test_a_busy_mesh_leaves_a_busy_workers_core_and_comes_back_when_it_idles(
    workers: list[Worker],
) -> None:
    engine_core = min(ALL_CORES)
    rest = ALL_CORES - {engine_core}
    engine = Worker(engine_core, {"OMP_PLACES": f"{{{engine_core}}}"})
    pinned = Worker(engine_core, {})  # narrowed by someone, not an OpenMP binding: moved too
    plain = Worker(-1, {})
    workers += [engine, pinned, plain]
    roots = [engine.pid, pinned.pid, plain.pid]

    placer = CorePlacer(ALL_CORES, RULE)
    first = placer.place(roots)  # starts the clock on the engine's CPU time
    assert (first.engine_cores, first.service_cores, first.moved) == (
        {engine_core},
        frozenset(),
        0,
    )
    assert look_again(placer, roots) == (frozenset(), 0)  # idle: nothing moves

    engine.tell("busy")
    plain.tell("busy")
    service, moved = look_again(placer, roots)
    assert service == rest
    assert moved >= 8  # every thread of the two other processes (4 + 4 at least)
    assert thread_cores(engine.pid) == {frozenset({engine_core})}
    assert thread_cores(pinned.pid) == {rest}
    assert thread_cores(plain.pid) == {rest}
    # Still busy: the moved processes (narrower than all cores now) are not
    # taken for bound ones, and nothing moves again.
    assert look_again(placer, roots) == (rest, 0)

    engine.tell("idle")
    plain.tell("idle")
    time.sleep(RULE.release_window_s + 0.2)
    assert placer.busy_changed()
    assert look_again(placer, roots)[0] == frozenset()
    assert thread_cores(plain.pid) == {ALL_CORES}
    assert thread_cores(pinned.pid) == {ALL_CORES}
    assert thread_cores(engine.pid) == {frozenset({engine_core})}


def test_a_busy_worker_beside_an_idle_mesh_moves_nothing(workers: list[Worker]) -> None:
    """Requests seconds apart: the worker is busy (it computes, then polls for its
    next step), the rest of the mesh barely works; it keeps every core, so a lone
    request's hops are not crowded onto the cores the worker leaves."""
    engine_core = min(ALL_CORES)
    engine = Worker(engine_core, {"OMP_PLACES": f"{{{engine_core}}}"})
    plain = Worker(-1, {})
    workers += [engine, plain]
    placer = CorePlacer(ALL_CORES, RULE)
    placer.place([engine.pid, plain.pid])
    engine.tell("busy")
    assert look_again(placer, [engine.pid, plain.pid]) == (frozenset(), 0)
    assert not placer.busy
    assert thread_cores(plain.pid) == {ALL_CORES}


def test_a_busy_process_that_binds_nothing_moves_nothing(workers: list[Worker]) -> None:
    asked = Worker(-1, {"OMP_PLACES": "{0}"})  # the binding asked for, never made
    every_core = Worker(-1, {"OMP_PLACES": "{0,1}"})  # bound to all: no core to keep free
    plain = Worker(-1, {})
    workers += [asked, every_core, plain]
    asked.tell("busy")
    every_core.tell("busy")
    placer = CorePlacer(ALL_CORES, RULE)
    placer.place([asked.pid, every_core.pid, plain.pid])
    assert look_again(placer, [asked.pid, every_core.pid, plain.pid]) == (frozenset(), 0)
    assert thread_cores(plain.pid) == {ALL_CORES}


def nice_values(pid: int) -> set[int]:
    return {
        os.getpriority(os.PRIO_PROCESS, int(task.name))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


@contextlib.contextmanager
def bound_worker_below(*command: str) -> Iterator[tuple[int, int]]:
    """Start ``command``, which ends in DRIVER; yields its PID and the bound worker's.
    On exit stdin closes: the driver ends its worker, then itself (and so the rest)."""
    process = subprocess.Popen(
        [sys.executable, "-c", *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process.pid, int(process.stdout.readline())
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)


def test_the_process_driving_a_bound_worker_yields_to_the_mesh(workers: list[Worker]) -> None:
    """vLLM's engine core polls while its worker computes; lowered, it gives way."""
    engine_core = min(ALL_CORES)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    driving = (SERVICE, sys.executable, "-c", DRIVER, WORKER, str(engine_core))
    with bound_worker_below(*driving) as (service, worker):
        driver = parent_pid(worker)
        assert driver is not None and driver != service
        plain = Worker(-1, {})
        workers.append(plain)
        roots = [service, plain.pid]
        placer = CorePlacer(ALL_CORES, RULE)
        placement = placer.place(roots)
        assert placement.engine_cores == {engine_core}
        if ours < DRIVER_NICE:
            assert placement.niced == len(nice_values(driver)) >= 1
        assert nice_values(driver) == {max(ours, DRIVER_NICE)}
        assert nice_values(worker) == {ours}  # the worker itself keeps its priority
        assert nice_values(service) == {ours}  # and so does the service above
        assert nice_values(plain.pid) == {ours}
        assert placer.place(roots).niced == 0  # once is enough


def test_a_service_that_runs_its_engine_itself_keeps_its_priority() -> None:
    """Where the bound worker's parent is a service of the mesh (an engine run in
    the service's own process), lowering it would slow the service's own work."""
    engine_core = min(ALL_CORES)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with bound_worker_below(DRIVER, WORKER, str(engine_core)) as (service, worker):
        assert parent_pid(worker) == service
        placement = CorePlacer(ALL_CORES, RULE).place([service])
        assert placement.engine_cores == {engine_core}
        assert placement.niced == 0
        assert nice_values(service) == {ours}
