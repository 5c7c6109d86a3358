"""Check the inference service on CUDA: outputs, placement, dynamic batching, throughput.

On a fresh GPU machine, from the repository root:

    pip install -e .               # the project (the pinned torch wheel on Linux is a CUDA build)
    python -m models.prepare       # builds ~/.cache/meshserve/repository (or $MESHSERVE_CACHE)
    python scripts/gpu_check.py    # about a minute; prints `check | result | detail`

It builds a temporary repository from the prepared model files: ``mobilenet_v2``
(TorchScript) with ``instance_group [{ count: 2 kind: KIND_GPU gpus: [0] }]`` and
dynamic batching, and ``mlp`` with one KIND_GPU instance; starts one inference
service on it; and checks

(a) each model's outputs over gRPC equal a local CPU torch forward of the same file,
(b) the server process really holds GPU memory (nvidia-smi, per process when it
    lists processes, else the device's memory before and while the server runs),
(c) under 64 requests in flight, ModelStatistics' batch_stats show batches > 1,
(d) throughput at 64 in flight with batching (closed loop, batch-1 requests).

Without CUDA it prints "CUDA not available", checks that the service starts and
marks the KIND_GPU models UNAVAILABLE with a reason naming KIND_GPU and CUDA,
and exits 0 if so.
Exit status 1 means a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from deploy.local.procfs import process_cpu_seconds
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.prepare import default_cache
from shared.tensors import decode_outputs, encode_inputs

ROOT = Path(__file__).resolve().parent.parent
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
INFER_METHOD = f"/{SERVICE}/ModelInfer"
IN_FLIGHT = 64
TOLERANCE = 1e-2
"""Largest |GPU - CPU| relative to the largest |CPU| output: cuDNN runs float32
convolutions in TF32 by torch's default, which moves MobileNetV2 logits ~1e-3."""
START_TIMEOUT_S = 150.0

MOBILENET_CONFIG = """\
name: "mobilenet_v2"
backend: "pytorch"
max_batch_size: 64
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] } ]
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching {
  preferred_batch_size: [ 16, 32 ]
  max_queue_delay_microseconds: 500
}
"""
MLP_CONFIG = """\
name: "mlp"
backend: "pytorch"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""


@dataclass(frozen=True)
class Model:
    """One model of the check repository and the tensors it is checked with."""

    name: str
    config: str
    input: str
    output: str
    sample_shape: tuple[int, ...]
    """Shape of the request sent for the output check (batch dimension first)."""


MODELS = (
    Model("mobilenet_v2", MOBILENET_CONFIG, "input", "logits", (2, 3, 224, 224)),
    Model("mlp", MLP_CONFIG, "INPUT0", "OUTPUT0", (4, 16)),
)
MOBILENET = MODELS[0]


@dataclass(frozen=True)
class Check:
    """One row of the result table."""

    name: str
    ok: bool
    result: str
    detail: str


@dataclass
class LoadStats:
    """What a closed-loop run measured."""

    completed: int = 0
    seconds: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)
    client_cores: float = 0.0
    server_cores: float = 0.0


# -- repository and service ----------------------------------------------------


def build_repository(root: Path, source: Path) -> None:
    """The check models, each with its GPU config and a link to the prepared model.pt."""
    for model in MODELS:
        prepared = source / model.name / "1" / "model.pt"
        if not prepared.is_file():
            raise SystemExit(f"{prepared} is missing: run `python -m models.prepare` first")
        version = root / model.name / "1"
        version.mkdir(parents=True)
        (version / "model.pt").symlink_to(prepared.resolve())
        (root / model.name / "config.pbtxt").write_text(model.config)


def _harness() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/ is beside the installed packages, not in them
    from tests import harness

    return harness


@contextmanager
def inference_service(repository: Path) -> Iterator[Any]:
    """One inference service on ``repository``, stopped by PID (SIGTERM) on exit."""
    service = _harness().ServiceProcess(
        "services.inference.main",
        ["--model-repository", str(repository)],
        timeout=START_TIMEOUT_S,
    )
    try:
        yield service
    finally:
        service.stop()
        service.log_path.unlink(missing_ok=True)


# -- (a) outputs ---------------------------------------------------------------


def sample_input(model: Model) -> np.ndarray:
    """A fixed pseudo-random input for ``model``."""
    return np.random.default_rng(7).standard_normal(model.sample_shape, dtype=np.float32)


def cpu_forward(path: Path, array: np.ndarray) -> np.ndarray:
    """The TorchScript file run on the CPU in this process."""
    import torch

    module = torch.jit.load(str(path), map_location="cpu").eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        result = module(torch.from_numpy(array))
    return np.asarray(result.numpy())


async def check_outputs(stub: Any, repository: Path) -> list[Check]:
    """(a) Each model's GPU answer against a CPU forward of the same file."""
    checks = []
    for model in MODELS:
        array = sample_input(model)
        request = pb.ModelInferRequest(model_name=model.name)
        encode_inputs(request, {model.input: array})
        got = decode_outputs(await stub.ModelInfer(request))[model.output]
        want = cpu_forward(repository / model.name / "1" / "model.pt", array)
        relative = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))
        same_top = bool(np.array_equal(got.argmax(axis=1), want.argmax(axis=1)))
        detail = (
            f"shape {list(got.shape)}, max|gpu-cpu|/max|cpu| = {relative:.1e} "
            f"(tolerance {TOLERANCE:g}), same argmax per row: {same_top}"
        )
        ok = got.shape == want.shape and relative <= TOLERANCE
        checks.append(Check(f"(a) {model.name} output = CPU torch", ok, _word(ok), detail))
    return checks


