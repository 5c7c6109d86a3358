"""What the gRPC front doors add to a small model's request, against KServe's server.

    python loadtests/bench_forwarding.py [--seconds 5] [--rounds 3] [--in-flight 16]
                                         [--no-kserve]

One TorchScript MLP (128 -> 512 -> 10, one intra-op thread, no dynamic
batching, batch 1 per request) behind four doors, each loaded in turn with the
same pre-serialised KServe v2 ModelInfer (closed loop over 4 HTTP/2
connections), rounds interleaved:

- ``stage``    the inference stage directly;
- ``thread``   the same stage and MLP with ``inline_execution_us: 0``: every batch
               runs in the instance's thread, as before batches measured cheap ran
               on the event loop (shared/inline_budget.py);
- ``orch``     the orchestrator in front of that stage (a stage model's request is
               forwarded undecoded; without a deadline, on an open stream, several
               requests to a message when several wait);
- ``plain``    a second orchestrator in front of the same stage, with
               ``--packed-forwarding false``: one request per stream message (the
               old path, side by side);
- ``envoy``    Envoy's gRPC port in front of that orchestrator;
- ``kserve``   KServe 0.21's own server with the same model (its venv from
               ``make kserve-client``; skipped with a note where it is missing).

Server CPU per request comes from /proc of each process on the path, CPU steal
(the hypervisor's) and "others" (the rest of the machine) from /proc/stat over
each window. It prints every round, then per door the median over rounds, and:
the orchestrator hop (CPU per request through the orchestrator minus the stage
directly; packed and plain), and the rate ratios stage / thread, orch / plain,
envoy / stage, stage / kserve, envoy / kserve.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from common import (
    INFER_METHOD,
    ROOT,
    GrpcTarget,
    LoadResult,
    LoadSettings,
    child_named,
    closed_loop,
    format_table,
    load_average,
)

from deploy.local.procfs import TICKS
from inference import grpc_service_pb2 as pb
from shared.ports import free_port
from shared.tensors import encode_inputs

TORCH_MODULES = (
    "torch",
    "torchgen",
    "functorch",
    "sympy",
    "mpmath",
    "networkx",
    "filelock",
    "fsspec",
    "jinja2",
    "markupsafe",
    "typing_extensions.py",
)
"""What torch imports, for KServe's venv (which has none of it)."""
KSERVE_PYTHON = Path("~/.cache/meshserve/venvs/kserve-0.21.0/bin/python").expanduser()
CONFIG = """\
name: "{name}"
backend: "pytorch"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 128 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 10 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
"""
THREAD_ONLY = """\
parameters { key: "inline_execution_us" value: { string_value: "0" } }
"""
THREAD_MODEL = "mlp_thread"


@dataclass(frozen=True)
class Door:
    """One way in: its address and the processes a request passes through."""

    name: str
    address: str
    pids: dict[str, int]
    model: str = "mlp"


@dataclass(frozen=True)
class Run:
    """One door's closed-loop window and the steal seen meanwhile (cores)."""

    result: LoadResult
    steal: float

    @property
    def cpu_ms(self) -> float:
        """Server CPU per request, every process on the path."""
        return self.result.cpu_ms(*self.result.usage.processes)


def steal_seconds() -> float:
    """CPU time the hypervisor took from this machine so far (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / TICKS


def build_repository(root: Path) -> Path:
    """The MLP twice: ``mlp``, and ``mlp_thread`` whose batches never leave its thread."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)]
    module = torch.jit.script(torch.nn.Sequential(*layers))  # type: ignore[no-untyped-call]
    for name, extra in (("mlp", ""), (THREAD_MODEL, THREAD_ONLY)):
        (root / name / "1").mkdir(parents=True)
        module.save(str(root / name / "1" / "model.pt"))
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name) + extra)
    return root


def payload(model: str = "mlp") -> bytes:
    """One row of 128 floats, serialised once."""
    request = pb.ModelInferRequest(model_name=model)
    rows = np.random.default_rng(0).standard_normal((1, 128), dtype=np.float32)
    encode_inputs(request, {"INPUT": rows})
    return request.SerializeToString()


