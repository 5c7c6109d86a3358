"""One light request four ways: what the edge (Envoy, HTTP adapter, transcoding) costs.

    python loadtests/bench_gateway.py [--request embed|mlp] [--seconds 5] [--rounds 2]
                                      [--in-flight 1,16] [--access-log] [--quick]

The request (``--request``): ``embed`` (default), ``text_embedding`` on one short
text (tokenizer -> MiniLM -> mean pool); or ``mlp``, the 16 -> 8 test MLP on
one row (one stage, no ensemble: the edge's share is largest). It is sent as:

- ``grpc direct``  KServe v2 gRPC ModelInfer straight to the orchestrator (the baseline);
- ``grpc envoy``   the same bytes through Envoy's port (HTTP/2 pass-through);
- ``json envoy``   meshserve.v1 JSON (POST /api/v1/embed ``{"texts": [...]}``, or
                   /api/v1/models/mlp/infer): Envoy transcodes it to gRPC on the orchestrator;
- ``v2rest envoy`` POST /v2/models/<model>/infer (KServe v2 REST JSON): Envoy ->
                   the HTTP front door, inside the orchestrator by default (the
                   ``adapter`` column then reads 0; with ``supervisor.http_front_door:
                   process`` the HTTP adapter process, which calls the orchestrator
                   over gRPC).

In order: the mesh starts (``deploy.local.supervisor --ports auto``, the default
mesh YAML; Envoy's access log is off unless ``--access-log``); each way's
answer is checked once against the direct one; then closed-loop load (grpc.aio
with several HTTP/2 connections; aiohttp with one keep-alive connection per
worker) at each in-flight level, warmed up before a measured window, in
``--rounds`` interleaved rounds of which the fastest run of each way and level
is reported (a neighbour on a shared box only ever slows a run down). CPU per
request comes from /proc/<pid>/stat of Envoy (the ``envoy`` child of
gateway.envoy.main), the adapter (when it is a process), the orchestrator, the
stages, the supervisor (it relays every access-log line) and this process. Ratios are against
``grpc direct`` at the same in-flight level. The mesh is stopped by PID on exit,
error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
    HttpTarget,
    LoadResult,
    LoadSettings,
    MeshInfo,
    Target,
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
from shared.tensors import decode_outputs, encode_inputs

DIRECT = "grpc direct"
EDGE = ("envoy", "http_adapter", "orchestrator")
"""The processes a request crosses before the ensemble's stages."""
STAGES = ("tokenizer-0", "inference-0", "postprocess-0")


@dataclass(frozen=True)
class Settings:
    """One benchmark run's knobs (parsed once from the command line)."""

    repository: Path
    """The prepared model repository (python -m models.prepare)."""
    workload: Workload
    """The request sent every way."""
    load: LoadSettings
    """Warm-up, window and settle time of each measurement."""
    in_flight: tuple[int, ...]
    """Concurrency levels."""
    connections: int
    """gRPC connections per run (HTTP uses one connection per worker)."""
    access_log: bool
    """Envoy's stdout access log (off by default)."""


@dataclass(frozen=True)
class Way:
    """One way to send the request: a name, a target factory, an answer reader."""

    name: str
    target: Callable[[int], Target]
    """in-flight -> a fresh target (connections sized for it)."""
    answer: Callable[[], Awaitable[np.ndarray]]
    """One request whose output is compared with the direct one."""


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The request, in each encoding: v2 tensors (gRPC and REST) and meshserve.v1 JSON."""

    model: str
    inputs: dict[str, np.ndarray]
    """KServe v2 input tensors, batch of one."""
    output: str
    """The v2 output compared across ways."""
    json_path: str
    """The meshserve.v1 route Envoy transcodes."""
    json_body: dict[str, Any]
    json_pick: Callable[[Any], list[float]]
    """Where the output's values sit in the meshserve.v1 JSON reply."""


def embed_workload(text: str) -> Workload:
    """text_embedding on one text; JSON through POST /api/v1/embed."""
    texts = np.empty((1, 1), dtype=object)
    texts[0, 0] = text.encode()
    return Workload(
        "text_embedding",
        {"TEXT": texts},
        "EMBEDDING",
        "/api/v1/embed",
        {"texts": [text]},
        lambda doc: doc["embeddings"][0]["values"],
    )


def mlp_workload() -> Workload:
    """The 16 -> 8 test MLP (one stage, no ensemble); JSON through /api/v1/models/mlp/infer."""
    row = np.linspace(-1.0, 1.0, 16, dtype=np.float32)[None]
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": row.tolist()}
    return Workload(
        "mlp",
        {"INPUT0": row},
        "OUTPUT0",
        "/api/v1/models/mlp/infer",
        {"inputs": [tensor]},
        lambda doc: doc["outputs"][0]["data"],
    )