# -- (b) placement -------------------------------------------------------------


def _nvidia_smi(*query: str) -> list[list[str]]:
    """Rows of an nvidia-smi CSV query; empty when nvidia-smi is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return []
    command = ["nvidia-smi", *query, "--format=csv,noheader,nounits"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return []
    return [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines()]


def gpu_memory_used_mib() -> int | None:
    """Memory in use on GPU 0, from nvidia-smi (None without it)."""
    rows = _nvidia_smi("--query-gpu=memory.used", "--id=0")
    return int(rows[0][0]) if rows and rows[0][0].isdigit() else None


def check_placement(pid: int, baseline_mib: int | None) -> Check:
    """(b) The server process holds GPU memory: per process if listed, else device-wide."""
    name = "(b) instances run on cuda"
    processes = _nvidia_smi("--query-compute-apps=pid,used_memory")
    mine = [row for row in processes if row and row[0] == str(pid)]
    if mine:
        detail = f"nvidia-smi lists server pid {pid} with {mine[0][1]} MiB of GPU memory"
        return Check(name, True, "PASS", detail)
    now = gpu_memory_used_mib()
    if now is None or baseline_mib is None:
        return Check(name, False, "FAIL", "nvidia-smi is not available: no observable evidence")
    grown = now - baseline_mib
    ok = grown >= 100  # a CUDA context plus two MobileNetV2 copies is several hundred MiB
    detail = (
        f"nvidia-smi lists no process rows for pid {pid} (pid namespace?); GPU 0 memory "
        f"{baseline_mib} -> {now} MiB (+{grown}) while the server runs"
    )
    return Check(name, ok, _word(ok), detail)


# -- (c) and (d) batching under load -------------------------------------------


async def closed_loop(
    address: str, pid: int, request: bytes, seconds: float, warmup_s: float
) -> LoadStats:
    """``IN_FLIGHT`` callers sending ``request`` back to back; the measured window's stats."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(8)]
    calls = [channel.unary_unary(INFER_METHOD) for channel in channels]
    stats, state = LoadStats(), {"measure": False, "stop": False}

    async def caller(call: Any) -> None:
        while not state["stop"]:
            started = time.perf_counter_ns()
            await call(request)
            if state["measure"]:
                stats.latencies_ns.append(time.perf_counter_ns() - started)

    tasks = [asyncio.create_task(caller(calls[i % len(calls)])) for i in range(IN_FLIGHT)]
    try:
        await asyncio.sleep(warmup_s)
        state["measure"], started = True, time.perf_counter()
        client, server = _own_cpu(), process_cpu_seconds(pid)
        await asyncio.sleep(seconds)
        state["measure"], state["stop"] = False, True
        stats.seconds = time.perf_counter() - started
        stats.client_cores = (_own_cpu() - client) / stats.seconds
        stats.server_cores = (process_cpu_seconds(pid) - server) / stats.seconds
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for channel in channels:
            await channel.close()
    stats.completed = len(stats.latencies_ns)
    return stats


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def throughput_check(stats: LoadStats) -> Check:
    """(d) The closed-loop rate and latencies."""
    if not stats.completed:
        return Check(f"(d) throughput @{IN_FLIGHT} in flight", False, "FAIL", "no request done")
    p50, p99 = np.percentile(np.asarray(stats.latencies_ns) / 1e6, [50, 99])
    rate = stats.completed / stats.seconds
    detail = (
        f"mobilenet_v2 batch-1 requests, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"server {stats.server_cores:.2f} cores, load generator {stats.client_cores:.2f} cores"
    )
    return Check(f"(d) throughput @{IN_FLIGHT} in flight", True, f"{rate:.0f} req/s", detail)


