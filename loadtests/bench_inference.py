"""Throughput of the inference service with and without dynamic batching (MobileNetV2).

    python loadtests/bench_inference.py [--model mobilenet_v2_onnx] [--kind cpu|gpu]
                                        [--seconds 8] [--quick] [--repository PATH]

In order:

1. a temporary model repository gets two variants of the chosen model (the
   prepared model file, symlinked): ``<model>_batched`` (dynamic batching) and
   ``<model>_unbatched`` (no ``dynamic_batching`` block: one request per run);
2. the in-process floor (``inference_floor.py``): the backend's own instance
   class (same session options and thread count as the server gives it, one
   thread per instance), run in a loop at batch sizes 1..64; the best images/s
   is the floor;
3. one inference service process hosts both variants;
4. closed-loop gRPC load (grpc.aio, several channels, one pre-serialised
   batch-1 request reused) at 1, 16 and 64 requests in flight per variant, each
   run warmed up before its measured window; server CPU comes from
   ``/proc/<pid>/stat`` (utime + stime) across the window;
5. a table, the two ratios against their targets, and the server is stopped
   (SIGTERM to its PID).

The load generator shares the machine's cores with the server: its own CPU per
request is printed too. So is "others", the cores the rest of the machine used
during a window (``/proc/stat`` minus server and generator): each measurement
first waits (``--settle``) for a quiet second, and one that others disturbed
anyway (``*``, > 0.25 cores) is measured again (``--attempts``), keeping the
least disturbed. CPU per image (floor) and per request (server) barely move with
neighbours, so their ratios are printed beside the throughput ratios.

``--kind gpu`` (a host with CUDA) puts both variants and the floor on GPU 0
(``KIND_GPU gpus: [0]``, the TorchScript model). That is where batching has the
most to win: on a small CPU the model costs the same per image at any batch
size, so batching can only save the per-request serving overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
from common import (
    INFER_METHOD,
    CpuUsage,
    GrpcTarget,
    LoadResult,
    load_average,
    sample_cpu,
    settle,
)
from inference_floor import (
    INPUT,
    NOISY_CORES,
    OUTPUT,
    QUIET_CORES,
    Floor,
    FloorSettings,
    measure_floor,
    model_spec,
)

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.prepare import default_cache, prepare_repository
from shared.repository import ModelRepository
from shared.tensors import decode_outputs, encode_inputs

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = {"mobilenet_v2_onnx": "model.onnx", "mobilenet_v2": "model.pt"}
FLOOR_TARGET, BATCHING_TARGET = 0.85, 3.0

_CONFIG = """\
name: "{name}"
backend: "{backend}"
max_batch_size: 64
input [ {{ name: "{input}" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ count: {instances} kind: {kind} }} ]
{extra}"""
_DYNAMIC = """\
dynamic_batching {{
  preferred_batch_size: [ {preferred} ]
  max_queue_delay_microseconds: {delay_us}
}}
"""
_THREADS = 'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{threads}" }} }}\n'


@dataclass(frozen=True)
class Settings:
    """One benchmark run's knobs (parsed once from the command line)."""

    model: str
    """Prepared model to serve: ``mobilenet_v2_onnx`` or ``mobilenet_v2`` (TorchScript)."""
    kind: str
    """Where the instances run: ``cpu`` (KIND_CPU) or ``gpu`` (KIND_GPU on GPU 0)."""
    seconds: float
    """Measured window of each load run."""
    warmup_s: float
    """Load before each measured window (not counted)."""
    floor_s: float
    """Loop time of each floor batch size."""
    in_flight: tuple[int, ...]
    """Concurrency levels of the closed-loop load."""
    floor_batches: tuple[int, ...]
    """Batch sizes tried for the in-process floor."""
    instances: int
    """Instances of each variant (instance_group count)."""
    preferred: tuple[int, ...]
    """preferred_batch_size of the batched variant."""
    delay_us: int
    """max_queue_delay_microseconds of the batched variant."""
    threads: int
    """intra_op_thread_count per instance; 0 leaves the server's default (cores / instances)."""
    settle_s: float
    """Longest extra wait, before each measurement, for other processes to leave the cores."""
    attempts: int
    """Measurements of each point at most, while other processes disturb them (>= 1)."""
    channels: int
    """gRPC channels (each its own HTTP/2 connection) the load is spread over."""
    cache: Path
    """The models.prepare cache folder."""
    repository: Path | None = None
    """A prepared repository to take the model from as it is (None: prepare it in ``cache``)."""

    @property
    def floor(self) -> FloorSettings:
        """How the in-process floor is measured."""
        return FloorSettings(self.floor_batches, self.floor_s, self.settle_s, self.attempts)