def _mlp_workload(_text: str) -> Workload:
    return mlp_workload()


WORKLOADS: dict[str, Callable[[str], Workload]] = {"embed": embed_workload, "mlp": _mlp_workload}
"""--request choice -> the workload, given --text."""


def v2_payload(workload: Workload) -> bytes:
    """The serialised ModelInferRequest, built once."""
    request = pb.ModelInferRequest(model_name=workload.model)
    encode_inputs(request, workload.inputs)
    payload: bytes = request.SerializeToString()
    return payload


def v2_rest_body(workload: Workload) -> bytes:
    """The KServe v2 REST JSON body of the same request."""
    tensors = [_rest_tensor(name, array) for name, array in workload.inputs.items()]
    return json.dumps({"inputs": tensors}).encode()


def _rest_tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    if array.dtype == object:
        return {
            "name": name,
            "datatype": "BYTES",
            "shape": list(array.shape),
            "data": [bytes(item).decode() for item in array.reshape(-1)],
        }
    return {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}


# -- the four ways ---------------------------------------------------------------


async def grpc_answer(address: str, payload: bytes, output: str) -> np.ndarray:
    """The output's first row from one ModelInfer through the generated stub."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelInfer(pb.ModelInferRequest.FromString(payload))
    return np.asarray(decode_outputs(reply)[output], dtype=np.float64).reshape(-1)


async def http_answer(url: str, body: bytes, pick: Callable[[Any], list[float]]) -> np.ndarray:
    """The values ``pick`` finds in one JSON reply."""
    target = HttpTarget(url, body, 1)
    try:
        return np.asarray(pick(await target.fetch_json()), dtype=np.float64).reshape(-1)
    finally:
        await target.close()


def ways(info: MeshInfo, workload: Workload, connections: int) -> list[Way]:
    """gRPC direct, gRPC via Envoy, meshserve.v1 JSON and v2 REST via Envoy."""
    payload = v2_payload(workload)
    json_body, rest_body = json.dumps(workload.json_body).encode(), v2_rest_body(workload)
    json_url = f"http://{info.edge}{workload.json_path}"
    rest_url = f"http://{info.edge}/v2/models/{workload.model}/infer"

    def grpc_way(name: str, address: str) -> Way:
        return Way(
            name,
            lambda n: GrpcTarget(address, INFER_METHOD, payload, min(n, connections)),
            lambda: grpc_answer(address, payload, workload.output),
        )

    return [
        grpc_way(DIRECT, info.orchestrator),
        grpc_way("grpc envoy", info.edge),
        Way(
            "json envoy",
            lambda n: HttpTarget(json_url, json_body, n),
            lambda: http_answer(json_url, json_body, workload.json_pick),
        ),
        Way(
            "v2rest envoy",
            lambda n: HttpTarget(rest_url, rest_body, n),
            lambda: http_answer(rest_url, rest_body, lambda doc: doc["outputs"][0]["data"]),
        ),
    ]


# -- load ------------------------------------------------------------------------


async def check_answers(options: Sequence[Way]) -> None:
    """Print each way's largest difference from the direct embedding."""
    answers = [await way.answer() for way in options]
    direct = answers[0]
    for way, answer in zip(options, answers, strict=True):
        diff = float(np.max(np.abs(answer - direct))) if answer.shape == direct.shape else np.inf
        print(f"  {way.name:<13} {answer.size} values, max |diff| vs direct {diff:.2e}")


async def run_all(info: MeshInfo, settings: Settings) -> list[LoadResult]:
    """Every way at every in-flight level."""
    options = ways(info, settings.workload, settings.connections)
    await check_answers(options)
    relay = {"supervisor": info.supervisor_pid, "envoy_wrapper": info.pids["envoy_wrapper"]}
    # Every mesh process is counted, so "others" is only what lies outside the mesh.
    pids = {**info.pids, **relay}
    started = sample_cpu(relay)
    runs = []
    for round_ in range(settings.load.rounds):
        for in_flight in settings.in_flight:
            for way in options:
                run = await load_once(way, in_flight, pids, settings.load)
                line = f"  {way.name:<13} @{in_flight:<3} round {round_ + 1}: {run.rate:.1f} req/s"
                print(line, flush=True)
                runs.append(run)
    print_relay_cost(CpuUsage.between(started, sample_cpu(relay)), runs)
    return best_runs(runs)


