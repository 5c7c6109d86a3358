"""An ensemble through the mesh vs the same three steps in one process.

    python loadtests/bench_pipeline.py [--pipeline image_classifier|text_embedding]
        [--tracing on|off] [--seconds 5] [--rounds 2] [--in-flight 1,16,64] [--quick]
        [--layout separate|colocated|both] [--without-edge]

In order:

1. the floor, in this process (pipeline_floor.py), with the stages' own instance
   classes: for ``image_classifier`` image preprocessing, MobileNetV2 in ONNX
   Runtime (same intra-op threads, inter-op 1, spinning off) and top-5; for
   ``text_embedding`` the MiniLM tokenizer, MiniLM in ONNX Runtime and mean pooling:
   - at 1 in flight: the three steps one after the other, one input at a time;
   - at N in flight: batches of N inputs, the first step per input in a thread
     pool (one thread per core), one ORT run per batch, one last step per batch;
     tried with the next batch's first step overlapping this batch's ORT run and
     without, and the faster is the floor. Each input's latency is its batch's
     time from the start of its first step to the end of its last;
2. the whole mesh (``deploy.local.supervisor --ports auto``) on a repository of
   the ensemble and its steps alone (links into the prepared one: no LLM starts);
   Tracing is off unless ``--tracing on`` (the mesh YAML's default: every span
   to the local trace store; bench_tracing.py measures what that costs);
   ``--layout colocated`` runs the steps' stages in one process instead
   (services/colocated/: it runs the ensemble whole), ``both`` one mesh then the other;
3. closed-loop load on the orchestrator (common.closed_loop; ModelInfer of the ensemble,
   one input per request, several HTTP/2 connections) at each in-flight level,
   warmed up before a measured window; CPU of each mesh process from /proc;
   per-stage server-side time from ModelStatistics across the window;
4. tables and ratios; the mesh is stopped by PID (also on error and Ctrl-C).

Every measurement is repeated ``--rounds`` times (the mesh's interleaved across
levels) and the fastest run is reported: on a shared machine a neighbour only
ever slows a run down. The "others" column says how busy the rest of the
machine was during the run that is shown. Because the host also drifts over
minutes (the floor alone has moved by a third between runs), each of the mesh's
rounds above 1 in flight runs one more floor window right before its own, and
"paired rounds" gives each round's mesh/floor ratio and their median.

The stage table shows, per model, its own measure of a request (ModelStatistics
success time, queue included), its queue wait and its compute per row; at 1 in
flight the "floor ms" column is the same step timed in this process.

Hops at 1 in flight: a request makes four gRPC round trips the floor does not:
client -> orchestrator, and orchestrator -> preprocess, -> inference,
-> postprocess. "Added p50 per hop" is (mesh p50 - floor p50) / 4; it includes
the serialisation, copies and queueing (dynamic batching delays) of each hop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np
import yaml
from common import (
    DEFAULT_REPOSITORY,
    INFER_METHOD,
    ROOT,
    Call,
    CpuUsage,
    GrpcTarget,
    LoadResult,
    LoadSettings,
    MeshInfo,
    add_load_flags,
    best_runs,
    closed_loop,
    format_table,
    install_sigterm_exit,
    load_average,
    load_from_flags,
    missing_models,
    sample_cpu,
    start_supervisor,
)
from common import _stop_mesh as stop_mesh
from common import _wait_ready as wait_ready
from pipeline_floor import FLOORS, StepFloor

from deploy.local.colocation import colocated
from deploy.local.procfs import start_ticks
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.allocator import keep_large_blocks
from shared.tensors import decode_outputs, encode_inputs

STAGE_PROCESSES = ("preprocess-0", "tokenizer-0", "inference-0", "postprocess-0")
"""The stage processes of the local mesh; a pipeline's steps run in three of them."""
PROCESS_OF = {
    "image_preprocess": "preprocess-0",
    "minilm_tokenizer": "tokenizer-0",
    "mobilenet_v2_onnx": "inference-0",
    "minilm": "inference-0",
    "imagenet_top5": "postprocess-0",
    "mean_pool": "postprocess-0",
}
"""Each step model -> the mesh process that hosts it."""
COLOCATED = "colocated-0"
"""The one stage process of ``--layout colocated``."""
INPUTS = {"image_classifier": "IMAGE", "text_embedding": "TEXT"}
"""Each ensemble's one input (BYTES [1, 1])."""
SENTENCE = b"The quick brown fox jumps over the lazy dog near the river bank."
DEADLINE_S = 60.0
"""The deadline of "mesh+deadline" requests: long enough never to pass."""