@dataclass(frozen=True)
class Variant:
    """One model folder of the temporary repository."""

    label: str
    name: str
    payload: bytes
    """The serialised batch-1 ModelInferRequest, built once and reused."""


class Counters(NamedTuple):
    """ModelStatistics of one model at one edge of a measured window."""

    rows: int
    executions: int
    compute_ns: int


@dataclass
class _Window:
    """The measured interval: latencies of requests that complete inside it."""

    open: bool = False
    closed: bool = False
    latencies_ns: list[int] = field(default_factory=list)


# -- the temporary repository --------------------------------------------------


def config_text(name: str, backend: str, settings: Settings, batched: bool) -> str:
    """config.pbtxt of one variant; only the batched one has dynamic_batching."""
    extra = ""
    if batched:
        preferred = ", ".join(str(size) for size in settings.preferred)
        extra += _DYNAMIC.format(preferred=preferred, delay_us=settings.delay_us)
    if settings.threads:
        extra += _THREADS.format(threads=settings.threads)
    return _CONFIG.format(
        name=name,
        backend=backend,
        input=INPUT,
        output=OUTPUT,
        instances=settings.instances,
        kind="KIND_GPU gpus: [ 0 ]" if settings.kind == "gpu" else "KIND_CPU",
        extra=extra,
    )


def build_repository(root: Path, settings: Settings) -> dict[str, str]:
    """Write ``<model>_batched`` and ``<model>_unbatched`` under ``root``; label -> name."""
    source = settings.repository or prepare_repository(
        settings.cache, models=[settings.model], echo=lambda _: None
    )
    model_file = source / settings.model / "1" / MODEL_FILES[settings.model]
    backend = ModelRepository(source).entry(settings.model).config.backend
    names = {}
    for label, batched in (("batching", True), ("no-batching", False)):
        name = f"{settings.model}_{'batched' if batched else 'unbatched'}"
        version = root / name / "1"
        version.mkdir(parents=True)
        (version / model_file.name).symlink_to(model_file.resolve())
        (root / name / "config.pbtxt").write_text(config_text(name, backend, settings, batched))
        names[label] = name
    return names


def payload(name: str, image: np.ndarray) -> bytes:
    """A batch-1 ModelInferRequest for ``name``, serialised once."""
    request = pb.ModelInferRequest(model_name=name)
    encode_inputs(request, {INPUT: image[None]})
    return request.SerializeToString()


# -- closed-loop gRPC load -----------------------------------------------------


async def _counters(stub: Any, name: str) -> Counters:
    """ModelStatistics of model ``name`` (read just outside a window's edges)."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=name))
    stats = reply.model_stats[0]
    return Counters(
        stats.inference_count, stats.execution_count, stats.inference_stats.compute_infer.ns
    )


async def _worker(call: Any, window: _Window) -> None:
    """Send back to back; record latencies that end inside the window.

    Unlike ``common.closed_loop`` a failed request ends the benchmark: the
    ratios mean nothing once the server errs.
    """
    while not window.closed:
        started = time.perf_counter_ns()
        await call()
        if window.open:
            window.latencies_ns.append(time.perf_counter_ns() - started)


async def run_load(
    address: str, pid: int, variant: Variant, in_flight: int, settings: Settings
) -> LoadResult:
    """One closed-loop run: warm up, then measure a window of ``settings.seconds``.

    ``LoadResult.probes`` holds the model's Counters at the window's two edges.
    """
    target = GrpcTarget(
        address, INFER_METHOD, variant.payload, max(1, min(in_flight, settings.channels))
    )
    calls, pids, window = target.calls(), {"server": pid}, _Window()
    workers = [
        asyncio.create_task(_worker(calls[index % len(calls)], window))
        for index in range(in_flight)
    ]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            await asyncio.sleep(settings.warmup_s)
            await settle(pids, settings.settle_s, QUIET_CORES)
            first = await _counters(stub, variant.name)
            before = sample_cpu(pids)
            window.open = True
            await asyncio.sleep(settings.seconds)
            window.open, window.closed = False, True
            after = sample_cpu(pids)
            last = await _counters(stub, variant.name)
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await target.close()
    latencies = np.asarray(window.latencies_ns, dtype=np.float64) / 1e6
    usage = CpuUsage.between(before, after)
    return LoadResult(variant.label, in_flight, latencies, 0, usage, (first, last))


def _counted(result: LoadResult) -> Counters:
    """What the model's statistics grew by over the window."""
    first, last = result.probes
    return Counters(*(end - start for start, end in zip(first, last, strict=True)))