async def load_once(
    way: Way, in_flight: int, pids: Mapping[str, int], load: LoadSettings
) -> LoadResult:
    """One closed-loop run of one way over a fresh target."""
    target = way.target(in_flight)
    try:
        return await closed_loop(way.name, target.calls(), in_flight, pids, load)
    finally:
        await target.close()


def print_relay_cost(usage: CpuUsage, results: Sequence[LoadResult]) -> None:
    """Supervisor + Envoy wrapper CPU over the whole load phase, per request sent.

    Envoy flushes its access log about every 10 s, so the supervisor relays
    it in bursts that a 6 s window may miss: only the whole phase is fair.
    """
    total = sum(result.total for result in results)
    cpu = sum(usage.processes.values())
    print(
        f"  log relay (supervisor + Envoy wrapper): {cpu:.2f} s CPU over {total} requests "
        f"= {1000 * cpu / max(1, total):.3f} ms/request"
    )


# -- report ----------------------------------------------------------------------


def results_table(results: Sequence[LoadResult]) -> str:
    """Rate, latency and CPU per request by process."""
    headers = ["way", "in-flight", "req/s", "p50 ms", "p99 ms", "edge CPU", "envoy", "adapter"]
    headers += ["orch", "stages", "client", "others"]
    rows = [
        [
            r.label,
            r.in_flight,
            r.rate,
            r.percentile(50),
            r.percentile(99),
            r.cpu_ms(*EDGE),
            r.cpu_ms("envoy"),
            r.cpu_ms("http_adapter"),
            r.cpu_ms("orchestrator"),
            r.cpu_ms(*STAGES),
            r.client_cpu_ms(),
            r.usage.others,
        ]
        for r in results
    ]
    return format_table(headers, rows)


def ratio_table(results: Sequence[LoadResult]) -> str:
    """Each way against gRPC direct at the same in-flight level."""
    base = {r.in_flight: r for r in results if r.label == DIRECT}
    headers = ["way", "in-flight", "req/s ratio", "p50 ratio", "edge CPU ratio", "+edge CPU ms"]
    rows: list[list[object]] = []
    for r in results:
        direct = base.get(r.in_flight)
        if direct is None or r.label == DIRECT:
            continue
        rows.append(
            [
                r.label,
                r.in_flight,
                r.rate / direct.rate,
                r.percentile(50) / direct.percentile(50),
                r.cpu_ms(*EDGE) / direct.cpu_ms(*EDGE),
                r.cpu_ms(*EDGE) - direct.cpu_ms(*EDGE),
            ]
        )
    return format_table(headers, rows)


# -- command line ------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    """Command-line flags -> Settings (``--quick``: short windows for a smoke run)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--request", choices=sorted(WORKLOADS), default="embed")
    parser.add_argument("--text", default="A man is playing a guitar.", help="the embed text")
    add_load_flags(parser, seconds=5.0, warmup_s=1.5, settle_s=2.0, in_flight="1,16")
    parser.add_argument("--connections", type=int, default=4, help="gRPC connections")
    parser.add_argument("--access-log", action="store_true", help="turn Envoy's access log on")
    args = parser.parse_args(argv)
    load, levels = load_from_flags(args, quick_warmup_s=0.5)
    return Settings(
        args.repository.expanduser(),
        WORKLOADS[args.request](args.text),
        load,
        levels,
        args.connections,
        args.access_log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Mesh, answers, load, report; returns the exit status."""
    install_sigterm_exit()
    settings = parse_args(argv)
    missing = missing_models(settings.repository, (settings.workload.model,))
    if missing:
        print(f"{settings.repository} lacks {missing}: run `python -m models.prepare`")
        return 2
    workload = settings.workload
    log = "on" if settings.access_log else "off"
    print(f"{workload.model}: {json.dumps(workload.json_body)}; Envoy access log {log}")
    print(f"load average at start {load_average()}", flush=True)
    overrides = {"envoy": {"access_log": settings.access_log}}
    with running_mesh(settings.repository, overrides) as info:
        print(f"mesh ready: orchestrator {info.orchestrator}, edge {info.edge}", flush=True)
        results = asyncio.run(run_all(info, settings))
    print()
    print(results_table(results))
    print("(CPU: ms per request; edge = envoy + adapter + orch, the adapter 0 when the")
    print(" orchestrator serves REST, as by default; stages = tokenizer + inference")
    print(" + postprocess; others = cores used meanwhile by processes outside the measurement)")
    print()
    print(ratio_table(results))
    print(f"load average at end {load_average()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the mesh is already stopped by running_mesh's finally
        sys.exit(130)