@dataclass(frozen=True)
class Pipeline:
    """The ensemble under test and its steps."""

    ensemble: str
    steps: tuple[str, str, str]
    colocated: bool = False
    """The steps' stages in one process (services/colocated/), which runs the
    ensemble whole; else each stage in its own process."""

    @property
    def stages(self) -> dict[str, str]:
        """Step model -> the process that hosts it."""
        return {step: COLOCATED if self.colocated else PROCESS_OF[step] for step in self.steps}

    @property
    def processes(self) -> tuple[str, ...]:
        """The stage processes a request runs in, each once."""
        return tuple(dict.fromkeys(self.stages.values()))

    @property
    def serving(self) -> tuple[str, ...]:
        """The processes a request runs in."""
        return ("orchestrator", *self.processes)

    @property
    def hops(self) -> int:
        """gRPC round trips per request: client -> orchestrator, then one to each
        step's stage (one in all when the stages share a process)."""
        return 2 if self.colocated else 1 + len(self.steps)

    @property
    def models(self) -> tuple[str, ...]:
        """The ensemble and its steps."""
        return (self.ensemble, *self.steps)


class MeshLayout(Protocol):
    """Which models a mesh serves, and whether their stages share one process."""

    @property
    def models(self) -> tuple[str, ...]: ...

    @property
    def colocated(self) -> bool: ...


@dataclass(frozen=True)
class Settings:
    """One benchmark run's knobs (parsed once from the command line)."""

    repository: Path
    """The prepared model repository (python -m models.prepare)."""
    pipeline: str
    """The ensemble: image_classifier or text_embedding."""
    image: str
    """A scikit-image sample photo, sent as encoded bytes (image_classifier)."""
    tracing: bool
    """Spans to the local trace store (the mesh YAML's default) or none."""
    load: LoadSettings
    """Warm-up, window and settle time of each measurement."""
    in_flight: tuple[int, ...]
    """Concurrency levels; 1 gives the latency per hop, the rest throughput."""
    connections: int
    """gRPC connections the mesh load is spread over."""
    threads: int
    """First-step threads of the batched floor."""
    with_deadline: bool
    """Also load the mesh with a deadline on every request ("mesh+deadline")."""
    layouts: tuple[bool, ...]
    """The meshes to load, one after the other: False each stage in its own
    process, True the stages in one (``Pipeline.colocated``)."""
    edge: bool = True
    """Start the edge (Envoy) with the mesh; the load goes to the orchestrator either way."""


# -- the floor: the three steps in one process ---------------------------------


@dataclass(frozen=True)
class FloorRuns:
    """The floor at each in-flight level, and its steps' mean times at 1 in flight."""

    results: dict[int, LoadResult]
    steps_ms: dict[str, float]
    """Model name of the step -> mean ms per input, one input at a time."""
    overlap: dict[int, bool]
    """Batch size -> whether the paired windows overlap the first step (the mode
    with the higher median rate)."""


def answer(floor: StepFloor, items: list[Any]) -> Any:
    """The pipeline's answer for prepared items (the second and third steps)."""
    return floor.third(floor.second(floor.stack(items)))


def floor_sequential(
    floor: StepFloor, data: bytes, seconds: float
) -> tuple[LoadResult, np.ndarray]:
    """One input at a time through the three steps; also each step's time [runs, 3] in ms."""
    for _ in range(3):  # ORT allocates its arenas on the first runs
        answer(floor, [floor.first(data)])
    steps: list[tuple[float, float, float]] = []
    before = sample_cpu({})
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        batch = floor.stack([floor.first(data)])
        t1 = time.perf_counter()
        outputs = floor.second(batch)
        t2 = time.perf_counter()
        floor.third(outputs)
        t3 = time.perf_counter()
        steps.append((t1 - t0, t2 - t1, t3 - t2))
    usage = CpuUsage.between(before, sample_cpu({}))
    times = np.asarray(steps) * 1000
    return LoadResult("floor", 1, times.sum(axis=1), 0, usage), times


@dataclass(frozen=True)
class _Batch:
    """One batch of inputs going through the first step in the pool."""

    started: float
    items: list[Future[Any]]


