"""Tracing's cost: the mesh exporting every span to its local trace store vs no tracing.

    python loadtests/bench_tracing.py [--seconds 10] [--rounds 2] [--in-flight 16]
                                      [--sample-ratio 0.1]

``text_embedding`` (tokenizer -> MiniLM -> mean pool, three stages behind the
orchestrator) over gRPC through Envoy, closed loop at ``--in-flight``, on a
mesh of only the text models (no LLM). Two meshes, started in turn for each
round:

- ``off``: no trace store and no OTLP endpoint (``supervisor.trace_store:
  false``): spans are not recorded, the trace context still travels;
- ``on``:  the default: the trace store runs and every process (Envoy too)
  exports its spans to it; the store's own CPU counts as tracing's cost;
- ``on R`` (with ``--sample-ratio R``): the same, with ``trace_sample_ratio: R``
  (a share R of the requests recorded, decided at Envoy).

The fastest run of each is kept (a neighbour on a shared machine only ever
slows a run down) and the ratio on/off of throughput is printed, with p50/p99
and CPU per request of the mesh's processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.local.procfs import child_pids
from inference import grpc_service_pb2 as pb
from loadtests.common import (
    DEFAULT_REPOSITORY,
    INFER_METHOD,
    ROOT,
    GrpcTarget,
    LoadResult,
    LoadSettings,
    MeshInfo,
    _stop_mesh,
    _wait_ready,
    best_runs,
    closed_loop,
    format_table,
    install_sigterm_exit,
    load_average,
    start_supervisor,
)
from shared.tensors import encode_inputs

TEXT_MODELS = ("text_embedding", "minilm_tokenizer", "minilm", "mean_pool")
SENTENCE = b"The quick brown fox jumps over the lazy dog near the river bank."


@contextlib.contextmanager
def text_mesh(repository: Path, tracing: bool, sample_ratio: float = 1.0) -> Iterator[MeshInfo]:
    """The mesh on the text models only, with tracing on (the default) or off."""
    with tempfile.TemporaryDirectory(prefix="meshserve-bench-tracing-") as tmp:
        folder = Path(tmp)
        models = folder / "repository"
        models.mkdir()
        for name in TEXT_MODELS:
            (models / name).symlink_to(repository.expanduser().resolve() / name)
        document = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
        supervisor = document.setdefault("supervisor", {})
        supervisor["trace_store"] = tracing
        document.setdefault("defaults", {})["trace_sample_ratio"] = sample_ratio
        supervisor["stages"] = [s for s in supervisor["stages"] if s["name"] != "preprocess"]
        supervisor["jobs"] = {"enabled": False}
        config = folder / "mesh.yaml"
        config.write_text(yaml.safe_dump(document, sort_keys=False))
        proc = start_supervisor(models, config, folder / "mesh.log", 180.0)
        started: dict[int, int | None] = {}
        try:
            info = _wait_ready(proc, 180.0, folder / "mesh.log")
            started = {pid: None for pid in info.pids.values()}
            yield info
        finally:
            _stop_mesh(proc, started)


def payload() -> bytes:
    request = pb.ModelInferRequest(model_name="text_embedding")
    encode_inputs(request, {"TEXT": np.array([[SENTENCE]], dtype=object)})
    return request.SerializeToString()


def trace_store_pid(supervisor: int) -> int | None:
    """The trace store's process among the supervisor's children (None when off)."""
    for pid in child_pids(supervisor):
        with contextlib.suppress(OSError):
            if b"services.tracestore.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


async def one_run(info: MeshInfo, label: str, args: argparse.Namespace) -> LoadResult:
    target = GrpcTarget(info.edge, INFER_METHOD, payload(), connections=4)
    settings = LoadSettings(args.seconds, args.warmup_s, args.settle_s)
    pids = {k: v for k, v in info.pids.items() if k != "envoy_wrapper"}
    store = trace_store_pid(info.supervisor_pid)
    if store is not None:
        pids["tracestore"] = store
    try:
        return await closed_loop(label, target.calls(), args.in_flight, pids, settings)
    finally:
        await target.close()


def mesh_cpu_ms(run: LoadResult) -> float:
    """CPU ms per request of every process of the mesh together."""
    return 1000.0 * sum(run.usage.processes.values()) / run.per()


def report(runs: list[LoadResult]) -> None:
    best = {run.label: run for run in best_runs(runs)}
    labels = sorted(best, key=lambda label: (label != "off", label != "on", label))
    rows = []
    for label in labels:
        run = best[label]
        mesh_cpu = mesh_cpu_ms(run)
        rows.append(
            [
                label,
                run.in_flight,
                f"{run.rate:.1f}",
                f"{run.percentile(50):.1f}",
                f"{run.percentile(99):.1f}",
                f"{mesh_cpu:.2f}",
                run.errors,
                f"{run.usage.others:.2f}",
            ]
        )
    headers = ["tracing", "in flight", "req/s", "p50 ms", "p99 ms", "mesh CPU ms/req"]
    print(format_table([*headers, "errors", "others (cores)"], rows))
    names = sorted({name for run in best.values() for name in run.usage.processes})
    per_process = [
        [name, *(f"{best[label].cpu_ms(name):.2f}" for label in labels)] for name in names
    ]
    print("\nCPU ms per request, by process")
    print(format_table(["process", *labels], per_process))
    for label in labels[1:]:
        ratio = best[label].rate / best["off"].rate
        extra = mesh_cpu_ms(best[label]) - mesh_cpu_ms(best["off"])
        print(
            f"\nthroughput with tracing {label} / off: {ratio:.3f}x  (aim: >= 0.95x); "
            f"mesh CPU {extra:+.2f} ms per request"
        )
    print(f"load average: {load_average()}")


async def main_async(args: argparse.Namespace) -> None:
    runs = []
    variants = [("off", False, 1.0), ("on", True, 1.0)]
    if args.sample_ratio is not None:
        variants.append((f"on {args.sample_ratio:g}", True, args.sample_ratio))
    for round_ in range(args.rounds):
        for label, tracing, ratio in variants:
            with text_mesh(args.repository, tracing, ratio) as info:
                run = await one_run(info, label, args)
            print(f"round {round_ + 1} tracing {label}: {run.rate:.1f} req/s", flush=True)
            runs.append(run)
    report(runs)


def main() -> None:
    """Run both meshes in turn and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument(
        "--sample-ratio", type=float, help="also measure tracing at this trace_sample_ratio"
    )
    args = parser.parse_args()
    install_sigterm_exit()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
