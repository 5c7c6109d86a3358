"""The local mesh supervisor: every service as its own process.

    python -m deploy.local.supervisor --model-repository DIR [--config mesh.yaml]
                                      [--ports auto] [--replicas inference=2] [--colocate]

Stage services start first; once each has printed its ready line, the
orchestrator starts with their addresses. A process that exits unexpectedly
is restarted on the same ports with exponential backoff (reset once it has run
a while), once whatever it left behind has ended; a stage with ``standby: true``
is restarted by a process that already imported its modules
(deploy/local/standby.py).

The port plan (every gRPC, HTTP and metrics port; replica i of a stage on its
ports + i * ``replica_port_step``) is checked before anything starts
(deploy/local/port_plan.py). SIGTERM or Ctrl-C, at any phase (starting,
running, restarting), stops everything: the edge and the orchestrator first,
so no new work reaches the stages, then the stages; each service with all it
started (vLLM's engine processes too), by PID, SIGKILL after ``--grace-s``
(deploy/local/process_tree.py). A second signal kills at once.

While a CPU engine that bound its worker to some cores is busy, the rest of
the mesh is kept off those cores (``cpu_placement: auto``; see
deploy/local/placement.py). Every process learns which cores its engines may
take from ``MESHSERVE_ENGINE_CORES`` (the contract in shared/engine_cores.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from deploy.local.colocation import colocated
from deploy.local.http_front_door import (
    announce_front_door,
    front_door_address,
    front_door_listeners,
    place_front_door,
)
from deploy.local.placement import CorePlacer, Placement
from deploy.local.port_plan import Listener, PortPlanError, check_ports
from deploy.local.reaper import Reaper
from deploy.local.redis_server import JobsPlan, plan_jobs
from deploy.local.service_process import ManagedProcess, ProcessSpec, log
from deploy.local.supervisor_metrics import metrics_port, serve_metrics, stop_metrics
from deploy.local.torchserve_edge import torchserve_edge
from deploy.local.trace_store import TracePlan, plan_traces, route_edge
from deploy.local.wire import open_wire, wire_listeners
from shared.engine_cores import ENGINE_CORES_ENV, engine_cores, format_cores
from shared.ports import free_port

MESH_READY_MARKER = "MESHSERVE_MESH_READY"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "mesh.yaml"
PLACEMENT_LOOK_S = 1.0
"""How often the engines' CPU time is read (a busy/idle change re-places at once)."""
PLACEMENT_FULL_PASS_LOOKS = 5
"""Every this many looks, a full pass finds new processes and threads."""
REPLICA_PORT_STEP = 100
"""Replica i of a stage listens on its ports + i * this (mesh.yaml's ``replica_port_step``)."""