@contextmanager
def mesh_doors(repository: Path) -> Iterator[list[Door]]:
    """Stage, orchestrator and Envoy, chained; stopped by PID on exit."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests/ is beside the installed packages
    from tests.harness import ServiceProcess

    hosting = ["--model-repository", str(repository), "--metrics-port", "-1"]
    with ExitStack() as stack:
        stage = ServiceProcess("services.inference.main", hosting)
        stack.callback(stage.stop)
        stages = ["--stages", f"inference={stage.address}"]
        orchestrator = ServiceProcess("services.orchestrator.main", [*hosting, *stages])
        stack.callback(orchestrator.stop)
        unpacked = [*hosting, *stages, "--packed-forwarding", "false"]
        plain = ServiceProcess("services.orchestrator.main", unpacked)
        stack.callback(plain.stop)
        edge = ["--orchestrator", orchestrator.address, "--http-adapter", "127.0.0.1:9"]
        envoy = ServiceProcess("gateway.envoy.main", [*edge, "--metrics-port", "-1"])
        stack.callback(envoy.stop)
        envoy_pid = child_named(envoy.proc.pid, "envoy") or envoy.proc.pid
        path = {"stage": stage.proc.pid}
        yield [
            Door("stage", stage.address, path),
            Door("thread", stage.address, path, THREAD_MODEL),
            Door("orch", orchestrator.address, {**path, "orch": orchestrator.proc.pid}),
            Door("plain", plain.address, {**path, "orch": plain.proc.pid}),
            Door(
                "envoy",
                envoy.address,
                {**path, "orch": orchestrator.proc.pid, "envoy": envoy_pid},
            ),
        ]


def torch_only(folder: Path) -> Path:
    """A folder holding torch and what it imports, linked from this venv: all of
    this venv on KServe's path would have KServe import transformers (and scan
    every installed package) at start."""
    site = Path(torch.__file__).resolve().parent.parent
    folder.mkdir()
    for name in TORCH_MODULES:
        if (site / name).exists():
            (folder / name).symlink_to(site / name)
    return folder


@contextmanager
def kserve_door(repository: Path, folder: Path) -> Iterator[Door]:
    """KServe's server with the same model; stopped by PID on exit."""
    ports = [free_port(), free_port()]
    command = [str(KSERVE_PYTHON), str(Path(__file__).with_name("kserve_mlp.py"))]
    command += [str(repository / "mlp" / "1" / "model.pt"), str(torch_only(folder / "torch"))]
    command += ["--grpc_port", str(ports[0]), "--http_port", str(ports[1])]
    with (folder / "kserve.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{ports[0]}"
        asyncio.run(_until_answers(address, process))
        yield Door("kserve", address, {"kserve": process.pid})
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _until_answers(address: str, process: subprocess.Popen[bytes]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER_METHOD)
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError(f"KServe exited with {process.returncode}")
            try:
                await call(payload(), timeout=1)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
    raise RuntimeError("KServe did not answer in 120 s")


async def measure(door: Door, in_flight: int, settings: LoadSettings) -> Run:
    """One closed-loop window on ``door``."""
    target = GrpcTarget(door.address, INFER_METHOD, payload(door.model), 4)

    async def steal() -> float:
        return steal_seconds()

    try:
        result = await closed_loop(door.name, target.calls(), in_flight, door.pids, settings, steal)
    finally:
        await target.close()
    first, last = result.probes
    return Run(result, (last - first) / result.usage.seconds)


async def measure_all(
    doors: Sequence[Door], in_flight: int, settings: LoadSettings, rounds: int
) -> dict[str, list[Run]]:
    """Every door once per round, rounds interleaved; each round printed."""
    runs: dict[str, list[Run]] = {door.name: [] for door in doors}
    for index in range(rounds):
        rows = []
        for door in doors:
            run = await measure(door, in_flight, settings)
            runs[door.name].append(run)
            rows.append(_row(door.name, [run]))
        print(f"round {index + 1} ({load_average()})\n" + format_table(HEADERS, rows), flush=True)
    return runs


HEADERS = ["door", "req/s", "p50 ms", "p99 ms", "CPU ms/req", "by process", "steal", "others"]


def _row(name: str, runs: Sequence[Run]) -> list[object]:
    def median(values: Sequence[float]) -> float:
        return statistics.median(values)

    processes = runs[0].result.usage.processes
    parts = " ".join(
        f"{label} {median([r.result.cpu_ms(label) for r in runs]):.2f}" for label in processes
    )
    return [
        name,
        median([r.result.rate for r in runs]),
        median([r.result.percentile(50) for r in runs]),
        median([r.result.percentile(99) for r in runs]),
        median([r.cpu_ms for r in runs]),
        parts,
        median([r.steal for r in runs]),
        median([r.result.usage.others for r in runs]),
    ]


def summary(runs: dict[str, list[Run]]) -> str:
    """Medians over rounds, the orchestrator hop and the rate ratios."""
    rows = [_row(name, door_runs) for name, door_runs in runs.items()]
    lines = ["median over rounds\n" + format_table(HEADERS, rows)]

    def rate(name: str) -> float:
        return statistics.median(r.result.rate for r in runs[name])

    def cpu(name: str) -> float:
        return statistics.median(r.cpu_ms for r in runs[name])

    for door in ("orch", "plain"):
        own = statistics.median(r.result.cpu_ms("orch") for r in runs[door])
        lines.append(
            f"orchestrator hop ({door}): +{cpu(door) - cpu('stage'):.2f} ms CPU per request "
            f"(the orchestrator's own {own:.2f} ms)"
        )
    lines.append(f"orch / plain: {rate('orch') / rate('plain'):.2f}x req/s")
    lines.append(
        f"stage / thread: {rate('stage') / rate('thread'):.2f}x req/s, CPU per request "
        f"{cpu('stage'):.2f} against {cpu('thread'):.2f} ms"
    )
    lines.append(f"envoy / stage: {rate('envoy') / rate('stage'):.2f}x req/s")
    if "kserve" in runs:
        lines.append(f"stage / kserve: {rate('stage') / rate('kserve'):.2f}x req/s")
        lines.append(f"envoy / kserve: {rate('envoy') / rate('kserve'):.2f}x req/s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="load before each window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--in-flight", type=int, default=16, help="requests in flight")
    parser.add_argument("--no-kserve", action="store_true", help="leave KServe out")
    args = parser.parse_args(argv)
    settings = LoadSettings(args.seconds, args.warmup, settle_s=0.0)
    with tempfile.TemporaryDirectory(prefix="meshserve-forwarding-") as tmp:
        repository = build_repository(Path(tmp) / "repository")
        with ExitStack() as stack:
            doors = stack.enter_context(mesh_doors(repository))
            if args.no_kserve or not KSERVE_PYTHON.exists():
                print(f"KServe left out ({KSERVE_PYTHON} missing: `make kserve-client`)")
            else:
                doors.append(stack.enter_context(kserve_door(repository, Path(tmp))))
            print(f"{os.cpu_count()} cores; load average {load_average()}", flush=True)
            runs = asyncio.run(measure_all(doors, args.in_flight, settings, args.rounds))
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
