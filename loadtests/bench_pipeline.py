"""The image_classifier ensemble through the mesh vs the same three steps in one process.

    python loadtests/bench_pipeline.py [--seconds 5] [--rounds 2] [--in-flight 1,16,64] [--quick]

In order:

1. the floor, in this process: ``preprocess`` (services/preprocess/transform.py,
   with image_preprocess's config), MobileNetV2 in ONNX Runtime (the server's own
   ``OnnxInstance``: same intra-op threads, inter-op 1, spinning off) and top-5
   (``softmax_top_k`` and imagenet_top5's labels):
   - at 1 in flight: the three steps one after the other, one image at a time;
   - at N in flight: batches of N images, preprocessed in a thread pool (one
     thread per core), one ORT run per batch, one top-5 per batch; tried with the
     next batch's preprocessing overlapping this batch's ORT run and without,
     and the faster is the floor. Each image's latency is its batch's time from
     the start of its preprocessing to the end of its top-5;
2. the whole mesh (``deploy.local.supervisor --ports auto``);
3. closed-loop grpc.aio load on the orchestrator (ModelInfer ``image_classifier``,
   one image per request, several HTTP/2 connections) at each in-flight level,
   warmed up before a measured window; CPU of each mesh process from /proc;
   per-stage server-side time from ModelStatistics across the window;
4. tables and ratios; the mesh is stopped by PID (also on error and Ctrl-C).

Every measurement is repeated ``--rounds`` times (the mesh's interleaved across
levels) and the fastest run is reported: on a shared machine a neighbour only
ever slows a run down. The "others" column says how busy the rest of the
machine was during the run that is shown.

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
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from common import (
    DEFAULT_REPOSITORY,
    INFER_METHOD,
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
    running_mesh,
    sample_cpu,
)

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from services.inference.onnx import OnnxInstance
from services.postprocess.classify import ClassifyInstance, softmax_top_k
from services.preprocess.backend import transform_config
from services.preprocess.transform import TransformConfig, preprocess
from shared.backend import ModelSpec, config_parameters
from shared.model import instance_specs
from shared.repository import ModelRepository
from shared.tensors import decode_outputs, encode_inputs

ENSEMBLE = "image_classifier"
PREPROCESS, MODEL, TOP5 = "image_preprocess", "mobilenet_v2_onnx", "imagenet_top5"
STAGES = {PREPROCESS: "preprocess-0", MODEL: "inference-0", TOP5: "postprocess-0"}
"""Each step's model -> the mesh process that hosts it."""
SERVING = ("orchestrator", *STAGES.values())
"""The processes a classify request runs in."""
HOPS = 4
"""client -> orchestrator, orchestrator -> preprocess, -> inference, -> postprocess."""


@dataclass(frozen=True)
class Settings:
    """One benchmark run's knobs (parsed once from the command line)."""

    repository: Path
    """The prepared model repository (python -m models.prepare)."""
    image: str
    """A scikit-image sample photo, sent as encoded bytes."""
    load: LoadSettings
    """Warm-up, window and settle time of each measurement."""
    in_flight: tuple[int, ...]
    """Concurrency levels; 1 gives the latency per hop, the rest throughput."""
    connections: int
    """gRPC connections the mesh load is spread over."""
    threads: int
    """Preprocessing threads of the batched floor."""


# -- the floor: the three steps in one process ---------------------------------


def model_spec(repository: ModelRepository, name: str) -> ModelSpec:
    """The ModelSpec a stage service builds for the newest served version of ``name``."""
    entry = repository.entry(name)
    version = entry.selected_versions()[-1]
    return ModelSpec(
        entry.name,
        version,
        entry.version_path(version),
        entry.config,
        config_parameters(entry.config),
    )