def mean_batch(result: LoadResult) -> float:
    """Rows per model execution in the window (ModelStatistics)."""
    counted = _counted(result)
    return counted.rows / max(1, counted.executions)


def busy(result: LoadResult) -> float:
    """Fraction of the window the instances spent computing (summed over instances)."""
    return _counted(result).compute_ns / 1e9 / result.usage.seconds


async def quietest_load(
    address: str, pid: int, variant: Variant, in_flight: int, settings: Settings
) -> LoadResult:
    """The least disturbed of up to ``settings.attempts`` runs (a quiet one ends the tries).

    A neighbour's burst during a window can halve a rate and fake any ratio, so a
    disturbed window (others > NOISY_CORES) is measured again.
    """
    best = await run_load(address, pid, variant, in_flight, settings)
    for _ in range(settings.attempts - 1):
        if best.usage.others <= NOISY_CORES:
            break
        again = await run_load(address, pid, variant, in_flight, settings)
        best = min(best, again, key=lambda result: result.usage.others)
    return best


async def check_answer(address: str, variant: Variant, expected: np.ndarray) -> float:
    """Send the request once through the generated stub; max |server - floor| logit."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        reply = await stub.ModelInfer(pb.ModelInferRequest.FromString(variant.payload))
    got = decode_outputs(reply)[OUTPUT]
    if got.shape != (1, *expected.shape):
        raise AssertionError(f"{variant.name}: output shape {got.shape}, expected (1, 1000)")
    diff = float(np.max(np.abs(got[0] - expected)))
    if diff > 1e-3 * max(1.0, float(np.max(np.abs(expected)))):
        raise AssertionError(f"{variant.name}: server logits differ from in-process by {diff}")
    return diff


async def bench_service(
    address: str, pid: int, variants: Sequence[Variant], floor: Floor, settings: Settings
) -> list[LoadResult]:
    """Check each variant's answer, then load it at each concurrency level."""
    results = []
    print(_header())
    for variant in variants:
        await check_answer(address, variant, floor.logits)
        for in_flight in settings.in_flight:
            result = await quietest_load(address, pid, variant, in_flight, settings)
            print(_row(result), flush=True)
            results.append(result)
    return results


# -- the service process -------------------------------------------------------