def floor_batched(
    floor: StepFloor,
    data: bytes,
    batch: int,
    seconds: float,
    pool: ThreadPoolExecutor,
    overlap: bool,
) -> LoadResult:
    """Batches of ``batch`` inputs: the first step in the pool, one ORT run, one last step."""

    def submit() -> _Batch:
        return _Batch(time.perf_counter(), [pool.submit(floor.first, data) for _ in range(batch)])

    answer(floor, [f.result() for f in submit().items])  # warm the batch shape
    latencies: list[float] = []
    before = sample_cpu({})
    deadline = time.perf_counter() + seconds
    pending = submit()
    while time.perf_counter() < deadline or len(latencies) < 2 * batch:
        current = pending
        items = [future.result() for future in current.items]
        if overlap:  # the next batch's first step runs while this one runs in ORT
            pending = submit()
        answer(floor, items)
        latencies += [(time.perf_counter() - current.started) * 1000] * batch
        if not overlap:
            pending = submit()
    usage = CpuUsage.between(before, sample_cpu({}))
    for future in pending.items:
        future.result()
    return LoadResult("floor", batch, np.asarray(latencies), 0, usage)


def measure_floor(floor: StepFloor, data: bytes, settings: Settings) -> FloorRuns:
    """The floor at each level: the fastest of the rounds (and, batched, of both modes)."""
    seconds, rounds = settings.load.seconds, settings.load.rounds
    sequential = [floor_sequential(floor, data, seconds) for _ in range(rounds)]
    best, times = max(sequential, key=lambda pair: pair[0].rate)
    print(f"  floor b1: {_rates(run for run, _ in sequential)} req/s", flush=True)
    results, overlap = {1: best}, {}
    with ThreadPoolExecutor(max_workers=settings.threads) as pool:
        for batch in (n for n in settings.in_flight if n > 1):
            tries = {
                overlap: [
                    floor_batched(floor, data, batch, seconds, pool, overlap) for _ in range(rounds)
                ]
                for overlap in (True, False)
            }
            print(
                f"  floor b{batch}: overlapped {_rates(tries[True])}, "
                f"serial {_rates(tries[False])} req/s",
                flush=True,
            )
            results[batch] = max([*tries[True], *tries[False]], key=_rate)
            # The mode for the paired windows by the median: one lucky round must not
            # pick the mode that is slower in most.
            overlap[batch] = _median_rate(tries[True]) >= _median_rate(tries[False])
    steps_ms = dict(zip(floor.steps, times.mean(axis=0).tolist(), strict=True))
    return FloorRuns(results, steps_ms, overlap)


def _rate(run: LoadResult) -> float:
    return run.rate


def _median_rate(runs: Sequence[LoadResult]) -> float:
    return float(np.median([run.rate for run in runs]))


@dataclass(frozen=True)
class Pair:
    """One round's mesh run and the floor run just before it, at one level."""

    in_flight: int
    floor: float
    mesh: float

    @property
    def ratio(self) -> float:
        return self.mesh / self.floor


class NeighbourFloor:
    """The batched floor (in the mode with the higher median rate) for one window
    right before each mesh window: the host drifts between runs minutes apart (the
    floor alone has moved from 334 to 460 req/s), and adjacent windows share its state."""

    def __init__(self, floor: StepFloor, data: bytes, runs: FloorRuns, settings: Settings):
        self._floor, self._data, self._overlap = floor, data, runs.overlap
        self._seconds = settings.load.seconds
        self._pool = ThreadPoolExecutor(max_workers=settings.threads)

    def window(self, in_flight: int) -> float | None:
        """req/s of one floor window at ``in_flight`` (None at 1: latency, not a rate)."""
        if in_flight not in self._overlap:
            return None
        run = floor_batched(
            self._floor, self._data, in_flight, self._seconds, self._pool, self._overlap[in_flight]
        )
        return run.rate

    def close(self) -> None:
        self._pool.shutdown()


def _rates(runs: Iterable[LoadResult]) -> str:
    return " / ".join(f"{run.rate:.1f}" for run in runs)


# -- the mesh ------------------------------------------------------------------


