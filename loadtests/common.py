"""Load-generation helpers shared by the mesh benchmarks (``loadtests/bench_*.py``).

The request path of a benchmark, one line per piece::

    running_mesh()   the supervisor with free ports; stopped by PID on exit, even on Ctrl-C
    Target           where load goes: prepared gRPC bytes (GrpcTarget) or HTTP (HttpTarget)
    closed_loop()    N workers send back to back; a measured window after a warm-up
                     (workers: threads with lean blocking clients where they need no
                     more connections than the target has, or where a gRPC connection's
                     thread carries several at once; else asyncio tasks)
    CpuUsage         CPU of the processes under test (/proc) and of the whole machine
    format_table()   the printed report

CPU comes from ``/proc/<pid>/stat`` (utime + stime, all threads) read at the two
edges of the measured window; "others" is what the rest of the machine (a
neighbour on a shared box) used meanwhile, so a reader can tell a noisy run.
``bench_inference.py`` (one inference service, no mesh) takes the CPU
accounting, ``GrpcTarget`` and ``LoadResult`` from here but keeps its own loop:
it stops at the first failed request, and settles for a quieter machine
(``settle(..., quiet_cores=0.15)``) before each window.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import aiohttp
import grpc
import numpy as np
import yaml

from deploy.local.procfs import TICKS, child_pids, process_cpu_seconds, start_ticks

# Benchmarks import this module as `common` (loadtests/ on sys.path) or as
# `loadtests.common`; its sibling is imported by its full name either way.
if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtests.blocking_clients import KeepAlive, Pool, prepared_post
from loadtests.grpc_connection import GrpcConnection, Outcome, host_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = Path("~/.cache/meshserve/repository")
MESH_READY_MARKER = "MESHSERVE_MESH_READY"
V2_SERVICE = "inference.GRPCInferenceService"
INFER_METHOD = f"/{V2_SERVICE}/ModelInfer"

Call = Callable[[], Awaitable[None]]
"""One request, awaited to its end; raises on failure."""
BlockingCall = Callable[[], None]
"""One request, run to its end on the calling thread; raises on failure."""
Streams = Callable[[int, Callable[[], bool]], Iterator[Outcome]]
"""``streams(k, stop)``: k requests at once on one connection driven by the calling
thread, each restarted as it ends, until ``stop()``; yields how each ended."""
Probe = Callable[[], Awaitable[Any]]
"""State read at both edges of a measured window (e.g. ModelStatistics)."""

# -- CPU accounting (/proc) ----------------------------------------------------


def machine_cpu_seconds() -> float:
    """Busy CPU time of the whole machine (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / TICKS


def own_cpu_seconds() -> float:
    """This process's user + system CPU time (the load generator's cost)."""
    times = os.times()
    return times.user + times.system


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (NaN once gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def child_named(pid: int, name: str) -> int | None:
    """The child of ``pid`` whose command name is ``name`` (e.g. the real ``envoy``)."""
    for child in child_pids(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return child
    return None


@dataclass(frozen=True)
class CpuSample:
    """CPU counters at one edge of a window."""

    wall: float
    processes: dict[str, float]
    """CPU seconds by process label."""
    client: float
    machine: float


def sample_cpu(pids: Mapping[str, int]) -> CpuSample:
    """Read every counter now."""
    return CpuSample(
        wall=time.perf_counter(),
        processes={label: process_cpu_seconds(pid) for label, pid in pids.items()},
        client=own_cpu_seconds(),
        machine=machine_cpu_seconds(),
    )


@dataclass(frozen=True)
class CpuUsage:
    """CPU seconds used between two samples."""

    seconds: float
    processes: dict[str, float]
    client: float
    others: float
    """Cores the rest of the machine kept busy on average (not ours, not the client)."""

    @classmethod
    def between(cls, before: CpuSample, after: CpuSample) -> CpuUsage:
        """The difference of two samples."""
        processes = {k: after.processes[k] - before.processes[k] for k in before.processes}
        client = after.client - before.client
        seconds = after.wall - before.wall
        rest = after.machine - before.machine - client - sum(processes.values())
        return cls(seconds, processes, client, max(0.0, rest) / max(seconds, 1e-9))


async def settle(pids: Mapping[str, int], limit_s: float, quiet_cores: float = 0.25) -> float:
    """Wait (at most ``limit_s``) for a second when others use < ``quiet_cores``; their use.

    On a shared 2-core box a neighbour's burst halves the speed of what we
    measure, so each window starts in a quiet second when there is one.
    """
    deadline, others = time.perf_counter() + limit_s, 0.0
    while time.perf_counter() < deadline:
        before = sample_cpu(pids)
        await asyncio.sleep(1.0)
        others = CpuUsage.between(before, sample_cpu(pids)).others
        if others < quiet_cores:
            break
    return others


# -- the mesh ------------------------------------------------------------------


def missing_models(repository: Path, models: Sequence[str]) -> list[str]:
    """The models of ``models`` without a config.pbtxt in ``repository`` (checked up front)."""
    root = repository.expanduser()
    return [name for name in models if not (root / name / "config.pbtxt").is_file()]


@dataclass(frozen=True)
class MeshInfo:
    """Where a running mesh listens and which processes it is made of."""

    orchestrator: str
    edge: str
    """Envoy's port: HTTP/JSON, gRPC and grpc-web ("" in a mesh without the edge)."""
    pids: dict[str, int]
    """Process label -> PID: every service, ``envoy`` being the real Envoy binary."""
    supervisor_pid: int
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Process label -> its Prometheus /metrics port (services that serve one)."""


def install_sigterm_exit() -> None:
    """Make SIGTERM raise SystemExit, so ``finally`` blocks stop what we started."""

    def _exit(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def mesh_config(overrides: Mapping[str, Mapping[str, Any]], folder: Path) -> Path:
    """The default mesh YAML with ``services.<name>`` settings overridden, written to folder."""
    document = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
    for service, settings in overrides.items():
        document["services"].setdefault(service, {}).update(settings)
    path = folder / "mesh.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@contextlib.contextmanager
def running_mesh(
    repository: Path,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ready_timeout_s: float = 180.0,
) -> Iterator[MeshInfo]:
    """The whole local mesh (supervisor, ``--ports auto``); stopped by PID on exit."""
    with tempfile.TemporaryDirectory(prefix="meshserve-loadtest-") as tmp:
        folder = Path(tmp)
        log_path = folder / "mesh.log"
        config = mesh_config(overrides or {}, folder)
        proc = start_supervisor(repository, config, log_path, ready_timeout_s)
        started: dict[int, int | None] = {}
        try:
            info = _wait_ready(proc, ready_timeout_s, log_path)
            started = {pid: start_ticks(pid) for pid in info.pids.values()}
            yield info
        finally:
            _stop_mesh(proc, started)


def start_supervisor(
    repository: Path,
    config: Path,
    log_path: Path,
    ready_timeout_s: float,
    *,
    tree: Path = ROOT,
    environment: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """``python -m deploy.local.supervisor`` with free ports; its log goes to ``log_path``.
    ``tree``: the checkout whose code the mesh runs; ``environment``: set over ours.

    The supervisor gives up by itself after ``ready_timeout_s`` (its stdout then
    ends), so the blocking readline in ``_wait_ready`` cannot hang forever.
    """
    command = [sys.executable, "-m", "deploy.local.supervisor"]
    command += ["--model-repository", str(repository.expanduser())]
    command += ["--config", str(config), "--ports", "auto"]
    command += ["--ready-timeout-s", str(ready_timeout_s)]
    with log_path.open("w") as log:
        return subprocess.Popen(
            command,
            cwd=tree,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **(environment or {}), "PYTHONUNBUFFERED": "1"},
            # Own session: a terminal's Ctrl-C reaches only us, and we stop the mesh once.
            start_new_session=True,
        )


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float, log_path: Path) -> MeshInfo:
    """Read the supervisor's stdout until its ready line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith(MESH_READY_MARKER):
            return _mesh_info(json.loads(line.split(" ", 1)[1]), proc.pid)
    tail = log_path.read_text()[-3000:]
    raise RuntimeError(f"the mesh did not become ready; supervisor log tail:\n{tail}")


def _mesh_info(ready: Mapping[str, Any], supervisor_pid: int) -> MeshInfo:
    processes = ready["processes"]
    pids = {name: int(item["pid"]) for name, item in processes.items()}
    if "envoy" in pids:  # absent in a mesh without the edge (supervisor.edge: false)
        envoy = child_named(pids["envoy"], "envoy")
        if envoy is None:
            raise RuntimeError(f"no envoy child under gateway.envoy.main (pid {pids['envoy']})")
        pids["envoy_wrapper"], pids["envoy"] = pids["envoy"], envoy
    metrics = {
        name: int(item["metrics_port"])
        for name, item in processes.items()
        if int(item.get("metrics_port", -1)) > 0
    }
    return MeshInfo(
        ready["orchestrator"],
        processes.get("envoy", {}).get("grpc", ""),
        pids,
        supervisor_pid,
        metrics,
    )


def _stop_mesh(proc: subprocess.Popen[str], started: Mapping[int, int | None]) -> None:
    """SIGTERM the supervisor (it stops its children); then any child it left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    for pid, ticks in started.items():
        # Children live in their own sessions: a killed supervisor would orphan them.
        if ticks is not None and start_ticks(pid) == ticks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


# -- targets -------------------------------------------------------------------


class Target(Protocol):
    """Where a closed loop sends its requests."""

    def calls(self) -> list[Call]:
        """The calls workers take turns on (worker i uses call i modulo their number)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@dataclass(frozen=True)
class DualCall:
    """One request two ways: awaited on the event loop (``await call()``: a ``Call``), or
    run to its end on a worker thread (``call.blocking()``); ``closed_loop`` picks."""

    awaited: Call
    blocking: BlockingCall
    connections: int
    """How many connections the awaited way spreads its workers over: the blocking way
    opens one per thread, so at most this many threads may share the call."""
    streams: Streams | None = None
    """A third way, where one connection carries several requests at once: all the
    workers that share the call, on one thread."""

    def __call__(self) -> Awaitable[None]:
        """The awaited way."""
        return self.awaited()


class GrpcTarget:
    """Pre-serialised requests to one gRPC method over several HTTP/2 connections.

    Each connection is a grpc.aio channel for the event loop; for worker threads,
    a pool of ``GrpcConnection`` sockets making one call at a time (one per thread
    that uses it), and one more ``GrpcConnection`` that carries all the workers
    sharing it on one thread. Each connects on its first call.
    """

    def __init__(self, address: str, method: str, payload: bytes, connections: int) -> None:
        # A local subchannel pool gives each channel its own TCP connection.
        options = [("grpc.use_local_subchannel_pool", 1)]
        self._channels = [
            grpc.aio.insecure_channel(address, options=options) for _ in range(connections)
        ]
        # No serializers: the request goes out as the prepared bytes, the reply stays bytes.
        self._calls = [channel.unary_unary(method) for channel in self._channels]
        self._payload = payload
        where = host_port(address)
        # Worker threads only where the address is host:port (not unix:, dns:///...).
        self._pools: list[Pool] = []
        self._multiplexed: list[GrpcConnection] = []
        if where is not None:
            self._pools = [
                Pool(lambda: GrpcConnection(*where, method, payload)) for _ in range(connections)
            ]
            self._multiplexed = [
                GrpcConnection(*where, method, payload) for _ in range(connections)
            ]

    def calls(self) -> list[Call]:
        """One call per connection; worker i uses call i modulo their number."""
        if not self._pools:
            return [self._bind(call) for call in self._calls]
        return [
            DualCall(self._bind(call), pool.call, 1, connection.run)
            for call, pool, connection in zip(
                self._calls, self._pools, self._multiplexed, strict=True
            )
        ]

    def _bind(self, call: Any) -> Call:
        payload = self._payload

        async def one() -> None:
            await call(payload)

        return one

    async def close(self) -> None:
        """Close every channel and socket."""
        await asyncio.gather(*(channel.close() for channel in self._channels))
        for pool in self._pools:
            pool.close()
        for connection in self._multiplexed:
            connection.close()


class HttpTarget:
    """One prepared HTTP POST over keep-alive connections, one per worker: aiohttp's pool
    for the event loop, ``KeepAlive`` sockets (``blocking_clients``) for worker threads."""

    def __init__(
        self, url: str, body: bytes, connections: int, headers: Mapping[str, str] | None = None
    ) -> None:
        # HTTP/1.1 carries one request per connection at a time: one connection per worker.
        self._connections = connections
        connector = aiohttp.TCPConnector(limit=connections, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector)
        self._url, self._body = url, body
        self._headers = dict(headers or {"content-type": "application/json"})
        host, port, request = prepared_post(url, body, self._headers)
        self._pool = Pool(lambda: KeepAlive(host, port, request))

    def calls(self) -> list[Call]:
        """One call for every worker (the pools hand out connections)."""
        return [DualCall(self.post, self._pool.call, self._connections)]

    async def post(self) -> None:
        """Send the body; read the whole reply; raise unless 200."""
        async with self._session.post(self._url, data=self._body, headers=self._headers) as reply:
            text = await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {text[:200]!r}")

    async def fetch_json(self) -> Any:
        """The parsed reply to one request (to check the answer)."""
        async with self._session.post(self._url, data=self._body, headers=self._headers) as reply:
            reply.raise_for_status()
            return await reply.json()

    async def close(self) -> None:
        """Close both pools."""
        await self._session.close()
        self._pool.close()


# -- closed-loop load ----------------------------------------------------------


@dataclass
class _Window:
    """The measured interval: latencies of requests that complete inside it."""

    open: bool = False
    closed: bool = False
    latencies_ns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def record(self, outcome: int | Exception) -> bool:
        """One request's end (its latency in ns, or its failure), kept when it falls
        inside the window; True when it succeeded."""
        if isinstance(outcome, Exception):
            if self.open:
                self.errors.append(f"{type(outcome).__name__}: {outcome}"[:300])
            return False
        if self.open:
            self.latencies_ns.append(outcome)
        return True


@dataclass(frozen=True)
class LoadSettings:
    """Timing of one closed-loop run."""

    seconds: float
    """Measured window."""
    warmup_s: float
    """Load before the window (not counted)."""
    settle_s: float
    """Longest wait for a quiet machine before the window."""
    rounds: int = 1
    """Repeats of every measurement (interleaved); the fastest is kept."""
    client_work_us: float = 0.0
    """CPU each worker spends after an answer before its next request (its thread, or the
    event loop, kept busy), as a heavier client does; 0: none."""


def add_load_flags(
    parser: argparse.ArgumentParser,
    *,
    seconds: float,
    warmup_s: float,
    settle_s: float,
    in_flight: str,
) -> None:
    """The flags every closed-loop benchmark takes for its timing and concurrency."""
    parser.add_argument("--seconds", type=float, default=seconds, help="measured window per run")
    parser.add_argument("--rounds", type=int, default=2, help="repeats; the fastest is kept")
    parser.add_argument("--warmup", type=float, default=warmup_s, help="warm-up before each window")
    parser.add_argument("--settle", type=float, default=settle_s, help="longest wait for quiet")
    parser.add_argument("--in-flight", default=in_flight, help="concurrency levels")
    parser.add_argument("--quick", action="store_true", help="2 s windows, 1 round")


def load_from_flags(
    args: argparse.Namespace, quick_warmup_s: float = 1.0
) -> tuple[LoadSettings, tuple[int, ...]]:
    """The timing and the in-flight levels ``add_load_flags``'s flags asked for."""
    load = LoadSettings(
        seconds=2.0 if args.quick else args.seconds,
        warmup_s=quick_warmup_s if args.quick else args.warmup,
        settle_s=0.0 if args.quick else args.settle,
        rounds=1 if args.quick else max(1, args.rounds),
    )
    levels = tuple(int(part) for part in args.in_flight.split(",") if part.strip())
    return load, levels


@dataclass(frozen=True)
class LoadResult:
    """One closed-loop run over its measured window."""

    label: str
    in_flight: int
    latencies_ms: np.ndarray
    errors: int
    usage: CpuUsage
    probes: tuple[Any, Any] = (None, None)
    """What the probe returned at the window's start and end."""
    total: int = 0
    """Requests completed over the whole run, warm-up included."""

    @property
    def completed(self) -> int:
        """Requests completed inside the window."""
        return len(self.latencies_ms)

    @property
    def rate(self) -> float:
        """Completed requests per second."""
        return self.completed / self.usage.seconds

    def percentile(self, q: float) -> float:
        """Latency percentile ``q`` in ms (NaN without completions)."""
        return float(np.percentile(self.latencies_ms, q)) if self.completed else float("nan")

    @property
    def mean(self) -> float:
        """Mean latency in ms (NaN without completions)."""
        return float(np.mean(self.latencies_ms)) if self.completed else float("nan")

    def cpu_ms(self, *labels: str) -> float:
        """CPU ms per completed request of the named processes together."""
        return 1000.0 * sum(self.usage.processes.get(k, 0.0) for k in labels) / self.per()

    def client_cpu_ms(self) -> float:
        """CPU ms per completed request of this (load-generating) process."""
        return 1000.0 * self.usage.client / self.per()

    def per(self) -> int:
        """The divisor of per-request figures (never 0)."""
        return max(1, self.completed)


def _client_work(seconds: float) -> None:
    """Keep this thread busy (the GIL held) for ``seconds``: a client's own work."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _worker(call: Call, work_s: float, window: _Window) -> int:
    """Send back to back (``work_s`` of client work between); record latencies (and
    errors) that end inside the window.

    Returns the requests completed, warm-up and drain included."""
    completed = 0
    while not window.closed:
        started = time.perf_counter_ns()
        try:
            await call()
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            window.record(exc)
            await asyncio.sleep(0.05)  # no hot loop against a failing server
            continue
        completed += window.record(time.perf_counter_ns() - started)
        _client_work(work_s)
    return completed


def _thread_worker(call: BlockingCall, work_s: float, window: _Window) -> int:
    """``_worker`` on a thread of its own, with a blocking call."""
    completed = 0
    while not window.closed:
        started = time.perf_counter_ns()
        try:
            call()
        except Exception as exc:  # as _worker
            window.record(exc)
            time.sleep(0.05)
            continue
        completed += window.record(time.perf_counter_ns() - started)
        _client_work(work_s)
    return completed


def _stream_worker(streams: Streams, k: int, work_s: float, window: _Window) -> int:
    """``_thread_worker`` for ``k`` workers whose requests share one connection (a
    failed stream waits a moment itself: no hot loop)."""
    completed = 0
    for outcome in streams(k, lambda: window.closed):
        completed += window.record(outcome)
        _client_work(work_s)  # the next request waits for it, as in _thread_worker
    return completed


ThreadJob = Callable[[_Window], int]
"""What one worker thread runs: it sends until the window closes, returns its count."""


def _thread_jobs(calls: Sequence[Call], in_flight: int, work_s: float) -> list[ThreadJob] | None:
    """One job per worker thread where threads carry this load, else None.

    Threads, with the lean clients of ``blocking_clients``, wherever they open no
    more connections than the event loop's workers would. At 1 in flight the rate
    is the inverse of the latency and the client's own CPU is on every request's
    path: grpc.aio and aiohttp cost several times what perf_analyzer's C++ client
    does per call, so the closed loop read a slower server than perf_analyzer did;
    a blocking client on a thread costs less than perf_analyzer. With many in
    flight on a small host the client's CPU comes out of the server's, and the
    threads still cost less per call than the event loop, GIL and all. Where more
    workers share a call than it has connections (16 in flight over a GrpcTarget's
    4 HTTP/2 connections, as perf_analyzer is given), each connection gets one
    thread that keeps all of its workers' requests in flight at once (``streams``).
    """
    dual = [call for call in calls if isinstance(call, DualCall)]
    if not dual or len(dual) < len(calls):
        return None
    shares = [len(range(i, in_flight, len(dual))) for i in range(len(dual))]  # round robin
    if all(share <= call.connections for share, call in zip(shares, dual, strict=True)):
        return [
            partial(_thread_worker, dual[i % len(dual)].blocking, work_s) for i in range(in_flight)
        ]
    streams = [call.streams for call in dual if call.streams is not None]
    if len(streams) < len(dual):
        return None
    return [
        partial(_stream_worker, way, share, work_s)
        for way, share in zip(streams, shares, strict=True)
        if share
    ]


@contextlib.asynccontextmanager
async def _running(
    calls: Sequence[Call], in_flight: int, window: _Window, work_s: float
) -> AsyncIterator[list[asyncio.Future[int]]]:
    """``in_flight`` workers over ``calls`` (round robin), on threads or as tasks, each
    spending ``work_s`` after every answer; on exit they are stopped and waited for."""
    jobs = _thread_jobs(calls, in_flight, work_s)
    threads = ThreadPoolExecutor(len(jobs), "closed-loop") if jobs else None
    workers: list[asyncio.Future[int]]
    if threads is not None and jobs is not None:
        loop = asyncio.get_running_loop()
        workers = [loop.run_in_executor(threads, job, window) for job in jobs]
    else:
        workers = [
            asyncio.create_task(_worker(calls[i % len(calls)], work_s, window))
            for i in range(in_flight)
        ]
    try:
        yield workers
    finally:
        window.closed = True
        for worker in workers:
            worker.cancel()  # a task stops now; a thread after its call
        await asyncio.gather(*workers, return_exceptions=True)
        if threads is not None:
            # Not waited for: after an error a thread may be inside a call that only the
            # target's close() ends.
            threads.shutdown(wait=False)


async def closed_loop(
    label: str,
    calls: Sequence[Call],
    in_flight: int,
    pids: Mapping[str, int],
    settings: LoadSettings,
    probe: Probe | None = None,
) -> LoadResult:
    """``in_flight`` workers over ``calls`` (round robin): warm up, settle, measure a window.

    Workers are threads with blocking clients where every call is a ``DualCall``
    (``_thread_jobs``); otherwise asyncio tasks.
    ``probe`` runs just outside both window edges, so its own cost stays out.
    """
    window = _Window()
    async with _running(calls, in_flight, window, settings.client_work_us / 1e6) as workers:
        await asyncio.sleep(settings.warmup_s)
        await settle(pids, settings.settle_s)
        first = await probe() if probe else None
        before = sample_cpu(pids)
        window.open = True
        await asyncio.sleep(settings.seconds)
        window.open = False
        after = sample_cpu(pids)
        last = await probe() if probe else None
        window.closed = True
        total = sum(await asyncio.gather(*workers))
    if window.errors:
        print(f"  {label}@{in_flight}: {len(window.errors)} errors, first: {window.errors[0]}")
    latencies = np.asarray(window.latencies_ns, dtype=np.float64) / 1e6
    usage = CpuUsage.between(before, after)
    errors = len(window.errors)
    return LoadResult(label, in_flight, latencies, errors, usage, (first, last), total)


def best_runs(runs: Iterable[LoadResult]) -> list[LoadResult]:
    """Per (label, in-flight), the fastest run, in first-seen order.

    On a shared box a neighbour's burst only ever slows a run down, so the
    fastest of a few interleaved repeats is the least disturbed one.
    """
    best: dict[tuple[str, int], LoadResult] = {}
    for run in runs:
        key = (run.label, run.in_flight)
        if key not in best or run.rate > best[key].rate:
            best[key] = run
    return list(best.values())


# -- report --------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width table: first column left-aligned, the rest right-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = [_line(list(headers), widths), _line(["-" * w for w in widths], widths)]
    lines += [_line(row, widths) for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if np.isnan(value) else f"{value:.{1 if abs(value) >= 10 else 2}f}"
    return str(value)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    first = f"{cells[0]:<{widths[0]}}"
    return "  ".join([first, *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True))])


def load_average() -> str:
    """The 1/5/15-minute load averages, as /proc/loadavg prints them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
