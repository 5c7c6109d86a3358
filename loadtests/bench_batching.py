"""What dynamic batching costs a lone request and gains under load, per queue delay policy.

    python loadtests/bench_batching.py [--seconds 5] [--rounds 2] [--in-flight 1,16] [--quick]
                                       [--hidden 512] [--depth 1]

One inference service hosts the same TorchScript MLP (128 -> 512 -> 10 by
default; ``--hidden`` and ``--depth`` make the hidden layers wider and more
numerous, so that the model's own compute, which a batch shares, outweighs
the per-request cost of gRPC, which it does not; one intra-op thread, seeded
weights) three times:

- ``adaptive``  dynamic batching, max_batch_size 8, max_queue_delay 5 ms, the
                default ``queue_delay_policy: adaptive`` (shared/batch_delay.py);
- ``fixed``     the same batching with ``queue_delay_policy: fixed`` (Triton's
                semantics: a partial batch waits out the whole 5 ms);
- ``none``      no dynamic_batching block: every request runs alone.

Closed-loop gRPC (grpc.aio, pre-serialised batch-1 requests) straight to the
service at each in-flight level; rounds interleave the variants and the fastest
run of each is kept (a neighbour only slows a run down). Each row gives the
server's CPU per request, rows per execution (ModelStatistics), the cores the
rest of the machine used ("others") and the hypervisor's steal time
(/proc/stat) during the window. The ratios at the end are the two targets:

- p50 at 1 in flight, adaptive / none: at most 1.3 (batching costs a lone request
  next to nothing); measured twice: in the rounds above, and with the variants
  taking turns request by request (a neighbour's burst then slows them alike);
- req/s at 16 in flight, adaptive / none: at least 1.5 (batches still form).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from bench_inference import inference_service
from common import (
    INFER_METHOD,
    GrpcTarget,
    LoadResult,
    LoadSettings,
    add_load_flags,
    best_runs,
    closed_loop,
    format_table,
    install_sigterm_exit,
    load_average,
    load_from_flags,
)
from torch import nn

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs

IN, OUT = 128, 10
MAX_BATCH, DELAY_US = 8, 5000
VARIANTS = ("adaptive", "fixed", "none")
LATENCY_TARGET, RATE_TARGET = 1.3, 1.5

_CONFIG = """\
name: "{name}"
backend: "pytorch"
max_batch_size: {max_batch}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {inputs} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {outputs} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value {{ string_value: "1" }} }}
{extra}"""
_BATCHING = """\
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
parameters {{ key: "queue_delay_policy" value {{ string_value: "{policy}" }} }}
"""


@dataclass(frozen=True)
class Settings:
    """One benchmark run's knobs (parsed once from the command line)."""

    load: LoadSettings
    """Warm-up, window, settle time and rounds of each measurement."""
    in_flight: tuple[int, ...]
    """Concurrency levels; 1 gives the lone-request latency, 16 the throughput."""
    connections: int
    """gRPC connections the load is spread over."""
    hidden: int = 512
    """Width of each hidden layer."""
    depth: int = 1
    """Number of hidden layers."""


# -- the model and its repository ----------------------------------------------


def build_model(hidden: int, depth: int) -> nn.Module:
    """The MLP with weights from a fixed seed, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(25)
        layers: list[nn.Module] = []
        width = IN
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        model = nn.Sequential(*layers, nn.Linear(width, OUT))
    return model.eval()


def build_repository(root: Path, model: nn.Module) -> None:
    """One folder per variant, the same TorchScript file in each."""
    with torch.no_grad():
        scripted = torch.jit.trace(model, torch.zeros(1, IN))  # type: ignore[no-untyped-call]
    for variant in VARIANTS:
        version = root / f"mlp_{variant}" / "1"
        version.mkdir(parents=True)
        scripted.save(str(version / "model.pt"))
        extra = "" if variant == "none" else _BATCHING.format(delay_us=DELAY_US, policy=variant)
        text = _CONFIG.format(
            name=f"mlp_{variant}", max_batch=MAX_BATCH, inputs=IN, outputs=OUT, extra=extra
        )
        (root / f"mlp_{variant}" / "config.pbtxt").write_text(text)


def payload(variant: str, row: np.ndarray) -> bytes:
    """A batch-1 ModelInferRequest for one variant, serialised once."""
    request = pb.ModelInferRequest(model_name=f"mlp_{variant}")
    encode_inputs(request, {"INPUT0": row[None]})
    return request.SerializeToString()


# -- load ------------------------------------------------------------------------


def steal_seconds() -> float:
    """The hypervisor's steal time so far, all cores together (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / 100.0  # USER_HZ is 100 on Linux