def infer_payload(pipe: Pipeline, data: bytes) -> bytes:
    """ModelInfer of the ensemble with one input, [1, 1] BYTES, serialised once."""
    request = pb.ModelInferRequest(model_name=pipe.ensemble)
    element = np.empty((1, 1), dtype=object)
    element[0, 0] = data
    encode_inputs(request, {INPUTS[pipe.ensemble]: element})
    payload: bytes = request.SerializeToString()
    return payload


async def mesh_answer(address: str, payload: bytes) -> dict[str, np.ndarray]:
    """The outputs of one request through the generated stub."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelInfer(pb.ModelInferRequest.FromString(payload))
    return decode_outputs(reply)


def describe_answer(outputs: dict[str, np.ndarray]) -> str:
    """The mesh's answer in the floor's words (StepFloor.describe)."""
    if "LABELS" in outputs:
        top = bytes(outputs["LABELS"][0][0]).decode()
        return f"top-1 {top} {float(outputs['PROBABILITIES'][0][0]):.3f}"
    embedding = outputs["EMBEDDING"]
    return f"embedding [{embedding.shape[-1]}], norm {float(np.linalg.norm(embedding[0])):.3f}"


async def model_statistics(stub: Any, names: Sequence[str]) -> dict[str, Any]:
    """ModelStatistics of the ensemble and its three steps, through the orchestrator."""
    replies = await asyncio.gather(
        *(stub.ModelStatistics(pb.ModelStatisticsRequest(name=name)) for name in names)
    )
    return {name: reply.model_stats[0] for name, reply in zip(names, replies, strict=True)}


@dataclass(frozen=True)
class StageTimes:
    """Server-side time of one model across a window, per request (ms)."""

    model: str
    requests: int
    rows_per_exec: float
    server_ms: float
    """The model's own measure of a request, queue included (success duration)."""
    queue_ms: float
    compute_ms: float
    """Input + infer + output per request (an execution's time shared by its rows)."""

    @classmethod
    def between(cls, model: str, first: Any, last: Any) -> StageTimes:
        """The difference of two ModelStatistics entries."""
        first_stats, last_stats = first.inference_stats, last.inference_stats

        def delta(part: str) -> tuple[int, int]:
            a, b = getattr(first_stats, part), getattr(last_stats, part)
            return b.count - a.count, b.ns - a.ns

        requests, server_ns = delta("success")
        _, queue_ns = delta("queue")
        compute_ns = sum(delta(p)[1] for p in ("compute_input", "compute_infer", "compute_output"))
        rows = last.inference_count - first.inference_count
        executions = last.execution_count - first.execution_count
        per = max(1, requests) * 1e6
        return cls(
            model,
            requests,
            rows / max(1, executions),
            server_ns / per,
            queue_ns / per,
            compute_ns / max(1, rows) / 1e6,
        )


async def load_mesh(
    info: MeshInfo, pipe: Pipeline, payload: bytes, settings: Settings, neighbour: NeighbourFloor
) -> tuple[list[LoadResult], list[Pair]]:
    """Closed-loop load at each level, in rounds; the fastest run of each level is
    kept, and each round's rate beside a floor window run just before it."""
    runs, pairs = [], []
    async with grpc.aio.insecure_channel(info.orchestrator) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for round_ in range(settings.load.rounds):
            for in_flight in settings.in_flight:
                floor_rate = await asyncio.to_thread(neighbour.window, in_flight)
                for deadline_s in (None, DEADLINE_S) if settings.with_deadline else (None,):
                    run = await load_once(
                        info, pipe, payload, settings, in_flight, stub, deadline_s
                    )
                    paired = ""
                    if floor_rate is not None and deadline_s is None:
                        pairs.append(Pair(in_flight, floor_rate, run.rate))
                        paired = f" (the floor just before: {floor_rate:.1f})"
                    print(
                        f"  {run.label} @{in_flight} (round {round_ + 1}): {run.rate:.1f} req/s"
                        f"{paired}",
                        flush=True,
                    )
                    runs.append(run)
    return best_runs(runs), pairs