async def batching_check(stub: Any) -> Check:
    """(c) ModelStatistics: executions with more than one row happened."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=MOBILENET.name))
    stats = reply.model_stats[0]
    sizes = {entry.batch_size: entry.compute_infer.count for entry in stats.batch_stats}
    top = sorted(sizes.items(), key=lambda item: -item[1])[:4]
    mean = stats.inference_count / max(1, stats.execution_count)
    ok = any(size > 1 for size in sizes)
    detail = (
        f"{stats.execution_count} executions, {mean:.1f} rows/execution; most frequent "
        + ", ".join(f"{size} rows x{count}" for size, count in top)
    )
    return Check(f"(c) batches > 1 @{IN_FLIGHT} in flight", ok, _word(ok), detail)


async def run_checks(
    address: str, pid: int, repository: Path, seconds: float, baseline_mib: int | None
) -> list[Check]:
    """(a)-(d) against a running service; ``baseline_mib``: GPU memory before it started."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        checks = await check_outputs(stub, repository)
        checks.append(check_placement(pid, baseline_mib))
        request = pb.ModelInferRequest(model_name=MOBILENET.name)
        encode_inputs(request, {MOBILENET.input: sample_input(MOBILENET)[:1]})
        load = await closed_loop(address, pid, request.SerializeToString(), seconds, 3.0)
        checks.append(await batching_check(stub))
        checks.append(throughput_check(load))
    return checks


# -- without CUDA --------------------------------------------------------------


def check_refusal(repository: Path) -> Check:
    """Without CUDA the service stays up and marks each KIND_GPU model UNAVAILABLE,
    with a reason naming KIND_GPU and CUDA (a bad model does not take it down)."""
    name = "KIND_GPU refused without CUDA"
    try:
        with inference_service(repository) as service:
            index = asyncio.run(_repository_index(service.address))
    except RuntimeError as exc:
        return Check(name, False, "FAIL", f"the service did not start: {str(exc)[-300:]}")
    wanted = {model.name for model in MODELS}
    refused = {
        entry.name: entry.reason
        for entry in index.models
        if entry.name in wanted
        and entry.state == "UNAVAILABLE"
        and "KIND_GPU" in entry.reason
        and "CUDA" in entry.reason
    }
    ok = refused.keys() == wanted
    states = ", ".join(f"{entry.name} {entry.state}" for entry in index.models)
    detail = next(iter(refused.values())) if ok else f"repository index: {states}"
    return Check(name, ok, _word(ok), detail)


async def _repository_index(address: str) -> Any:
    """The service's RepositoryIndex answer."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        return await stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10.0)


# -- report and entry point ----------------------------------------------------


def _word(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_table(checks: Sequence[Check]) -> None:
    """``check | result | detail``, columns aligned."""
    width = max(len("check"), *(len(check.name) for check in checks))
    result_width = max(len("result"), *(len(check.result) for check in checks))
    print(f"{'check':<{width}} | {'result':<{result_width}} | detail")
    print(f"{'-' * width}-|-{'-' * result_width}-|-------")
    for check in checks:
        print(f"{check.name:<{width}} | {check.result:<{result_width}} | {check.detail}")


def cuda_summary() -> tuple[bool, str]:
    """Whether torch sees CUDA, and a line saying what it sees."""
    import torch

    if not torch.cuda.is_available():
        return (
            False,
            f"CUDA not available (torch {torch.__version__}, CUDA build: {torch.version.cuda})",
        )
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return True, f"CUDA available: torch {torch.__version__}, CUDA {torch.version.cuda}, {names}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cache", type=Path, default=None, help="models.prepare cache folder")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured load window")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks that this host allows; 0 when all of them pass."""
    args = parse_args(argv)
    source = (args.cache or default_cache()) / "repository"
    has_cuda, summary = cuda_summary()
    print(summary, flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshserve-gpu-check-") as tmp:
        repository = Path(tmp)
        build_repository(repository, source)
        if not has_cuda:
            checks = [check_refusal(repository)]
        else:
            baseline = gpu_memory_used_mib()
            with inference_service(repository) as service:
                pid = service.proc.pid
                checks = asyncio.run(
                    run_checks(service.address, pid, repository, args.seconds, baseline)
                )
    print_table(checks)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
