"""Two meshes on one pipeline, their windows alternating: is a change worth it?

On a shared 2-core host one window's rate moves by 10-30% from the next, so
two runs of ``bench_pipeline.py`` minutes apart cannot tell a 5% change from
the neighbours. Here both meshes run at once (the idle one costs next to
nothing), each round loads one and then the other (the order alternating from
round to round), and the report gives each round's B/A ratio of req/s and of
CPU per request and their medians:

    python loadtests/ab_pipeline.py --b ../other-checkout              # code
    python loadtests/ab_pipeline.py --b-env MESHSERVE_X=1,OTHER=2      # settings

``--a``/``--b``: the checkouts whose code each mesh runs (both default to this
one); ``--a-env``/``--b-env``: ``NAME=VALUE`` pairs set in that mesh's
processes. The load is ``bench_pipeline.py``'s (one ensemble request,
``--in-flight`` in flight over its gRPC connections), its CPU every process of
each mesh plus the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
from bench_pipeline import (
    FLOORS,
    Pipeline,
    Settings,
    infer_payload,
    load_once,
    parse_args,
    pipeline_input,
    pipeline_mesh,
)
from common import ROOT, LoadResult, MeshInfo, install_sigterm_exit, load_average

from inference import grpc_service_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Side:
    """One of the two meshes."""

    name: str
    tree: Path
    environment: dict[str, str]


@dataclass(frozen=True)
class Window:
    """One measured window of one side."""

    rate: float
    cpu_ms: float
    """CPU ms per request: the mesh's processes and the load generator."""
    by_process: dict[str, float]


def environment(pairs: str) -> dict[str, str]:
    """``A=1,B=2`` -> {"A": "1", "B": "2"}; a pair without ``=`` is an error."""
    parsed: dict[str, str] = {}
    for pair in filter(None, pairs.split(",")):
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--a-env/--b-env: {pair!r} is not NAME=VALUE")
        parsed[name] = value
    return parsed


def parse(argv: Sequence[str] | None) -> tuple[Settings, Pipeline, list[Side]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--a", type=Path, default=ROOT, help="checkout of mesh A")
    parser.add_argument("--b", type=Path, default=ROOT, help="checkout of mesh B")
    parser.add_argument("--a-env", default="", help="NAME=VALUE,... for mesh A")
    parser.add_argument("--b-env", default="", help="NAME=VALUE,... for mesh B")
    parser.add_argument("--pipeline", choices=sorted(FLOORS), default="text_embedding")
    parser.add_argument("--layout", choices=("separate", "colocated"), default="colocated")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0, help="window per side and round")
    args = parser.parse_args(argv)
    load = ["--in-flight", str(args.in_flight), "--rounds", str(args.rounds)]
    load += ["--seconds", str(args.seconds), "--warmup", "1", "--settle", "1"]
    settings = parse_args(["--pipeline", args.pipeline, *load])
    pipe = replace(
        Pipeline(args.pipeline, FLOORS[args.pipeline].steps),
        colocated=args.layout == "colocated",
    )
    sides = [
        Side("A", args.a.resolve(), environment(args.a_env)),
        Side("B", args.b.resolve(), environment(args.b_env)),
    ]
    return settings, pipe, sides


def window(run: LoadResult) -> Window:
    usage, count = run.usage, max(run.completed, 1)
    by_process = {name: seconds * 1000 / count for name, seconds in usage.processes.items()}
    by_process["client"] = usage.client * 1000 / count
    return Window(run.rate, sum(by_process.values()), by_process)


async def one_window(
    info: MeshInfo, pipe: Pipeline, payload: bytes, settings: Settings, in_flight: int
) -> Window:
    async with grpc.aio.insecure_channel(info.orchestrator) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return window(await load_once(info, pipe, payload, settings, in_flight, stub))


def shown(parts: dict[str, float]) -> str:
    """The processes that spent at least 0.05 ms per request."""
    return " ".join(f"{name} {ms:.2f}" for name, ms in parts.items() if ms >= 0.05)


async def compare(settings: Settings, pipe: Pipeline, sides: list[Side]) -> int:
    data = pipeline_input(pipe, settings)
    payload = infer_payload(pipe, data)
    in_flight = settings.in_flight[0]
    with contextlib.ExitStack() as stack:
        infos = {}
        for side in sides:
            infos[side.name] = stack.enter_context(
                pipeline_mesh(
                    settings.repository,
                    pipe,
                    settings.tracing,
                    tree=side.tree,
                    environment=side.environment,
                )
            )
            env = ",".join(f"{k}={v}" for k, v in side.environment.items()) or "-"
            print(f"{side.name}: {side.tree} (env {env}) at {infos[side.name].orchestrator}")
        windows: dict[str, list[Window]] = {"A": [], "B": []}
        for round_ in range(settings.load.rounds):
            order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for name in order:
                result = await one_window(infos[name], pipe, payload, settings, in_flight)
                windows[name].append(result)
                print(
                    f"round {round_ + 1} {name}: {result.rate:7.1f} req/s, "
                    f"{result.cpu_ms:.2f} ms CPU/req ({shown(result.by_process)})",
                    flush=True,
                )
    a, b = windows["A"], windows["B"]
    rates = [y.rate / x.rate for x, y in zip(a, b, strict=True)]
    cpus = [y.cpu_ms / x.cpu_ms for x, y in zip(a, b, strict=True)]
    print(f"\n{pipe.ensemble} @{in_flight}, {len(rates)} rounds; load average {load_average()}")
    print("B/A req/s by round:   " + " ".join(f"{r:.2f}" for r in rates))
    print("B/A CPU/req by round: " + " ".join(f"{r:.2f}" for r in cpus))
    print(
        f"median: req/s {np.median(rates):.3f} (B ahead in {sum(r > 1 for r in rates)} "
        f"of {len(rates)}), CPU per request {np.median(cpus):.3f}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    install_sigterm_exit()
    settings, pipe, sides = parse(argv)
    return asyncio.run(compare(settings, pipe, sides))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the meshes are already stopped by pipeline_mesh's finally
        sys.exit(130)