async def load_once(
    info: MeshInfo,
    pipe: Pipeline,
    payload: bytes,
    settings: Settings,
    in_flight: int,
    stub: Any,
    deadline_s: float | None = None,
) -> LoadResult:
    """One closed-loop run on the orchestrator; ModelStatistics at the window's edges.
    With ``deadline_s`` every request carries that deadline ("mesh+deadline")."""
    # Every mesh process is counted, so "others" is only what lies outside the mesh.
    pids = {**info.pids, "supervisor": info.supervisor_pid}
    connections = min(in_flight, settings.connections)
    target: GrpcTarget | DeadlineTarget = (
        GrpcTarget(info.orchestrator, INFER_METHOD, payload, connections)
        if deadline_s is None
        else DeadlineTarget(info.orchestrator, payload, connections, deadline_s)
    )
    try:
        return await closed_loop(
            "mesh" if deadline_s is None else "mesh+deadline",
            target.calls(),
            in_flight,
            pids,
            settings.load,
            lambda: model_statistics(stub, pipe.models),
        )
    finally:
        await target.close()


class DeadlineTarget:
    """As GrpcTarget, every request with a deadline: it bounds the caller's wait in
    the ensemble's queue, and where the ensemble does not batch
    (``ensemble_batching: false``) each step makes a ModelInfer instead of
    travelling on the stages' open streams."""

    def __init__(self, address: str, payload: bytes, connections: int, deadline_s: float) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        self._channels = [
            grpc.aio.insecure_channel(address, options=options) for _ in range(connections)
        ]
        self._payload, self._deadline_s = payload, deadline_s

    def calls(self) -> list[Call]:
        """One call per connection."""
        return [self._bind(channel.unary_unary(INFER_METHOD)) for channel in self._channels]

    def _bind(self, method: Any) -> Call:
        async def one() -> None:
            await method(self._payload, timeout=self._deadline_s)

        return one

    async def close(self) -> None:
        """Close every channel."""
        await asyncio.gather(*(channel.close() for channel in self._channels))


def stage_times(pipe: Pipeline, result: LoadResult) -> list[StageTimes]:
    """Per-model server-side times of one mesh run."""
    first, last = result.probes
    return [StageTimes.between(name, first[name], last[name]) for name in pipe.models]


# -- report --------------------------------------------------------------------


def throughput_table(pipe: Pipeline, floor: FloorRuns, mesh: Sequence[LoadResult]) -> str:
    """Floor and mesh rows: rate, latency, CPU per request by process."""
    headers = ["run", "in-flight", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "orch"]
    headers += [*(process.split("-")[0][:5] for process in pipe.processes)]
    headers += ["client", "others"]
    rows: list[list[object]] = []
    for result in [*floor.results.values(), *mesh]:
        per_stage = [result.cpu_ms(process) for process in pipe.processes]
        mesh_run = result.label.startswith("mesh")
        total = result.cpu_ms(*pipe.serving) if mesh_run else result.client_cpu_ms()
        rows.append(
            [
                result.label,
                result.in_flight,
                result.rate,
                result.percentile(50),
                result.percentile(99),
                total,
                *(
                    [result.cpu_ms("orchestrator"), *per_stage]
                    if mesh_run
                    else ["-"] * (1 + len(per_stage))
                ),
                result.client_cpu_ms() if mesh_run else "-",
                result.usage.others,
            ]
        )
    return format_table(headers, rows)


def stage_table(pipe: Pipeline, floor: FloorRuns, mesh: Sequence[LoadResult]) -> str:
    """Server-side time per request of the ensemble and each step (ModelStatistics).

    At 1 in flight, "floor ms" is the same step in this process (the ensemble
    row: all three), so compute can be compared with what it costs without a server.
    """
    headers = ["in-flight", "model", "requests", "rows/exec", "server ms", "queue ms"]
    headers += ["compute ms/row", "floor ms"]
    in_process = (
        {pipe.ensemble: floor.results[1].mean, **floor.steps_ms} if 1 in floor.results else {}
    )
    rows: list[list[object]] = []
    for result in mesh:
        for times in stage_times(pipe, result):
            step = times.model != pipe.ensemble
            rows.append(
                [
                    result.in_flight,
                    times.model,
                    times.requests,
                    times.rows_per_exec,
                    times.server_ms,
                    times.queue_ms if step else "-",
                    times.compute_ms if step else "-",
                    in_process.get(times.model, "-") if result.in_flight == 1 else "-",
                ]
            )
    return format_table(headers, rows)


