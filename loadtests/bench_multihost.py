"""Two pipelines with every stage on its own "host" (0.5 ms links) vs on loopback.

    python loadtests/bench_multihost.py [--seconds 4] [--rounds 2] [--in-flight 1,8]
                                        [--delay-ms 0.5] [--quick]

Needs root and ``ip`` (network namespaces) and the prepared default repository
(``make models``). In order:

1. a repository of links to the prepared ``image_classifier`` and
   ``text_embedding`` ensembles and their six steps (no LLM);
2. the same four stages twice, side by side: once on 127.0.0.1, once each in
   its own network namespace (loadtests/netns.py) at 198.18.K.x behind a link
   that delays every frame ``--delay-ms`` each way; an orchestrator in front of
   each (the second finds its stages by name in a hosts file);
3. closed-loop gRPC load on each orchestrator (ModelInfer, one image or one
   sentence per request), interleaved: for every round, level and pipeline,
   loopback then namespaces; the fastest of the rounds is kept;
4. the round trip of a hop with no work in it (ServerLive to each stage), on
   both: what a link adds by itself;
5. a table per pipeline and level: p50 and rate on both, their ratios, and
   the p50 added per stage hop (each request makes three hops from the
   orchestrator; a hop's round trip crosses its link twice).

Every process is stopped and every namespace deleted on exit, also on error.
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

import grpc
import netns
import numpy as np
from common import (
    DEFAULT_REPOSITORY,
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
    missing_models,
)

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import encode_inputs

STAGES = {
    "preprocess": "services.preprocess.main",
    "tokenizer": "services.tokenizer.main",
    "inference": "services.inference.main",
    "postprocess": "services.postprocess.main",
}
PIPELINES = {
    "image_classifier": ("image_preprocess", "mobilenet_v2_onnx", "imagenet_top5"),
    "text_embedding": ("minilm_tokenizer", "minilm", "mean_pool"),
}
HOPS = 3
"""Stage calls per request (orchestrator -> each of the three steps)."""
PORT = 9000


@dataclass(frozen=True)
class Settings:
    repository: Path
    load: LoadSettings
    levels: tuple[int, ...]
    delay_ms: float
    connections: int


def payloads() -> dict[str, bytes]:
    """One serialised ModelInfer per pipeline: a real photo, a short sentence."""
    image = pb.ModelInferRequest(model_name="image_classifier")
    photo = np.empty((1, 1), dtype=object)
    photo[0, 0] = sample_image("coffee.png").read_bytes()
    encode_inputs(image, {"IMAGE": photo})
    text = pb.ModelInferRequest(model_name="text_embedding")
    sentence = np.empty((1, 1), dtype=object)
    sentence[0, 0] = b"A mesh spread over hosts answers every request."
    encode_inputs(text, {"TEXT": sentence})
    return {
        "image_classifier": image.SerializeToString(),
        "text_embedding": text.SerializeToString(),
    }


def link_repository(source: Path, folder: Path) -> Path:
    """Links to the two pipelines and their steps (nothing else loads)."""
    for name in [*PIPELINES, *(step for steps in PIPELINES.values() for step in steps)]:
        (folder / name).symlink_to(source / name, target_is_directory=True)
    return folder


@dataclass
class Mesh:
    label: str
    orchestrator: netns.Process
    stages: dict[str, netns.Process]

    @property
    def address(self) -> str:
        return str(self.orchestrator.info["grpc"])

    def pids(self) -> dict[str, int]:
        own = {f"{self.label}:{s}": p.popen.pid for s, p in self.stages.items()}
        return {**own, f"{self.label}:orchestrator": self.orchestrator.popen.pid}


def start_meshes(cluster: netns.Cluster, repository: Path, folder: Path) -> list[Mesh]:
    """The four stages on loopback and in namespaces, then an orchestrator for each."""
    common = ["--metrics-port", "-1", "--model-repository", str(repository)]
    loop = {
        stage: cluster.start(None, module, ["--host", "127.0.0.1", "--grpc-port", "0", *common])
        for stage, module in STAGES.items()
    }
    hosts = {stage: cluster.add_host() for stage in STAGES}
    spread = {
        stage: cluster.start(
            hosts[stage],
            module,
            ["--host", hosts[stage].address, "--grpc-port", str(PORT), *common],
        )
        for stage, module in STAGES.items()
    }
    netns.wait_ready([*loop.values(), *spread.values()], timeout=300)
    hosts_file = folder / "hosts"
    hosts_file.write_text("".join(f"{h.address} {stage}\n" for stage, h in hosts.items()))
    front = [*common, "--grpc-port", "0"]
    loop_front = cluster.start(
        None,
        "services.orchestrator.main",
        [*front, *(f"--stages={s}={p.info['grpc']}" for s, p in loop.items())],
    )
    spread_front = cluster.start(
        None,
        "services.orchestrator.main",
        [*front, "--hosts-file", str(hosts_file), *(f"--stages={s}={s}:{PORT}" for s in STAGES)],
    )
    netns.wait_ready([loop_front, spread_front], timeout=120)
    return [Mesh("loopback", loop_front, loop), Mesh("namespaces", spread_front, spread)]


async def wait_pipelines(address: str, timeout_s: float = 120.0) -> None:
    """Until the orchestrator answers both pipelines as ready."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        deadline = asyncio.get_running_loop().time() + timeout_s
        for name in PIPELINES:
            while not (await stub.ModelReady(pb.ModelReadyRequest(name=name))).ready:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"{address}: '{name}' not ready in {timeout_s:.0f} s")
                await asyncio.sleep(0.2)