@contextmanager
def inference_service(repository: Path) -> Iterator[Any]:
    """One inference service hosting ``repository``; stopped by PID (SIGTERM) on exit."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/ is beside the installed packages, not in them
    from tests.harness import ServiceProcess

    service = ServiceProcess("services.inference.main", ["--model-repository", str(repository)])
    try:
        yield service
    finally:
        code = service.stop()
        if code != 0:
            print(f"server exited with {code}; log:\n{service.logs()[-3000:]}", file=sys.stderr)
        service.log_path.unlink(missing_ok=True)


# -- report --------------------------------------------------------------------


def _header() -> str:
    return (
        f"{'variant':<12}{'in-flight':>10}{'req/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
        f"{'srv CPU':>10}{'cli CPU':>10}{'rows/exec':>11}{'busy':>7}{'others':>8}"
    )


def _row(result: LoadResult) -> str:
    p50, p95, p99 = (result.percentile(q) for q in (50, 95, 99))
    others = result.usage.others
    return (
        f"{result.label:<12}{result.in_flight:>10}{result.rate:>9.1f}{p50:>9.1f}{p95:>9.1f}"
        f"{p99:>9.1f}{result.cpu_ms('server'):>8.1f}ms{result.client_cpu_ms():>8.2f}ms"
        f"{mean_batch(result):>11.1f}{busy(result):>7.2f}{others:>7.2f}{_noisy(others)}"
    )


def describe_floor(floor: Floor) -> str:
    """Images/s and CPU per image at each batch size, and the best."""
    points = "  ".join(
        f"b{batch} {point.rate:.1f}/s {point.cpu_ms:.1f}ms{_noisy(point.others)}"
        for batch, point in floor.points.items()
    )
    batch, best = floor.best
    return (
        f"floor ({floor.instances} instance(s) x {floor.threads} thread(s), in-process): "
        f"{points}  -> best b{batch}: {best.rate:.1f} images/s"
    )


def ratio_lines(results: Sequence[LoadResult], floor: Floor) -> list[str]:
    """The two target ratios at the highest concurrency, then their CPU-per-image versions.

    Throughput ratios are the targets; on a machine shared with other work
    (``*`` marks a measurement during which others used > 0.25 cores) the
    CPU-per-image ratios are the steadier reading of the same efficiency.
    """
    top = max(result.in_flight for result in results)
    at_top = {r.label: r for r in results if r.in_flight == top}
    batched, unbatched, (_, best) = at_top["batching"], at_top["no-batching"], floor.best
    batched_cpu, unbatched_cpu = batched.cpu_ms("server"), unbatched.cpu_ms("server")
    lines = [
        _ratio(f"batching@{top} / floor", batched.rate, best.rate, FLOOR_TARGET),
        _ratio(
            f"batching@{top} / no-batching@{top}", batched.rate, unbatched.rate, BATCHING_TARGET
        ),
        _ratio("CPU/img: floor / batching", best.cpu_ms, batched_cpu, None),
        _ratio("CPU/img: no-batching / batching", unbatched_cpu, batched_cpu, None),
    ]
    noisy = max(best.others, batched.usage.others, unbatched.usage.others)
    if noisy > NOISY_CORES:
        lines.append(f"* other processes used up to {noisy:.2f} cores during these measurements")
    return lines


def _ratio(name: str, num: float, den: float, target: float | None) -> str:
    verdict = ""
    if target is not None:
        verdict = f"  (target >= {target:g}) {'PASS' if num / den >= target else 'MISS'}"
    return f"{name:<34} {num:7.1f} / {den:7.1f} = {num / den:5.2f}{verdict}"


def _noisy(others: float) -> str:
    return "*" if others > NOISY_CORES else ""


# -- command line --------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings (``--quick``: short windows for a smoke run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_FILES),
        help="default: mobilenet_v2_onnx on cpu, mobilenet_v2 (TorchScript) on gpu",
    )
    parser.add_argument(
        "--kind", choices=("cpu", "gpu"), default="cpu", help="KIND_CPU or KIND_GPU instances"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up before each window")
    parser.add_argument("--quick", action="store_true", help="3 s windows, 1 s warm-ups")
    parser.add_argument("--instances", type=int, default=2, help="instance_group count")
    parser.add_argument("--preferred", default="16,32", help="preferred_batch_size list")
    parser.add_argument("--delay-us", type=int, default=500, help="max_queue_delay_microseconds")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    parser.add_argument(
        "--settle", type=float, default=5.0, help="max wait for a quiet machine per run"
    )
    parser.add_argument(
        "--attempts", type=int, default=2, help="re-measure a disturbed point up to N times"
    )
    parser.add_argument("--channels", type=int, default=4, help="gRPC connections of the load")
    parser.add_argument("--in-flight", default="1,16,64", help="concurrency levels")
    parser.add_argument("--cache", type=Path, default=None, help="models.prepare cache")
    parser.add_argument(
        "--repository",
        type=Path,
        default=None,
        help="a prepared repository, used as it is (a host without the model wheels)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    if args.kind == "gpu" and args.model == "mobilenet_v2_onnx":
        parser.error("--kind gpu runs the TorchScript model (--model mobilenet_v2)")
    default_model = "mobilenet_v2" if args.kind == "gpu" else "mobilenet_v2_onnx"
    return Settings(
        model=args.model or default_model,
        kind=args.kind,
        seconds=3.0 if quick else args.seconds,
        warmup_s=1.0 if quick else args.warmup,
        floor_s=1.0 if quick else 2.5,
        in_flight=_ints(args.in_flight),
        floor_batches=(1, 8, 16, 32, 64),
        instances=args.instances,
        preferred=_ints(args.preferred),
        delay_us=args.delay_us,
        threads=args.threads,
        settle_s=0.0 if quick else args.settle,
        attempts=1 if quick else max(1, args.attempts),
        channels=args.channels,
        cache=args.cache or default_cache(),
        repository=args.repository,
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Build, measure the floor, serve, load, report; returns the exit status."""
    settings = parse_args(argv)
    image = np.random.default_rng(0).standard_normal((3, 224, 224), dtype=np.float32)
    print(f"model {settings.model}; load average at start {load_average().split()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-") as tmp:
        repository = Path(tmp)
        names = build_repository(repository, settings)
        print((repository / names["batching"] / "config.pbtxt").read_text(), flush=True)
        spec = model_spec(repository, names["batching"])
        floor = measure_floor(spec, image, settings.floor)
        print(describe_floor(floor), flush=True)
        variants = [Variant(label, name, payload(name, image)) for label, name in names.items()]
        with inference_service(repository) as service:
            results = asyncio.run(
                bench_service(service.address, service.proc.pid, variants, floor, settings)
            )
    for line in ratio_lines(results, floor):
        print(line)
    print(f"load average at end {load_average().split()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