def hop_lines(pipe: Pipeline, floor: FloorRuns, mesh: Sequence[LoadResult]) -> list[str]:
    """Where the mesh's extra latency at 1 in flight goes, per hop."""
    by_level = {result.in_flight: result for result in mesh if result.label == "mesh"}
    if 1 not in by_level or 1 not in floor.results:
        return []
    one, base = by_level[1], floor.results[1]
    ensemble, *steps = stage_times(pipe, one)
    added = one.percentile(50) - base.percentile(50)
    between = ensemble.server_ms - sum(step.server_ms for step in steps)
    queued = ", ".join(f"{step.model} {step.queue_ms:.2f}" for step in steps)
    hops = pipe.hops
    return [
        f"added p50 per hop @1 = (mesh {one.percentile(50):.1f} - floor "
        f"{base.percentile(50):.1f} ms) / {hops} hops = {added / hops:.2f} ms",
        "  where it goes (means, ms):",
        f"    client -> orchestrator (client mean - the ensemble's time where it runs): "
        f"{one.mean - ensemble.server_ms:.2f}",
        f"    between the steps (ensemble time - sum of step times): {between:.2f}, "
        f"{between / (hops - 1):.2f} per stage hop",
        f"    in the stages: {sum(s.server_ms for s in steps):.2f} vs floor {base.mean:.2f} "
        f"in-process; of it queueing {sum(s.queue_ms for s in steps):.2f} ({queued})",
    ]


def ratio_lines(floor: FloorRuns, mesh: Sequence[LoadResult]) -> list[str]:
    """mesh / floor throughput at every level above 1."""
    lines = []
    for result in mesh:
        if result.in_flight > 1 and result.in_flight in floor.results:
            base = floor.results[result.in_flight].rate
            lines.append(
                f"{result.label}/floor throughput @{result.in_flight}: "
                f"{result.rate:.1f} / {base:.1f} = {result.rate / base:.2f}"
            )
    return lines


def paired_lines(pairs: Sequence[Pair]) -> list[str]:
    """Per level, each round's mesh rate over the floor window just before it."""
    lines = []
    for level in sorted({pair.in_flight for pair in pairs}):
        ratios = [pair.ratio for pair in pairs if pair.in_flight == level]
        lines.append(
            f"paired rounds @{level}: {' '.join(f'{r:.2f}' for r in ratios)} "
            f"(median {float(np.median(ratios)):.2f}; each round's mesh over the floor "
            "window run just before it)"
        )
    return lines


def print_report(
    pipe: Pipeline, floor: FloorRuns, mesh: Sequence[LoadResult], pairs: Sequence[Pair]
) -> None:
    """The two tables, the hop breakdown and the ratios."""
    print()
    print(throughput_table(pipe, floor, mesh))
    print("(CPU ms/req: floor = this process; mesh = orchestrator + stages; others = cores")
    print(" used meanwhile by processes outside the measurement)")
    print()
    print(stage_table(pipe, floor, mesh))
    print()
    print("\n".join([*hop_lines(pipe, floor, mesh), *ratio_lines(floor, mesh)]))
    print("\n".join(paired_lines(pairs)))
    print(f"load average at end {load_average()}")


# -- command line --------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings (``--quick``: short windows for a smoke run)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--pipeline", choices=sorted(FLOORS), default="image_classifier")
    parser.add_argument("--image", default="coffee.png", help="scikit-image sample photo")
    parser.add_argument("--tracing", choices=("on", "off"), default="off")
    add_load_flags(parser, seconds=5.0, warmup_s=2.0, settle_s=3.0, in_flight="1,16,64")
    parser.add_argument("--connections", type=int, default=4, help="gRPC connections")
    parser.add_argument("--threads", type=int, default=2, help="floor first-step threads")
    parser.add_argument(
        "--layout",
        choices=("separate", "colocated", "both"),
        default="separate",
        help="the stages each in a process, all in one (services/colocated/), or both meshes",
    )
    parser.add_argument(
        "--with-deadline",
        action="store_true",
        help="also load with a deadline per request, interleaved",
    )
    parser.add_argument(
        "--without-edge",
        action="store_true",
        help="start the mesh without Envoy (a host without its binary)",
    )
    args = parser.parse_args(argv)
    load, levels = load_from_flags(args)
    return Settings(
        args.repository.expanduser(),
        args.pipeline,
        args.image,
        args.tracing == "on",
        load,
        levels,
        args.connections,
        args.threads,
        args.with_deadline,
        {"separate": (False,), "colocated": (True,), "both": (False, True)}[args.layout],
        edge=not args.without_edge,
    )