class Floor:
    """image_preprocess -> mobilenet_v2_onnx -> imagenet_top5 as plain calls."""

    def __init__(self, root: Path) -> None:
        repository = ModelRepository(root)
        self.transform: TransformConfig = transform_config(model_spec(repository, PREPROCESS))
        model = model_spec(repository, MODEL)
        # The server's own session class and thread layout (instance_specs on a CPU host).
        self.session = OnnxInstance(model, instance_specs(model.config, 0)[0])
        top5 = model_spec(repository, TOP5)
        classify = ClassifyInstance(top5, instance_specs(top5.config, 0)[0])
        self.labels, self.top_k = classify.labels, classify.top_k

    @property
    def intra_op_threads(self) -> int:
        """ORT intra-op threads of the session (what the inference service uses)."""
        return int(self.session.session.get_session_options().intra_op_num_threads)

    def preprocess(self, data: bytes) -> np.ndarray:
        """Image bytes -> float32 [3, 224, 224]."""
        pixels: np.ndarray = preprocess(data, self.transform)
        return pixels

    def infer(self, pixels: np.ndarray) -> np.ndarray:
        """Pixels [B, 3, 224, 224] -> logits [B, 1000]."""
        logits: np.ndarray = self.session.run({"input": pixels})["logits"]
        return logits

    def top5(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits -> (labels, probabilities), each [B, top_k], best first."""
        indices, probabilities = softmax_top_k(logits, self.top_k)
        return self.labels[indices], probabilities

    def classify(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pixels [B, 3, 224, 224] -> (labels, probabilities), each [B, top_k]."""
        return self.top5(self.infer(pixels))


@dataclass(frozen=True)
class FloorRuns:
    """The floor at each in-flight level, and its steps' mean times at 1 in flight."""

    results: dict[int, LoadResult]
    steps_ms: dict[str, float]
    """Model name of the step -> mean ms per image, one image at a time."""


def floor_sequential(floor: Floor, data: bytes, seconds: float) -> tuple[LoadResult, np.ndarray]:
    """One image at a time through the three steps; also each step's time [runs, 3] in ms."""
    for _ in range(3):  # ORT allocates its arenas on the first runs
        floor.classify(floor.preprocess(data)[None])
    steps: list[tuple[float, float, float]] = []
    before = sample_cpu({})
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        pixels = floor.preprocess(data)[None]
        t1 = time.perf_counter()
        logits = floor.infer(pixels)
        t2 = time.perf_counter()
        floor.top5(logits)
        t3 = time.perf_counter()
        steps.append((t1 - t0, t2 - t1, t3 - t2))
    usage = CpuUsage.between(before, sample_cpu({}))
    times = np.asarray(steps) * 1000
    return LoadResult("floor", 1, times.sum(axis=1), 0, usage), times


@dataclass(frozen=True)
class _Batch:
    """One batch of images being preprocessed in the pool."""

    started: float
    pixels: list[Future[np.ndarray]]


def floor_batched(
    floor: Floor, data: bytes, batch: int, seconds: float, pool: ThreadPoolExecutor, overlap: bool
) -> LoadResult:
    """Batches of ``batch`` images: pool preprocessing, one ORT run, one top-5."""

    def submit() -> _Batch:
        return _Batch(
            time.perf_counter(), [pool.submit(floor.preprocess, data) for _ in range(batch)]
        )

    floor.classify(np.stack([f.result() for f in submit().pixels]))  # warm the batch shape
    latencies: list[float] = []
    before = sample_cpu({})
    deadline = time.perf_counter() + seconds
    pending = submit()
    while time.perf_counter() < deadline or len(latencies) < 2 * batch:
        current = pending
        pixels = np.stack([future.result() for future in current.pixels])
        if overlap:  # the next batch decodes while this one runs in ORT
            pending = submit()
        floor.classify(pixels)
        latencies += [(time.perf_counter() - current.started) * 1000] * batch
        if not overlap:
            pending = submit()
    usage = CpuUsage.between(before, sample_cpu({}))
    for future in pending.pixels:
        future.result()
    return LoadResult("floor", batch, np.asarray(latencies), 0, usage)


def measure_floor(floor: Floor, data: bytes, settings: Settings) -> FloorRuns:
    """The floor at each level: the fastest of the rounds (and, batched, of both modes)."""
    seconds, rounds = settings.load.seconds, settings.load.rounds
    sequential = [floor_sequential(floor, data, seconds) for _ in range(rounds)]
    best, times = max(sequential, key=lambda pair: pair[0].rate)
    print(f"  floor b1: {_rates(run for run, _ in sequential)} img/s", flush=True)
    results = {1: best}
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
                f"serial {_rates(tries[False])} img/s",
                flush=True,
            )
            results[batch] = max([*tries[True], *tries[False]], key=lambda run: run.rate)
    return FloorRuns(results, dict(zip(STAGES, times.mean(axis=0).tolist(), strict=True)))


