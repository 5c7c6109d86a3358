"""In the default mesh, vLLM's CPU worker has its cores to itself while it generates,
and the engine core driving it gives way to the mesh."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deploy.local.placement import DRIVER_NICE
from deploy.local.procfs import descendants, parent_pid
from tests.e2e.conftest import streamed_chat

pytestmark = pytest.mark.e2e

ALL_CORES = frozenset(os.sched_getaffinity(0))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _threads(pid: int) -> dict[int, frozenset[int]]:
    cores = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cores[int(task.name)] = frozenset(os.sched_getaffinity(int(task.name)))
        except OSError:  # a thread that ended meanwhile
            continue
    return cores


def _wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _long_chat(
    base_url: str, done: threading.Event, stop: threading.Event, outcome: dict[str, Any]
) -> None:
    """Stream a long chat until its end or ``stop``; ``outcome`` says how it went."""
    request = streamed_chat(base_url, "Tell me a long story about a lighthouse.", 400)
    started = time.monotonic()
    outcome["events"] = 0
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:  # until its end, or until the test has seen enough
                outcome["events"] += line.startswith(b"data: {")
                if stop.is_set():
                    break
    except Exception as exc:  # the test reports it
        outcome["error"] = repr(exc)
    finally:
        outcome["seconds"] = round(time.monotonic() - started, 1)
        done.set()


@pytest.mark.skipif(len(ALL_CORES) < 2, reason="placement needs 2 cores or more")
def test_the_mesh_keeps_off_a_generating_vllm_workers_cores(mesh: dict[str, Any]) -> None:
    roots = [item["pid"] for item in mesh["processes"].values()]
    inference = mesh["processes"]["inference-0"]["pid"]
    workers = [pid for pid in descendants(inference) if "Worker" in _comm(pid)]
    assert workers, "no vLLM worker process under the inference service"
    engine = frozenset().union(*(c for pid in workers for c in _threads(pid).values()))
    if engine == ALL_CORES:
        pytest.skip("this vLLM build binds no cores (a GPU build)")

    def crowding() -> dict[tuple[int, str, int], list[int]]:
        """Mesh threads (not the worker's) allowed on the worker's cores."""
        return {
            (pid, _comm(pid), tid): sorted(cores & engine)
            for root in roots
            for pid in descendants(root)
            if pid not in workers
            for tid, cores in _threads(pid).items()
            if cores & engine
        }

    orchestrator = mesh["processes"]["orchestrator"]["pid"]

    def placed() -> bool:
        return not frozenset(os.sched_getaffinity(orchestrator)) & engine

    # Idle, every process may use every core (an idle LLM takes no core away).
    assert _wait_for(lambda: not placed(), 15)
    done, stop = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    edge = mesh["processes"]["envoy"]["grpc"]
    chat = threading.Thread(target=_long_chat, args=(f"http://{edge}/v1", done, stop, outcome))
    chat.start()
    try:
        # The supervisor looks every second; placing all threads takes a pass.
        _wait_for(lambda: done.is_set() or not crowding(), 20)
        left = crowding()
        # Idle, nothing is placed: no crowding means it was placed while the chat ran.
        ended = f"; the chat ended first: {outcome}" if done.is_set() else ""
        names = sorted({name for _, name, _ in left})
        assert not left, (
            f"{len(left)} mesh threads allowed on the worker's cores {sorted(engine)}, "
            f"of {names}: {sorted(left)[:5]}...{ended}"
        )
    finally:
        stop.set()  # closing the stream aborts the generation
        chat.join(150)
    # Idle again: the mesh gets every core back.
    assert _wait_for(lambda: not placed(), 15)


def _nice_values(pid: int) -> set[int]:
    values = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            values.add(os.getpriority(os.PRIO_PROCESS, int(task.name)))
        except OSError:  # a thread that ended meanwhile
            continue
    return values


@pytest.mark.skipif(len(ALL_CORES) < 2, reason="placement needs 2 cores or more")
def test_vllms_engine_core_yields_to_the_mesh(mesh: dict[str, Any]) -> None:
    """It polls while its worker computes; lowered, it leaves the core to the hops."""
    inference = mesh["processes"]["inference-0"]["pid"]
    workers = [pid for pid in descendants(inference) if "Worker" in _comm(pid)]
    assert workers, "no vLLM worker process under the inference service"
    if frozenset().union(*_threads(workers[0]).values()) == ALL_CORES:
        pytest.skip("this vLLM build binds no cores (a GPU build)")
    driver = parent_pid(workers[0])
    assert driver is not None and "EngineCor" in _comm(driver), _comm(driver or 0)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = max(ours, DRIVER_NICE)
    # The supervisor's full pass (every few seconds) finds it.
    assert _wait_for(lambda: _nice_values(driver) == {lowered}, 15), _nice_values(driver)
    assert _nice_values(workers[0]) == {ours}
    assert _nice_values(inference) == {ours}
    assert _nice_values(mesh["processes"]["orchestrator"]["pid"]) == {ours}