async def check_answers(address: str, row: np.ndarray, expected: np.ndarray) -> None:
    """Each variant answers the row as the model does in this process."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        for variant in VARIANTS:
            reply = await stub.ModelInfer(pb.ModelInferRequest.FromString(payload(variant, row)))
            got = decode_outputs(reply)["OUTPUT0"][0]
            if not np.allclose(got, expected, atol=1e-5):
                raise AssertionError(f"mlp_{variant} answers {got}, expected {expected}")


async def statistics(stub: Any, variant: str) -> tuple[int, int, float]:
    """Rows, executions and the steal clock at one edge of a window."""
    reply = await stub.ModelStatistics(pb.ModelStatisticsRequest(name=f"mlp_{variant}"))
    stats = reply.model_stats[0]
    return stats.inference_count, stats.execution_count, steal_seconds()


async def load_once(
    address: str, pid: int, row: np.ndarray, variant: str, in_flight: int, settings: Settings
) -> LoadResult:
    """One closed-loop run of one variant at one level."""
    target = GrpcTarget(
        address, INFER_METHOD, payload(variant, row), max(1, min(in_flight, settings.connections))
    )
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            return await closed_loop(
                variant,
                target.calls(),
                in_flight,
                {"server": pid},
                settings.load,
                lambda: statistics(stub, variant),
            )
    finally:
        await target.close()


async def paired_lone(address: str, row: np.ndarray, seconds: float) -> dict[str, np.ndarray]:
    """One request in flight, the variants taking turns request by request, so a
    neighbour's burst slows them alike; each variant's latencies in ms."""
    targets = {v: GrpcTarget(address, INFER_METHOD, payload(v, row), 1) for v in VARIANTS}
    calls = {variant: target.calls()[0] for variant, target in targets.items()}
    latencies: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    try:
        for call in calls.values():  # open each connection before timing
            await call()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for variant, call in calls.items():
                started = time.perf_counter()
                await call()
                latencies[variant].append((time.perf_counter() - started) * 1000)
    finally:
        await asyncio.gather(*(target.close() for target in targets.values()))
    return {variant: np.asarray(values) for variant, values in latencies.items()}


def paired_lines(paired: dict[str, np.ndarray]) -> list[str]:
    """p50 of each variant taking turns at 1 in flight, and the ratios to no batching."""
    base = float(np.percentile(paired["none"], 50))
    lines = []
    for policy in ("adaptive", "fixed"):
        ours = float(np.percentile(paired[policy], 50))
        verdict = _verdict(ours / base <= LATENCY_TARGET) if policy == "adaptive" else ""
        lines.append(
            f"p50 @1 taking turns ({len(paired[policy])} each), {policy} / none: "
            f"{ours:.2f} / {base:.2f} ms = {ours / base:.2f}  (target <= {LATENCY_TARGET}){verdict}"
        )
    return lines


async def load_all(address: str, pid: int, row: np.ndarray, settings: Settings) -> list[LoadResult]:
    """Every variant at every level, rounds interleaved; prints each run as it ends."""
    runs = []
    for round_ in range(settings.load.rounds):
        for in_flight in settings.in_flight:
            for variant in VARIANTS:
                run = await load_once(address, pid, row, variant, in_flight, settings)
                print(
                    f"  {variant}@{in_flight} (round {round_ + 1}): {run.rate:.0f} req/s, "
                    f"p50 {run.percentile(50):.2f} ms, steal {steal(run):.2f} cores",
                    flush=True,
                )
                runs.append(run)
    return runs


# -- report ----------------------------------------------------------------------


def rows_per_exec(result: LoadResult) -> float:
    """Rows per model execution over the window."""
    (rows0, execs0, _), (rows1, execs1, _) = result.probes
    executions: int = max(1, execs1 - execs0)
    return float(rows1 - rows0) / executions


def steal(result: LoadResult) -> float:
    """Cores the hypervisor took, on average, over the window."""
    (_, _, first), (_, _, last) = result.probes
    return float(last - first) / result.usage.seconds


def table(results: Sequence[LoadResult]) -> str:
    """One row per (variant, level): rate, latency, CPU, batching, noise."""
    headers = ["variant", "in-flight", "req/s", "p50 ms", "p99 ms", "srv CPU ms/req"]
    headers += ["rows/exec", "others", "steal"]
    rows = [
        [
            r.label,
            r.in_flight,
            r.rate,
            r.percentile(50),
            r.percentile(99),
            r.cpu_ms("server"),
            rows_per_exec(r),
            r.usage.others,
            steal(r),
        ]
        for r in sorted(results, key=lambda r: (r.in_flight, VARIANTS.index(r.label)))
    ]
    return format_table(headers, rows)


def ratio_lines(results: Sequence[LoadResult]) -> list[str]:
    """The two targets (adaptive), and the same ratios for Triton's fixed delay."""
    by = {(r.label, r.in_flight): r for r in results}
    lines = []
    for policy in ("adaptive", "fixed"):
        if (policy, 1) in by and ("none", 1) in by:
            ours, base = by[(policy, 1)].percentile(50), by[("none", 1)].percentile(50)
            verdict = _verdict(ours / base <= LATENCY_TARGET) if policy == "adaptive" else ""
            lines.append(
                f"p50 @1, {policy} / none: {ours:.2f} / {base:.2f} ms = {ours / base:.2f}"
                f"  (target <= {LATENCY_TARGET}){verdict}"
            )
        if (policy, 16) in by and ("none", 16) in by:
            ours, base = by[(policy, 16)].rate, by[("none", 16)].rate
            verdict = _verdict(ours / base >= RATE_TARGET) if policy == "adaptive" else ""
            lines.append(
                f"req/s @16, {policy} / none: {ours:.0f} / {base:.0f} = {ours / base:.2f}"
                f"  (target >= {RATE_TARGET}){verdict}"
            )
    return lines