def _rates(runs: Iterable[LoadResult]) -> str:
    return " / ".join(f"{run.rate:.1f}" for run in runs)


# -- the mesh ------------------------------------------------------------------


def infer_payload(data: bytes) -> bytes:
    """ModelInfer(image_classifier) with one image, IMAGE [1, 1] BYTES, serialised once."""
    request = pb.ModelInferRequest(model_name=ENSEMBLE)
    images = np.empty((1, 1), dtype=object)
    images[0, 0] = data
    encode_inputs(request, {"IMAGE": images})
    payload: bytes = request.SerializeToString()
    return payload


async def mesh_answer(address: str, payload: bytes) -> tuple[str, float]:
    """Top-1 (label, probability) of one request through the generated stub."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelInfer(pb.ModelInferRequest.FromString(payload))
    outputs = decode_outputs(reply)
    return bytes(outputs["LABELS"][0][0]).decode(), float(outputs["PROBABILITIES"][0][0])


async def model_statistics(stub: Any) -> dict[str, Any]:
    """ModelStatistics of the ensemble and its three steps, through the orchestrator."""
    names = (ENSEMBLE, *STAGES)
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


async def load_mesh(info: MeshInfo, payload: bytes, settings: Settings) -> list[LoadResult]:
    """Closed-loop load at each level, in rounds; the fastest run of each level is kept."""
    runs = []
    async with grpc.aio.insecure_channel(info.orchestrator) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for round_ in range(settings.load.rounds):
            for in_flight in settings.in_flight:
                run = await load_once(info, payload, settings, in_flight, stub)
                print(f"  mesh @{in_flight} (round {round_ + 1}): {run.rate:.1f} req/s", flush=True)
                runs.append(run)
    return best_runs(runs)


async def load_once(
    info: MeshInfo, payload: bytes, settings: Settings, in_flight: int, stub: Any
) -> LoadResult:
    """One closed-loop run on the orchestrator; ModelStatistics at the window's edges."""
    # Every mesh process is counted, so "others" is only what lies outside the mesh.
    pids = {**info.pids, "supervisor": info.supervisor_pid}
    connections = min(in_flight, settings.connections)
    target = GrpcTarget(info.orchestrator, INFER_METHOD, payload, connections)
    try:
        return await closed_loop(
            "mesh", target.calls(), in_flight, pids, settings.load, lambda: model_statistics(stub)
        )
    finally:
        await target.close()


def stage_times(result: LoadResult) -> list[StageTimes]:
    """Per-model server-side times of one mesh run."""
    first, last = result.probes
    return [StageTimes.between(name, first[name], last[name]) for name in (ENSEMBLE, *STAGES)]


# -- report --------------------------------------------------------------------


def throughput_table(floor: FloorRuns, mesh: Sequence[LoadResult]) -> str:
    """Floor and mesh rows: rate, latency, CPU per request by process."""
    headers = ["run", "in-flight", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "orch", "pre"]
    headers += ["inf", "post", "client", "others"]
    rows: list[list[object]] = []
    for result in [*floor.results.values(), *mesh]:
        per_stage = [result.cpu_ms(STAGES[model]) for model in STAGES]
        mesh_run = result.label == "mesh"
        total = result.cpu_ms(*SERVING) if mesh_run else result.client_cpu_ms()
        rows.append(
            [
                result.label,
                result.in_flight,
                result.rate,
                result.percentile(50),
                result.percentile(99),
                total,
                *([result.cpu_ms("orchestrator"), *per_stage] if mesh_run else ["-"] * 4),
                result.client_cpu_ms() if mesh_run else "-",
                result.usage.others,
            ]
        )
    return format_table(headers, rows)