class FreshPorts:
    """Ports for --ports auto, each free when picked and never handed out twice:
    the kernel may give a just-closed probe's port out again, and every part of
    one mesh's plan (stages, queue, trace store, TorchServe's edge) picks from
    this one."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def __call__(self) -> int:
        while (port := free_port()) in self._given:
            pass
        self._given.add(port)
        return port


def plan(
    mesh: dict[str, Any],
    repository: Path,
    auto_ports: bool,
    replicas: dict[str, int],
    fresh_port: Callable[[], int] | None = None,
) -> tuple[list[ProcessSpec], ProcessSpec, list[ProcessSpec]]:
    """The stage processes, the orchestrator, and the edge (adapter, Envoy), with ports
    (with ``auto_ports``, from ``fresh_port``: a FreshPorts of this plan's own by default)."""
    services = mesh.get("services") or {}
    step = int((mesh.get("supervisor") or {}).get("replica_port_step", REPLICA_PORT_STEP))
    if step < 1:
        raise PortPlanError(f"supervisor.replica_port_step must be at least 1, not {step}")
    fresh_port = fresh_port or FreshPorts()

    def ports(service: str, index: int) -> tuple[int, int]:
        if auto_ports:
            return fresh_port(), fresh_port()
        settings = services.get(service) or {}
        metrics = int(settings.get("metrics_port", -1))
        port = int(settings.get("grpc_port", settings.get("http_port", 0)))
        return _replica_port(port, index, step), _replica_port(metrics, index, step)

    grpc_port, metrics_port = ports("orchestrator", 0)
    host = (mesh.get("defaults") or {}).get("host", "127.0.0.1")
    # Stages learn the orchestrator's address: their python models call other
    # models through it (BLS).
    stage_args = ("--model-repository", str(repository), "--orchestrator", f"{host}:{grpc_port}")
    stages: list[ProcessSpec] = []
    for stage in (mesh.get("supervisor") or {}).get("stages", []):
        count = replicas.get(stage["name"], int(stage.get("replicas", 1)))
        for index in range(count):
            stage_port, stage_metrics = ports(stage["name"], index)
            stages.append(
                ProcessSpec(
                    f"{stage['name']}-{index}",
                    stage["name"],
                    stage["module"],
                    stage_port,
                    stage_metrics,
                    stage_args,
                    # An imported process waits to take over a restart (standby.py).
                    standby=bool(stage.get("standby", False)),
                )
            )
    endpoints = [arg for s in stages for arg in ("--stages", f"{s.stage}={host}:{s.grpc_port}")]
    orchestrator = ProcessSpec(
        "orchestrator",
        "orchestrator",
        "services.orchestrator.main",
        grpc_port,
        metrics_port,
        ("--model-repository", str(repository), *endpoints),
        # Every front door goes through it: a restart that skips the imports
        # gives gRPC and REST back sooner.
        standby=bool((mesh.get("supervisor") or {}).get("orchestrator_standby", False)),
    )
    edge = (
        _edge(ports, f"{host}:{orchestrator.grpc_port}", host)
        if ((mesh.get("supervisor") or {}).get("edge", False))
        else []
    )
    # The orchestrator reads its wire_port from the YAML too: the flag always wins.
    # Unset, the door stays shut: Envoy's HTTP/2 to the gRPC port costs less.
    wire = int((services.get("orchestrator") or {}).get("wire_port", -1)) if edge else -1
    wire = fresh_port() if wire == 0 or (wire > 0 and auto_ports) else wire
    orchestrator, edge = open_wire(orchestrator, edge, host, wire)
    orchestrator, edge = place_front_door(mesh, orchestrator, edge)
    return stages, orchestrator, edge


def _replica_port(port: int, index: int, step: int) -> int:
    # 0 (any free port) and -1 (off) stay what they are for every replica.
    return port + index * step if port > 0 else port


def listeners(specs: Sequence[ProcessSpec]) -> list[Listener]:
    """Every port the processes of ``specs`` will listen on, for the port plan's check."""
    found = []
    for spec in specs:
        role = "HTTP" if spec.port_flag == "--http-port" else "gRPC"
        found += [Listener(spec.name, role, spec.grpc_port)]
        found += [Listener(spec.name, "metrics", spec.metrics_port)]
        found += front_door_listeners(spec)
        found += wire_listeners(spec)
    return found


def _edge(ports: Any, orchestrator: str, host: str) -> list[ProcessSpec]:
    """The HTTP adapter and Envoy, both pointed at the orchestrator."""
    adapter_port, adapter_metrics = ports("http_adapter", 0)
    envoy_port, envoy_metrics = ports("envoy", 0)
    adapter = ProcessSpec(
        "http_adapter",
        "http_adapter",
        "gateway.http.main",
        adapter_port,
        adapter_metrics,
        ("--orchestrator", orchestrator),
        port_flag="--http-port",
    )
    envoy = ProcessSpec(
        "envoy",
        "envoy",
        "gateway.envoy.main",
        envoy_port,
        envoy_metrics,  # Envoy's own statistics (gateway/envoy/stats.py)
        ("--orchestrator", orchestrator, "--http-adapter", f"{host}:{adapter_port}"),
    )
    return [adapter, envoy]


@dataclass
class Shutdown:
    """What SIGTERM or Ctrl-C ask of the supervisor: stop; asked again, kill at once."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    phase: str = "starting"
    """What the mesh is doing, for the log line that says a stop was asked for."""

    @classmethod
    def listening(cls) -> Shutdown:
        """A Shutdown that SIGTERM and SIGINT (Ctrl-C) now request."""
        shutdown = cls()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.request, sig)
        return shutdown

    def request(self, sig: signal.Signals) -> None:
        """The signal handler."""
        if self.stop.is_set():
            log(f"{sig.name} again: killing every process still stopping")
            self.hurry.set()
            return
        log(f"{sig.name} while {self.phase}: stopping the mesh")
        self.stop.set()


def read_mesh(config: Path, colocate: bool) -> dict[str, Any]:
    """The mesh YAML; with ``colocate``, its stages in one process (colocation.py)."""
    mesh: dict[str, Any] = yaml.safe_load(config.read_text()) or {}
    return colocated(mesh) if colocate else mesh


@dataclass(frozen=True)
class MeshPlan:
    """Every process of one mesh with its ports, and every port it will listen on."""

    stages: list[ProcessSpec]
    """The stages and the queue's Redis."""
    orchestrator: ProcessSpec
    edge: list[ProcessSpec]
    """The HTTP adapter, Envoy and the batch workers."""
    jobs: JobsPlan
    traces: TracePlan
    listeners: list[Listener]
    host: str


def plan_mesh(
    mesh: dict[str, Any], repository: Path, auto_ports: bool, replicas: dict[str, int]
) -> MeshPlan:
    """The whole mesh's plan; with ``auto_ports`` every port comes from one FreshPorts,
    so no two of its listeners are handed the same one."""
    fresh = FreshPorts()
    stages, orchestrator, edge = plan(mesh, repository, auto_ports, replicas, fresh)
    host = (mesh.get("defaults") or {}).get("host", "127.0.0.1")
    jobs = plan_jobs(mesh, auto_ports, f"{host}:{orchestrator.grpc_port}", fresh)
    stages, edge = [*stages, *jobs.redis], [*edge, *jobs.workers]
    planned = listeners([*stages, orchestrator, *edge])
    traces = plan_traces(mesh, auto_ports, host, fresh)
    edge = route_edge(edge, traces)
    edge, management = torchserve_edge(edge, mesh, repository, auto_ports, fresh)
    every = [*planned, *traces.listeners, *management]
    return MeshPlan(stages, orchestrator, edge, jobs, traces, every, host)


async def supervise(args: argparse.Namespace) -> int:
    """Start the mesh, print where it listens, run until SIGTERM/SIGINT."""
    mesh = read_mesh(args.config, args.colocate)
    settings = mesh.get("supervisor") or {}
    backoff = tuple(settings.get("restart_backoff_s", [0.5, 10.0]))
    replicas = dict(item.split("=", 1) for item in args.replicas)
    repository = args.model_repository.expanduser().resolve()
    try:
        whole = plan_mesh(
            mesh, repository, args.ports == "auto", {k: int(v) for k, v in replicas.items()}
        )
        check_ports(whole.listeners, whole.host)
    except PortPlanError as exc:
        log(f"not starting the mesh: {exc}")
        return 2
    stage_specs, orchestrator_spec, edge_specs = whole.stages, whole.orchestrator, whole.edge
    jobs, traces, host = whole.jobs, whole.traces, whole.host
    shutdown = Shutdown.listening()
    cores = engine_cores()
    # Ends the services should this process be killed without a chance to stop them.
    reaper = Reaper.start(args.grace_s)

    def managed_group(specs: Sequence[ProcessSpec]) -> list[ManagedProcess]:
        environment = {
            ENGINE_CORES_ENV: format_cores(cores),
            **jobs.environment,
            **traces.environment,
        }
        delays = (float(backoff[0]), float(backoff[1]))
        return [
            ManagedProcess(
                spec,
                args.config,
                delays,
                environment,
                grace_s=args.grace_s,
                hurry=shutdown.hurry,
                reaper=reaper,
            )
            for spec in specs
        ]

    tracing = managed_group(traces.specs)
    managed = managed_group(stage_specs)
    [orchestrator] = managed_group([orchestrator_spec])
    edge = managed_group(edge_specs)
    # Restart counts: only the supervisor sees a process go and come back.
    port = metrics_port(settings, args.ports == "auto")
    metrics = serve_metrics(host, port, [*managed, orchestrator, *edge])
    tasks: list[asyncio.Task[None]] = []
    try:
        # Inside out: the trace store (every other process exports to it), stages,
        # then the orchestrator, then the edge; each group starts once the one it
        # talks to is ready.
        starts = [("trace store", tracing), ("stages", managed), ("orchestrator", [orchestrator])]
        for name, group in (*starts, ("edge", edge)):
            shutdown.phase = f"starting (waiting for the {name} to be ready)"
            tasks += [asyncio.create_task(m.run()) for m in group]
            if not await _wait_ready(group, shutdown.stop, args.ready_timeout_s):
                return 0 if shutdown.stop.is_set() else 1
        _announce(orchestrator, [*managed, *edge], repository, metrics)
        if traces.query_address:
            log(f"traces: http://{traces.query_address}/traces (and Jaeger's /api/traces)")
        if settings.get("cpu_placement", "auto") == "auto":
            processes = [*managed, orchestrator, *edge]
            tasks.append(asyncio.create_task(_keep_placed(processes, cores)))
        shutdown.phase = "running"
        await shutdown.stop.wait()
        return 0
    finally:
        stop_metrics(metrics)
        await _stop_all([edge, [orchestrator], managed, tracing], tasks)
        await asyncio.to_thread(reaper.close)


async def _stop_all(
    groups: Sequence[Sequence[ManagedProcess]], tasks: Sequence[asyncio.Task[None]]
) -> None:
    """Stop ``groups`` in turn (each process and all it started), then the tasks."""
    began = time.monotonic()
    # Outside in: the edge first, then the orchestrator, then the stages.
    for group in groups:
        await asyncio.gather(*(m.stop() for m in group))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    log(f"mesh stopped in {time.monotonic() - began:.1f}s: every process it started has exited")


async def _keep_placed(
    processes: Sequence[ManagedProcess], cores: frozenset[int] | None = None
) -> None:
    """Keep the mesh off a busy CPU engine's cores (deploy/local/placement.py).

    Every ``PLACEMENT_LOOK_S`` the engines' CPU time is read; a change between
    busy and idle re-places at once. A full pass (new processes and threads:
    restarts, reloads) runs every ``PLACEMENT_FULL_PASS_LOOKS`` looks. A pass
    that fails is logged (once while the same error repeats) and the next look
    tries again: stopping would leave the mesh as the last pass put it.
    """
    placer = CorePlacer(cores or engine_cores())
    last: frozenset[int] = frozenset()
    failed = ""
    for tick in itertools.count():
        full = tick % PLACEMENT_FULL_PASS_LOOKS == 0
        try:
            if full or placer.busy_changed():
                pids = [p.proc.pid for p in processes if p.proc and p.proc.returncode is None]
                placement = placer.place(pids)
                failed = ""
                if placement.niced:
                    log(
                        f"CPU placement: {placement.niced} thread(s) of the engine's driver "
                        "(it polls while its worker computes) now yield to the mesh"
                    )
                if placement.service_cores != last:
                    last = placement.service_cores
                    log(_describe(placement))
        except Exception as exc:  # /proc races are suppressed inside; anything else is a bug,
            # but one bad pass must not leave the mesh narrowed (or crowding) for good.
            if repr(exc) != failed:
                failed = repr(exc)
                log(f"CPU placement: a pass failed, trying again at the next look: {exc!r}")
        await asyncio.sleep(PLACEMENT_LOOK_S)


def _describe(placement: Placement) -> str:
    if placement.service_cores:
        return (
            f"CPU placement: the engine on cores {sorted(placement.engine_cores)} is busy; "
            f"the rest of the mesh runs on {sorted(placement.service_cores)}"
        )
    return "CPU placement: every process may use every core"


async def _wait_ready(
    processes: Sequence[ManagedProcess], stop: asyncio.Event, timeout_s: float
) -> bool:
    async def all_ready() -> None:
        await asyncio.gather(*(p.ready.wait() for p in processes))

    waiting: asyncio.Task[None] = asyncio.create_task(all_ready())
    stopped: asyncio.Task[bool] = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait(
        {waiting, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    stopped.cancel()
    if waiting not in done:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        slow = [p.spec.name for p in processes if not p.ready.is_set()]
        if not stop.is_set():
            log(f"not ready within {timeout_s:.0f}s: {', '.join(slow)}")
        return False
    return True


def _announce(
    orchestrator: ManagedProcess,
    stages: Sequence[ManagedProcess],
    repository: Path,
    metrics: ThreadingHTTPServer | None = None,
) -> None:
    info = {
        "repository": str(repository),
        "orchestrator": orchestrator.address,
        "orchestrator_metrics_port": orchestrator.spec.metrics_port,
        "supervisor_metrics_port": metrics.server_address[1] if metrics else -1,
        "processes": {
            p.spec.name: {
                "grpc": p.address,
                "pid": p.proc.pid if p.proc else None,
                "metrics_port": p.spec.metrics_port,
            }
            for p in [orchestrator, *stages]
        },
        "http_front_door": front_door_address(orchestrator, stages),
    }
    log(f"mesh ready: KServe v2 gRPC on {orchestrator.address}")
    edge = [p for p in stages if p.spec.stage == "envoy"]
    if edge:
        log(f"edge (Envoy): HTTP/JSON, gRPC and grpc-web on {edge[0].address}")
        log(announce_front_door(orchestrator, stages))
    if orchestrator.spec.metrics_port > 0:
        host = orchestrator.address.rsplit(":", 1)[0]
        log(f"metrics on http://{host}:{orchestrator.spec.metrics_port}/metrics")
    for process in stages:
        log(f"  {process.spec.name:<14} {process.address}")
    print(f"{MESH_READY_MARKER} {json.dumps(info)}", flush=True)


def add_arguments(parser: argparse.ArgumentParser, repository_default: str = "") -> None:
    """The supervisor's flags, on ``parser`` (``meshserve serve`` shares them).

    ``repository_default`` says what an omitted ``--model-repository`` means;
    empty: the flag is required.
    """
    parser.add_argument(
        "--model-repository",
        type=Path,
        required=not repository_default,
        help="Triton-layout model repository every stage serves from "
        f"({repository_default or 'required'})",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="mesh YAML: ports, replicas and each service's settings (default: %(default)s)",
    )
    parser.add_argument(
        "--ports",
        choices=["config", "auto"],
        default="config",
        help="ports from the mesh YAML, or free ports chosen at start (default: %(default)s)",
    )
    parser.add_argument(
        "--replicas",
        action="append",
        default=[],
        help="stage=count, e.g. inference=2 (repeatable; default: the mesh YAML's counts)",
    )
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="run the tokenizer, preprocess, inference and postprocess stages in one process, "
        "which runs the ensembles of their models whole (one hop instead of one per step)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=15.0,
        help="on stop, seconds each service may drain before it is killed (default: %(default)s)",
    )
    parser.add_argument(
        "--ready-timeout-s",
        type=float,
        default=300.0,
        help="seconds each group of services may take to become ready before the mesh gives "
        "up (default: %(default)s)",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags of the supervisor."""
    parser = argparse.ArgumentParser(
        prog="meshserve-local",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Run the mesh that ``args`` (the flags of ``add_arguments``) describe; the exit status."""
    return asyncio.run(supervise(args))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the local mesh until SIGTERM or Ctrl-C."""
    raise SystemExit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
