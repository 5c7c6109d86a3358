"""Where a way's time goes on the CPUs: each thread's run time and run-queue wait.

    python loadtests/peers/run_queue.py [--ways "stage direct,Envoy gRPC"]
                                        [--in-flight 16] [--seconds 5]

One mesh (bench.py's, on the same MLP), the same closed loop as bench.py, one
window per way. At the window's edges it reads every thread of every mesh
process and of this one (the load): ``/proc/<pid>/task/<tid>/schedstat``
(time on a CPU, time runnable but waiting for one, times scheduled) and the
involuntary switches in ``status``; and the machine's idle time from
``/proc/stat``. Per request it prints each busy thread's CPU and run-queue
wait, and per window the cores left idle. Cores left idle while threads wait
in the run queue say that a path is bound by its hand-offs between processes
(a thread woken waits for a core while another sleeps), not by its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import LoadSettings, closed_loop, install_sigterm_exit
from peers import bench
from peers.servers import Running
from peers.ways import Way, all_ways

from deploy.local.procfs import TICKS, tasks


@dataclass(frozen=True)
class ThreadTimes:
    """One thread's scheduler counters (seconds, counts)."""

    process: str
    name: str
    run: float
    wait: float
    slices: int
    involuntary: int


@dataclass(frozen=True)
class Snapshot:
    """Every watched thread, and the machine's idle seconds, at one instant."""

    threads: dict[int, ThreadTimes]
    idle: float


def _thread(process: str, task: Path) -> ThreadTimes | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        run, wait, slices = (int(x) for x in (task / "schedstat").read_text().split())
        status = (task / "status").read_text()
        involuntary = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        name = (task / "comm").read_text().strip()
        return ThreadTimes(process, name, run / 1e9, wait / 1e9, slices, involuntary)
    return None


def snapshot(pids: Mapping[str, int]) -> Snapshot:
    """Read the counters of every thread of ``pids`` now."""
    threads: dict[int, ThreadTimes] = {}
    for label, pid in pids.items():
        for task in tasks(pid):
            if (times := _thread(label, task)) is not None:
                threads[int(task.name)] = times
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return Snapshot(threads, (int(fields[4]) + int(fields[5])) / TICKS)


def report(label: str, rate: float, seconds: float, before: Snapshot, after: Snapshot) -> None:
    """Per request: each busy thread's CPU and run-queue wait; the idle cores."""
    requests = rate * seconds
    print(f"== {label}: {rate:.0f} req/s, {(after.idle - before.idle) / seconds:.2f} cores idle")
    print(f"  {'process':<14} {'thread':<16} {'CPU ms/req':>10} {'wait ms/req':>11} runs/req")
    totals: dict[str, list[float]] = {}
    for tid, end in after.threads.items():
        start = before.threads.get(tid)
        if start is None:
            continue
        run, wait = (end.run - start.run) / requests * 1e3, (end.wait - start.wait) / requests * 1e3
        total = totals.setdefault(end.process, [0.0, 0.0, 0.0])
        total[0] += run
        total[1] += wait
        total[2] += (end.involuntary - start.involuntary) / requests
        if run >= 0.005:
            runs = (end.slices - start.slices) / requests
            print(f"  {end.process:<14} {end.name:<16} {run:>10.3f} {wait:>11.3f} {runs:8.2f}")
    for process, (run, wait, preempted) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if run >= 0.005:
            print(
                f"  {process:<14} {'(all threads)':<16} {run:>10.3f} {wait:>11.3f}"
                f"   preempted {preempted:.2f}/req"
            )


async def window(way: Way, running: Running, in_flight: int, seconds: float) -> None:
    """One closed-loop window of ``way``, the counters read at its edges."""
    pids = {**running.pids, "load": os.getpid()}
    edges: list[Snapshot] = []

    async def probe() -> float:
        edges.append(snapshot(pids))
        return 0.0

    target = way.target(running, in_flight)
    try:
        calls = target.calls()
        await calls[0]()
        load = LoadSettings(seconds, warmup_s=1.5, settle_s=1.0)
        result = await closed_loop(way.label, calls, in_flight, running.pids, load, probe)
    finally:
        await target.close()
    report(way.label, result.rate, result.usage.seconds, edges[0], edges[1])


async def run(labels: Sequence[str], in_flight: int, seconds: float) -> None:
    """The mesh, then one window per way."""
    chosen = [w for w in all_ways() if w.server == "mesh" and w.label in labels]
    if missing := set(labels) - {w.label for w in chosen}:
        raise SystemExit(f"unknown ways {sorted(missing)}")
    settings = bench.parse_args(["--only", "mesh"])
    with tempfile.TemporaryDirectory(prefix="meshserve-run-queue-") as tmp:
        work = Path(tmp)
        bench.prepare(work)
        with bench.started("mesh", work, settings) as running:
            assert running is not None
            for way in chosen:
                await window(way, running, in_flight, seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, print."""
    install_sigterm_exit()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--ways", default="stage direct,Envoy gRPC")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    labels = [label.strip() for label in args.ways.split(",") if label.strip()]
    asyncio.run(run(labels, args.in_flight, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