def subset_repository(source: Path, models: Sequence[str], folder: Path) -> Path:
    """A repository under ``folder`` holding only ``models`` (links into ``source``)."""
    root = folder / "repository"
    root.mkdir()
    for name in models:
        (root / name).symlink_to(source.expanduser().resolve() / name)
    return root


@contextlib.contextmanager
def pipeline_mesh(
    source: Path,
    pipe: MeshLayout,
    tracing: bool,
    *,
    tree: Path = ROOT,
    environment: Mapping[str, str] | None = None,
    edge: bool = True,
) -> Iterator[MeshInfo]:
    """The local mesh on the pipeline's (or layout's) models alone (no LLM), tracing
    on or off, no batch jobs; stopped by PID on exit. ``tree``: the checkout whose code it runs;
    ``environment``: set in its processes' environment; ``edge``: start Envoy too."""
    with tempfile.TemporaryDirectory(prefix="meshserve-pipeline-") as tmp:
        folder = Path(tmp)
        repository = subset_repository(source, pipe.models, folder)
        document = yaml.safe_load((tree / "deploy" / "local" / "mesh.yaml").read_text())
        supervisor = document.setdefault("supervisor", {})
        supervisor["trace_store"] = tracing
        supervisor["jobs"] = {"enabled": False}
        supervisor["edge"] = edge
        if pipe.colocated:
            document = colocated(document)  # as `meshserve serve --colocate` does
        config = folder / "mesh.yaml"
        config.write_text(yaml.safe_dump(document, sort_keys=False))
        log = folder / "mesh.log"
        proc = start_supervisor(repository, config, log, 180.0, tree=tree, environment=environment)
        started: dict[int, int | None] = {}
        try:
            info = wait_ready(proc, 180.0, log)
            started = {pid: start_ticks(pid) for pid in info.pids.values()}
            yield info
        finally:
            stop_mesh(proc, started)


def pipeline_input(pipe: Pipeline, settings: Settings) -> bytes:
    """What each request carries: the sample photo (image_classifier) or SENTENCE."""
    if pipe.ensemble == "image_classifier":
        return sample_image(settings.image).read_bytes()
    return SENTENCE


def main(argv: Sequence[str] | None = None) -> int:
    """Floor, mesh, load, report; returns the exit status."""
    install_sigterm_exit()
    keep_large_blocks()  # as every mesh service does (shared/server.py): the floor gains alike
    settings = parse_args(argv)
    floor = FLOORS[settings.pipeline](settings.repository)
    pipe = Pipeline(settings.pipeline, floor.steps)
    missing = missing_models(settings.repository, pipe.models)
    if missing:
        print(f"{settings.repository} lacks {missing}: run `python -m models.prepare`")
        return 2
    data = pipeline_input(pipe, settings)
    image = pipe.ensemble == "image_classifier"
    what = f"{settings.image}: {len(data)} bytes" if image else repr(data.decode())
    print(f"{what}; load average at start {load_average()}")
    print(
        f"floor: first-step threads {settings.threads}; "
        f"{floor.describe(answer(floor, [floor.first(data)]))}",
        flush=True,
    )
    floor_results = measure_floor(floor, data, settings)
    payload = infer_payload(pipe, data)
    neighbour = NeighbourFloor(floor, data, floor_results, settings)
    try:
        for one_process in settings.layouts:
            layout = replace(pipe, colocated=one_process)
            mesh_results, pairs = asyncio.run(mesh_run(layout, payload, settings, neighbour))
            print(f"\n== stages {'in one process' if one_process else 'each in its own process'}")
            print_report(layout, floor_results, mesh_results, pairs)
    finally:
        neighbour.close()
    return 0


async def mesh_run(
    pipe: Pipeline, payload: bytes, settings: Settings, neighbour: NeighbourFloor
) -> tuple[list[LoadResult], list[Pair]]:
    """Start the mesh, check one answer, load it; stop it."""
    with pipeline_mesh(settings.repository, pipe, settings.tracing, edge=settings.edge) as info:
        outputs = await mesh_answer(info.orchestrator, payload)
        tracing = "on" if settings.tracing else "off"
        print(
            f"mesh ready ({info.orchestrator}, tracing {tracing}); {describe_answer(outputs)}",
            flush=True,
        )
        return await load_mesh(info, pipe, payload, settings, neighbour)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the mesh is already stopped by running_mesh's finally
        sys.exit(130)
