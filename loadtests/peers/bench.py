"""The mesh against KServe, TorchServe and a FastAPI baseline: one model, one load, side by side.

    make bench-peers      (builds the peers' venvs, then runs this)
    python loadtests/peers/bench.py [--rounds 3] [--seconds 5] [--in-flight 16,1]
                                    [--only mesh,kserve,...] [--ways "REST,gRPC"]
                                    [--perf-analyzer] [--split-cores]
                                    [--client-work-us N] [--baseline DIR]
                                    [--plot docs/images/peers.png]

Every server serves the same TorchScript MLP 128 -> 512 -> 10 with one intra-op
thread (model.py), and gets the same closed-loop load: batch 1 per request, N
requests in flight, a warm-up, then a measured window. One server runs at a
time: each round starts a server, runs every way it speaks (ways.py), stops
it, and goes on to the next server; rounds interleave the servers. The mesh
runs with tracing and batch jobs off and only its inference stage (the
request path: Envoy, HTTP adapter, orchestrator, stage).

Printed per way: req/s (median of the rounds with little CPU steal, ≤ 0.15
cores, beside the median of all rounds), p50/p99 (median over rounds), server
CPU ms per request (every process of the server and its children, from
/proc), by process for the mesh, the load generator's own CPU, and the CPU
steal seen in each round (/proc/stat); then the ratios the project holds
itself to. ``--plot`` writes a PNG of req/s and server CPU per request.

``--perf-analyzer`` also runs Triton's perf_analyzer on each way it speaks,
right before or after the closed loop's window (the order alternates), on the
same terms (triton_load.py), and prints the two generators' agreement: per
way, then how many ways agree within 10% and what each client cost a request.
The project judges agreement at equal client cost (``--split-cores
--client-work-us 20``; docs/performance.md).
``--split-cores`` keeps the load generators (this process's threads and
perf_analyzer) on the last core and every server process on the others, as
if the load came from another host: on a small host the generator's own CPU
then no longer comes out of the server's, and the two generators measure the
same server.
``--client-work-us N`` has each closed-loop worker spend N µs of CPU between an
answer and its next request, as a heavier client does (perf_analyzer's C++ client
spends some 15-30 µs more per request than the closed loop's): at 16 in flight on
one core the server's CPU per request depends on how fast its clients turn answers
around (docs/performance.md).
``--only mesh-log`` adds the mesh with Envoy's access log on, ``--only
mesh-door`` the mesh with the HTTP front door inside the orchestrator
(``supervisor.http_front_door: orchestrator``, the default: pinned, for a
baseline tree), ``--only mesh-adapter`` the mesh with the HTTP adapter process
(``http_front_door: process``), ``--only mesh-wire`` the mesh with Envoy's ModelInfer
on the orchestrator's wire door, ``--only baseline --baseline DIR`` the mesh of
another source tree (an older commit's ``git archive``), each with the mesh's
ways, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import pickle
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    LoadResult,
    LoadSettings,
    closed_loop,
    install_sigterm_exit,
    load_average,
)
from peers import report, servers, triton_load
from peers.model import MODEL, mesh_repository, torchserve_store, write_torchscript
from peers.servers import Running
from peers.torchserve import java_missing, torchserve
from peers.triton_load import Agreement
from peers.ways import Way, all_ways, plain_json

from deploy.local.procfs import TICKS, descendants, tasks

SERVERS = (
    *("mesh", "kserve", "torchserve", "fastapi"),
    *("mesh-log", "baseline", "mesh-door", "mesh-adapter", "mesh-grpc", "mesh-grpcio"),
    *("mesh-wire", "mesh-stage-grpcio"),
)
"""mesh-log: the mesh with Envoy's access log on; baseline: the mesh of --baseline's tree;
mesh-door / mesh-adapter: the mesh with REST served by the orchestrator itself / by the
HTTP adapter process (http_front_door); mesh-grpc / mesh-wire: Envoy sends ModelInfer
to the orchestrator's gRPC port (the default: pinned, for a baseline tree) / to its wire
door over HTTP/1.1; mesh-grpcio: every gRPC port served by grpc.aio's server instead of
the one on asyncio (shared/h2grpc/); mesh-stage-grpcio: the orchestrator's streams to
the stages on grpc.aio's client instead of the one on asyncio (``stage_client``)."""
MESH_LIKE = {
    "mesh-log": "mesh+log: ",
    "baseline": "baseline: ",
    "mesh-door": "in-orch: ",
    "mesh-adapter": "adapter: ",
    "mesh-grpc": "no wire: ",
    "mesh-grpcio": "grpcio: ",
    "mesh-wire": "wire door: ",
    "mesh-stage-grpcio": "grpcio client: ",
}
VARIANTS: dict[str, dict[str, dict[str, object]]] = {
    "mesh-log": {"envoy": {"access_log": True}},
    "mesh-door": {"supervisor": {"http_front_door": "orchestrator"}},
    "mesh-adapter": {"supervisor": {"http_front_door": "process"}},
    "mesh-grpc": {"orchestrator": {"wire_port": -1}},
    "mesh-grpcio": {"defaults": {"grpc_server": "grpcio"}},
    "mesh-wire": {"orchestrator": {"wire_port": 0}},
    "mesh-stage-grpcio": {"orchestrator": {"stage_client": "grpcio"}},
}
"""Each mesh variant's changes to the mesh YAML (a service's settings, or the supervisor's)."""
CACHE = Path("~/.cache/meshserve").expanduser()