async def hop_round_trips(mesh: Mesh, calls: int = 200) -> float:
    """p50 ms of ServerLive to each stage from here, one after another: a hop with
    no work in it, so the link's own cost."""
    times: list[float] = []
    for stage in mesh.stages.values():
        async with grpc.aio.insecure_channel(str(stage.info["grpc"])) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await stub.ServerLive(pb.ServerLiveRequest())  # connected before timing
            for _ in range(calls):
                started = time.perf_counter()
                await stub.ServerLive(pb.ServerLiveRequest())
                times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


async def measure(meshes: list[Mesh], settings: Settings) -> list[LoadResult]:
    """Every (round, level, pipeline): loopback then namespaces."""
    for mesh in meshes:
        await wait_pipelines(mesh.address)
    trips = [await hop_round_trips(mesh) for mesh in meshes]
    print(
        "hop round trip (ServerLive to each stage, p50): "
        + ", ".join(f"{m.label} {t:.2f} ms" for m, t in zip(meshes, trips, strict=True)),
        flush=True,
    )
    requests = payloads()
    pids = {k: v for mesh in meshes for k, v in mesh.pids().items()}
    runs: list[LoadResult] = []
    for round_index in range(settings.load.rounds):
        for level in settings.levels:
            for pipeline, payload in requests.items():
                for mesh in meshes:
                    target = GrpcTarget(mesh.address, INFER_METHOD, payload, settings.connections)
                    label = f"{pipeline}|{mesh.label}"
                    try:
                        run = await closed_loop(label, target.calls(), level, pids, settings.load)
                    finally:
                        await target.close()
                    runs.append(run)
                    print(
                        f"  round {round_index + 1}: {label} @{level}: "
                        f"p50 {run.percentile(50):.2f} ms, {run.rate:.1f}/s",
                        flush=True,
                    )
    return best_runs(runs)


def report(runs: list[LoadResult], settings: Settings) -> str:
    """Per pipeline and level: both meshes and their ratios."""
    by = {(r.label, r.in_flight): r for r in runs}
    rows = []
    for pipeline in PIPELINES:
        for level in settings.levels:
            loop, spread = by[f"{pipeline}|loopback", level], by[f"{pipeline}|namespaces", level]
            added = (spread.percentile(50) - loop.percentile(50)) / HOPS
            rows.append(
                [
                    pipeline,
                    level,
                    loop.percentile(50),
                    spread.percentile(50),
                    spread.percentile(50) / loop.percentile(50),
                    loop.rate,
                    spread.rate,
                    spread.rate / loop.rate,
                    added,
                    loop.errors + spread.errors,
                ]
            )
    headers = [
        "pipeline",
        "in flight",
        "loop p50 ms",
        "netns p50 ms",
        "p50 ratio",
        "loop /s",
        "netns /s",
        "rate ratio",
        "added ms/hop",
        "errors",
    ]
    return format_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    add_load_flags(parser, seconds=4.0, warmup_s=1.5, settle_s=2.0, in_flight="1,8")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="link delay, each way")
    parser.add_argument("--connections", type=int, default=2, help="gRPC connections")
    args = parser.parse_args(argv)
    load, levels = load_from_flags(args)
    return Settings(args.repository.expanduser(), load, levels, args.delay_ms, args.connections)


def main(argv: Sequence[str] | None = None) -> int:
    """Both meshes, load, report; returns the exit status."""
    settings = parse_args(argv)
    why = netns.missing()
    if why is not None:
        print(f"bench_multihost needs network namespaces: {why}", file=sys.stderr)
        return 2
    models = [*PIPELINES, *(step for steps in PIPELINES.values() for step in steps)]
    absent = missing_models(settings.repository, models)
    if absent:
        print(
            f"missing in {settings.repository}: {', '.join(absent)} (make models)", file=sys.stderr
        )
        return 2
    install_sigterm_exit()
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        folder = Path(tmp)
        (folder / "repo").mkdir()
        repository = link_repository(settings.repository, folder / "repo")
        with netns.Cluster(delay_ms=settings.delay_ms) as cluster:
            meshes = start_meshes(cluster, repository, folder)
            print(f"load average before: {load_average()}", flush=True)
            runs = asyncio.run(measure(meshes, settings))
    print(
        f"\nEvery stage on its own namespace, {settings.delay_ms} ms per link each way, "
        f"vs the same mesh on loopback (load average after: {load_average()})"
    )
    print(report(runs, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