def _verdict(ok: bool) -> str:
    return " PASS" if ok else " MISS"


# -- command line ----------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings (``--quick``: short windows for a smoke run)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_load_flags(parser, seconds=5.0, warmup_s=1.5, settle_s=3.0, in_flight="1,16")
    parser.add_argument("--connections", type=int, default=4, help="gRPC connections")
    parser.add_argument("--hidden", type=int, default=512, help="width of each hidden layer")
    parser.add_argument("--depth", type=int, default=1, help="number of hidden layers")
    args = parser.parse_args(argv)
    if args.hidden < 1 or args.depth < 1:
        parser.error("--hidden and --depth must be at least 1")
    load, levels = load_from_flags(args)
    return Settings(load, levels, args.connections, args.hidden, args.depth)


def main(argv: Sequence[str] | None = None) -> int:
    """Build, serve, load, report; returns the exit status."""
    install_sigterm_exit()
    settings = parse_args(argv)
    model = build_model(settings.hidden, settings.depth)
    row = np.random.default_rng(0).standard_normal(IN, dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(row)[None]).numpy()[0]
    shape = " -> ".join(map(str, [IN, *[settings.hidden] * settings.depth, OUT]))
    print(f"MLP {shape}; load average at start {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshserve-batching-") as tmp:
        build_repository(Path(tmp), model)
        with inference_service(Path(tmp)) as service:
            asyncio.run(check_answers(service.address, row, expected))
            runs = asyncio.run(load_all(service.address, service.proc.pid, row, settings))
            paired = asyncio.run(paired_lone(service.address, row, settings.load.seconds * 2))
    results = best_runs(runs)
    print()
    print(table(results))
    print("(the fastest of the rounds; others / steal: cores used by other processes /")
    print(" taken by the hypervisor during the window)")
    print()
    print("\n".join([*ratio_lines(results), *paired_lines(paired)]))
    print(f"load average at end {load_average()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