@dataclass(frozen=True)
class Settings:
    """One run's knobs (parsed once from the command line)."""

    load: LoadSettings
    in_flight: tuple[int, ...]
    servers: tuple[str, ...]
    kserve_python: Path
    fastapi_python: Path
    plot: Path | None
    rounds: int
    baseline: Path | None
    """Another source tree of the project (e.g. ``git archive`` of an older commit)."""
    ways: tuple[str, ...]
    """Run only the ways whose label contains one of these (all when empty)."""
    perf_analyzer: bool
    """Also load each way perf_analyzer speaks with it, and compare."""
    save: Path | None
    """Pickle the raw results here (to print or plot them again)."""
    server_cores: frozenset[int] | None = None
    """With --split-cores: the cores every server process is kept on (the load
    generators have the rest)."""
    rates: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    """The last closed-loop req/s of each (way, in flight), filled in as the run goes."""


def steal_seconds() -> float:
    """CPU time the hypervisor took from this machine so far (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / TICKS


async def _steal_probe() -> float:
    return steal_seconds()


@contextlib.contextmanager
def started(server: str, work: Path, settings: Settings) -> Iterator[Running | None]:
    """The server, running; None (with a line saying why) where it cannot start here."""
    model_pt = work / "model.pt"
    folder = Path(tempfile.mkdtemp(prefix=f"{server}-", dir=work))
    if server == "mesh" or server in MESH_LIKE:
        overrides = VARIANTS.get(server, {})
        root = settings.baseline if server == "baseline" and settings.baseline else servers.ROOT
        with servers.mesh(work / "repository", folder, overrides, root) as running:
            yield running
    elif server == "kserve":
        with servers.kserve(settings.kserve_python, model_pt, folder, MODEL) as running:
            yield running
    elif server == "fastapi":
        with servers.fastapi(settings.fastapi_python, model_pt, folder, plain_json()) as running:
            yield running
    elif (why := java_missing()) is not None:
        print(f"  torchserve: skipped ({why})")
        yield None
    else:
        with torchserve(work / "store", folder, MODEL) as (base, pids):
            yield Running(http=base.removeprefix("http://"), pids=pids)


async def measure(way: Way, running: Running, in_flight: int, load: LoadSettings) -> LoadResult:
    """One closed-loop window of one way; the steal counter read at its edges."""
    target = way.target(running, in_flight)
    try:
        calls = target.calls()
        await calls[0]()  # the way works before anything is timed
        return await closed_loop(
            way.label, calls, in_flight, running.pids, load, probe=_steal_probe
        )
    finally:
        await target.close()


async def one_round(
    number: int, work: Path, settings: Settings, ways: Sequence[Way], agreements: list[Agreement]
) -> list[LoadResult]:
    """Each server in turn: start it, measure its ways at every level, stop it."""
    results: list[LoadResult] = []
    for server in settings.servers:
        with started(server, work, settings) as running:
            if running is None:
                continue
            if settings.server_cores is not None:
                keep_on(running, settings.server_cores)
            chosen = [w for w in ways if w.server == server and _chosen(w, settings)]
            for index, way in enumerate(chosen):
                for in_flight in settings.in_flight:
                    # perf_analyzer first on every other way, the other way round next round.
                    pa_first = (number + index) % 2 == 0
                    result, agreement = await both(way, running, in_flight, settings, pa_first)
                    results.append(result)
                    print(f"  round {number} {report.round_line(result)}", flush=True)
                    if agreement is not None:
                        agreements.append(agreement)
                        print(f"  round {number} {triton_load.line(agreement)}", flush=True)
    return results


async def both(
    way: Way, running: Running, in_flight: int, settings: Settings, pa_first: bool
) -> tuple[LoadResult, Agreement | None]:
    """The closed loop's window and, with --perf-analyzer, perf_analyzer's run, in the
    given order; the same warm-up time for both (perf_analyzer's in requests, from the
    closed loop's last rate on this way)."""
    use_pa = settings.perf_analyzer and way.perf_analyzer is not None
    load = settings.load
    rate = settings.rates.get((way.label, in_flight), 300.0 * min(in_flight, 2))
    warmup = max(20, int(load.warmup_s * rate))
    run = None
    if use_pa and pa_first:
        run = await triton_load.measure(way, running, in_flight, load.seconds, warmup)
    result = await measure(way, running, in_flight, load)
    settings.rates[(way.label, in_flight)] = result.rate
    if use_pa and not pa_first:
        run = await triton_load.measure(way, running, in_flight, load.seconds, warmup)
    if run is None:
        return result, None
    return result, Agreement(way.label, in_flight, run, result, "pa" if pa_first else "loop")


def split_cores() -> tuple[frozenset[int], frozenset[int]]:
    """(the load generators' core, the servers' cores): the last core this process
    may use, and the others."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cores needs at least two cores")
    return frozenset(cores[-1:]), frozenset(cores[:-1])


def keep_on(running: Running, cores: frozenset[int]) -> None:
    """Every thread of the server's processes (and their children) on ``cores``;
    threads they start later inherit it."""
    for pid in {p for top in running.pids.values() for p in descendants(top)}:
        for task in tasks(pid):
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(int(task.name), cores)


def _chosen(way: Way, settings: Settings) -> bool:
    return not settings.ways or any(part in way.label for part in settings.ways)


def with_variants(ways: Sequence[Way]) -> list[Way]:
    """The mesh's ways again for each mesh variant, labelled with its prefix."""
    extra = [
        dataclasses.replace(way, server=server, label=prefix + way.label)
        for server, prefix in MESH_LIKE.items()
        for way in ways
        if way.server == "mesh"
    ]
    return [*ways, *extra]


def prepare(work: Path) -> None:
    """The model, the mesh's repository and TorchServe's store."""
    model_pt = write_torchscript(work)
    mesh_repository(model_pt, work / "repository")
    if java_missing() is None:
        torchserve_store(model_pt, work)


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--settle", type=float, default=1.0, help="longest wait for quiet")
    parser.add_argument("--in-flight", default="16,1")
    parser.add_argument("--only", default=",".join(SERVERS[:4]), help="servers to run")
    parser.add_argument("--venvs", type=Path, default=CACHE / "venvs")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    parser.add_argument("--baseline", type=Path, default=None, help="a tree for baseline")
    parser.add_argument("--ways", default="", help="comma-separated label parts to keep")
    parser.add_argument(
        "--perf-analyzer", action="store_true", help="compare with Triton's perf_analyzer"
    )
    parser.add_argument("--save", type=Path, default=None, help="pickle the raw results here")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="load generators on the last core, servers on the others",
    )
    parser.add_argument(
        "--client-work-us",
        type=float,
        default=0.0,
        help="CPU µs each closed-loop worker spends between an answer and its next request",
    )
    args = parser.parse_args(argv)
    chosen = tuple(s for s in args.only.split(",") if s)
    unknown = set(chosen) - set(SERVERS)
    if "baseline" in chosen and args.baseline is None:
        parser.error("--only baseline needs --baseline DIR")
    if unknown:
        parser.error(f"--only: unknown servers {sorted(unknown)}; choose from {SERVERS}")
    return Settings(
        LoadSettings(args.seconds, args.warmup, args.settle, client_work_us=args.client_work_us),
        tuple(int(x) for x in args.in_flight.split(",") if x),
        chosen,
        args.venvs / "peers-kserve-0.21.0" / "bin" / "python",
        args.venvs / "peers-fastapi" / "bin" / "python",
        args.plot,
        max(1, args.rounds),
        args.baseline.resolve() if args.baseline else None,
        tuple(part for part in args.ways.split(",") if part),
        args.perf_analyzer,
        args.save,
        split_cores()[1] if args.split_cores else None,
    )