def stage_table(floor: FloorRuns, mesh: Sequence[LoadResult]) -> str:
    """Server-side time per request of the ensemble and each step (ModelStatistics).

    At 1 in flight, "floor ms" is the same step in this process (the ensemble
    row: all three), so compute can be compared with what it costs without a server.
    """
    headers = ["in-flight", "model", "requests", "rows/exec", "server ms", "queue ms"]
    headers += ["compute ms/row", "floor ms"]
    in_process = {ENSEMBLE: floor.results[1].mean, **floor.steps_ms} if 1 in floor.results else {}
    rows: list[list[object]] = []
    for result in mesh:
        for times in stage_times(result):
            step = times.model != ENSEMBLE
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


def hop_lines(floor: FloorRuns, mesh: Sequence[LoadResult]) -> list[str]:
    """Where the mesh's extra latency at 1 in flight goes, per hop."""
    by_level = {result.in_flight: result for result in mesh}
    if 1 not in by_level or 1 not in floor.results:
        return []
    one, base = by_level[1], floor.results[1]
    ensemble, *steps = stage_times(one)
    added = one.percentile(50) - base.percentile(50)
    between = ensemble.server_ms - sum(step.server_ms for step in steps)
    queued = ", ".join(f"{step.model} {step.queue_ms:.2f}" for step in steps)
    return [
        f"added p50 per hop @1 = (mesh {one.percentile(50):.1f} - floor "
        f"{base.percentile(50):.1f} ms) / {HOPS} hops = {added / HOPS:.2f} ms",
        "  where it goes (means, ms):",
        f"    client -> orchestrator (client mean - orchestrator's ensemble time): "
        f"{one.mean - ensemble.server_ms:.2f}",
        f"    orchestrator -> 3 stages (ensemble time - sum of stage times): {between:.2f}, "
        f"{between / (HOPS - 1):.2f} per stage hop",
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
                f"mesh/floor throughput @{result.in_flight}: {result.rate:.1f} / {base:.1f} "
                f"= {result.rate / base:.2f}"
            )
    return lines


def print_report(floor: FloorRuns, mesh: Sequence[LoadResult]) -> None:
    """The two tables, the hop breakdown and the ratios."""
    print()
    print(throughput_table(floor, mesh))
    print("(CPU ms/req: floor = this process; mesh = orchestrator + 3 stages; others = cores")
    print(" used meanwhile by processes outside the measurement)")
    print()
    print(stage_table(floor, mesh))
    print()
    print("\n".join([*hop_lines(floor, mesh), *ratio_lines(floor, mesh)]))
    print(f"load average at end {load_average()}")


# -- command line --------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings (``--quick``: short windows for a smoke run)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--image", default="coffee.png", help="scikit-image sample photo")
    add_load_flags(parser, seconds=5.0, warmup_s=2.0, settle_s=3.0, in_flight="1,16,64")
    parser.add_argument("--connections", type=int, default=4, help="gRPC connections")
    parser.add_argument("--threads", type=int, default=2, help="floor preprocessing threads")
    args = parser.parse_args(argv)
    load, levels = load_from_flags(args)
    return Settings(
        args.repository.expanduser(), args.image, load, levels, args.connections, args.threads
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Floor, mesh, load, report; returns the exit status."""
    install_sigterm_exit()
    settings = parse_args(argv)
    missing = missing_models(settings.repository, (ENSEMBLE, *STAGES))
    if missing:
        print(f"{settings.repository} lacks {missing}: run `python -m models.prepare`")
        return 2
    data = sample_image(settings.image).read_bytes()
    print(f"{settings.image}: {len(data)} bytes; load average at start {load_average()}")
    floor = Floor(settings.repository)
    labels, probabilities = floor.classify(floor.preprocess(data)[None])
    print(
        f"floor: ORT intra-op threads {floor.intra_op_threads}, preprocess threads "
        f"{settings.threads}; top-1 {labels[0][0].decode()} {probabilities[0][0]:.3f}",
        flush=True,
    )
    floor_results = measure_floor(floor, data, settings)
    payload = infer_payload(data)
    with running_mesh(settings.repository) as info:
        label, probability = asyncio.run(mesh_answer(info.orchestrator, payload))
        print(f"mesh ready ({info.orchestrator}); top-1 {label} {probability:.3f}", flush=True)
        mesh_results = asyncio.run(load_mesh(info, payload, settings))
    print_report(floor_results, mesh_results)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the mesh is already stopped by running_mesh's finally
        sys.exit(130)