async def run(settings: Settings, agreements: list[Agreement]) -> list[LoadResult]:
    """Prepare the model, then every round."""
    results: list[LoadResult] = []
    with tempfile.TemporaryDirectory(prefix="meshserve-peers-") as tmp:
        work = Path(tmp)
        prepare(work)
        for number in range(1, settings.rounds + 1):
            ways = with_variants(all_ways())
            results += await one_round(number, work, settings, ways, agreements)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print, plot."""
    install_sigterm_exit()
    settings = parse_args(argv)
    for name, python in (("kserve", settings.kserve_python), ("fastapi", settings.fastapi_python)):
        if name in settings.servers and not python.exists():
            print(f"{python} is missing: run `make bench-peers` (it builds the peers' venvs)")
            return 2
    print(f"load average at start {load_average()}", flush=True)
    if settings.server_cores is not None:
        # Before any thread or child starts: they all inherit the generators' core.
        client, server = split_cores()
        os.sched_setaffinity(0, client)
        print(f"load generators on cores {sorted(client)}, servers on {sorted(server)}")
    if settings.perf_analyzer and (why := triton_load.missing()) is not None:
        print(why)
        return 2
    agreements: list[Agreement] = []
    results = asyncio.run(run(settings, agreements))
    if settings.save is not None:
        settings.save.write_bytes(pickle.dumps((results, agreements)))
    summaries = report.summarise(results)
    print()
    print(report.table(summaries))
    print()
    print(report.ratios(summaries))
    if agreements:
        print()
        print(triton_load.table(agreements))
    print(f"load average at end {load_average()}")
    if settings.plot is not None:
        report.plot(summaries, settings.plot)
        print(f"plot: {settings.plot}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
