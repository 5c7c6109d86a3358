"""The reliability harness, long: fuzz, fault runs and a soak on the default mesh.

    python loadtests/reliability.py [--repository ~/.cache/meshserve/repository]
                                    [--fuzz-cases 10000] [--seed 24] [--soak-minutes 30]
                                    [--in-flight 16] [--overload-in-flight 256]
                                    [--overload-queued-batches N]
                                    [--skip fuzz,faults,single,soak,overload,abuse,storm]
                                    [--without-llm] [--standby on|off|yaml]

In order, each on the default models (the LLM included) under the supervisor:

1. ``fuzz``: every stage with 2 replicas; ``--fuzz-cases`` seeded cases (4 in 5
   gRPC protobuf to Envoy and the orchestrator, 1 in 5 REST/OpenAI JSON through
   Envoy, ``loadtests/fuzzer.py``); counts 5xx / INTERNAL / UNKNOWN answers and
   restarted processes.
2. ``soak`` (same mesh): ``--soak-minutes`` of mixed load (both ensembles and a
   short LLM chat completion); errors, and RSS per process after a 30-s warm-up
   and at the end.
3. ``faults`` (same mesh): SIGKILL of replica 1 of each stage in turn under
   ``--in-flight`` requests (text_embedding and image_classifier, which cross
   every stage): 0 failures expected; SIGTERM (drain) of inference-1 likewise;
   SIGSTOP of every tokenizer replica: text_embedding times out, image_classifier
   keeps serving; SIGCONT.
4. ``single``: a mesh with 1 replica per stage; SIGKILL of each stage: failures
   only UNAVAILABLE, recovery < 10 s: per model, from the kill to the first success
   of a call begun after its first failure, and the end of the last failure; then,
   per kill, where the restart's time went (``loadtests/restart_watch.py``: the new
   process, its port, each model READY, the orchestrator seeing it). ``--standby``
   gives every stage a standby (deploy/local/standby.py) or none.
5. ``overload`` and 6. ``abuse`` (``loadtests/abuse.py``), on a mesh of the image
   models: 256 requests in flight on image_classifier (only OK and
   RESOURCE_EXHAUSTED expected; latencies and RSS); slowloris headers, idle
   connections, half-sent bodies and unwritten gRPC streams against Envoy while
   a well-behaved client keeps calling (all its calls answered; the slow and
   idle connections closed at Envoy's timeouts). ``--overload-queued-batches N``
   overloads a second mesh whose stages set ``default_queued_batches: N``.
7. ``storm`` (``loadtests/cancel_storm.py --layout both``, ``--llm`` unless
   ``--without-llm``): callers that give up by deadline, cancel or closed
   connection, on a mesh of the ensembles' models, and whether that mesh is
   whole afterwards.

Each part prints its table. The exit status is 1 when an expectation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import abuse
import cancel_storm
import faults
import fuzzer
import grpc
import yaml
from common import (
    DEFAULT_REPOSITORY,
    MESH_READY_MARKER,
    ROOT,
    MeshInfo,
    format_table,
    install_sigterm_exit,
    missing_models,
    rss_mib,
    running_mesh,
    start_supervisor,
)
from fault_runs import HEADERS, STAGES, fault_rows, image_request, mixed_call

from inference import grpc_service_pb2_grpc as pb_grpc

MODELS = ["text_embedding", "image_classifier", "llm"]
LLM_MODELS = {"llm", "smollm2", "smollm2_tokenizer", "smollm2_detokenizer"}
STANDBY: dict[str, bool | None] = {"on": True, "off": False, "yaml": None}
READY_TIMEOUT_S = 600.0
"""How long the default mesh (with vLLM) may take to become ready."""


# -- the mesh ------------------------------------------------------------------


@contextlib.contextmanager
def mesh(
    repository: Path, replicas: int, standby: bool | None = None, keep_log: Path | None = None
) -> Iterator[dict[str, Any]]:
    """The default mesh with ``replicas`` of every stage (and a standby beside each
    when ``standby``; None: as the mesh YAML says); its ready info (+ supervisor_pid,
    and ``standbys``: how many standbys it keeps). Its log is copied to ``keep_log``."""
    document = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
    for stage in document["supervisor"]["stages"]:
        stage["replicas"] = replicas
        if standby is not None:
            stage["standby"] = standby
    document["supervisor"]["restart_backoff_s"] = [0.2, 2.0]
    stages = document["supervisor"]["stages"]
    with tempfile.TemporaryDirectory(prefix="meshserve-reliability-") as tmp:
        config, log_path = Path(tmp) / "mesh.yaml", Path(tmp) / "mesh.log"
        config.write_text(yaml.safe_dump(document, sort_keys=False))
        proc = start_supervisor(repository, config, log_path, READY_TIMEOUT_S)
        try:
            info = _ready(proc, log_path)
            info["standbys"] = sum(s["replicas"] for s in stages if s.get("standby"))
            yield info
        finally:
            for pid in faults.stage_pids(proc.pid, "services."):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if keep_log is not None:
                shutil.copyfile(log_path, keep_log)


def _ready(proc: subprocess.Popen[str], log_path: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith(MESH_READY_MARKER):
            info: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            info["supervisor_pid"] = proc.pid
            info["table"] = faults.ProcessTable.from_ready(info)
            return info
    raise RuntimeError(f"the mesh did not become ready:\n{log_path.read_text()[-3000:]}")


# -- requests ------------------------------------------------------------------


def chat_call(edge: str) -> Callable[[], None]:
    """A short greedy LLM chat completion through Envoy; raises on a non-200 answer."""
    body: dict[str, Any] = {"model": "llm", "messages": [{"role": "user", "content": "Hi."}]}
    body |= {"max_tokens": 8, "temperature": 0}
    data = json.dumps(body).encode()

    def call() -> None:
        request = urllib.request.Request(
            f"http://{edge}/v1/chat/completions",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()

    return call


# -- parts ---------------------------------------------------------------------


def run_fuzz(info: dict[str, Any], cases: int, seed: int) -> bool:
    addresses = {"edge": info["processes"]["envoy"]["grpc"], "orchestrator": info["orchestrator"]}
    grpc_count = cases * 4 // 5
    every = [
        *fuzzer.grpc_cases(seed, grpc_count, ["edge", "orchestrator"]),
        *fuzzer.http_cases(seed, cases - grpc_count),
    ]
    start = time.monotonic()
    result = fuzzer.run_fuzz(every, addresses)
    restarts = info["table"].restarted()
    rows = [
        [
            "fuzz",
            result.cases,
            result.bad_count(),
            sum(result.known.values()),
            len(result.findings),
            len(restarts),
            time.monotonic() - start,
        ]
    ]
    print(format_table(["run", "cases", "5xx/INT/UNK", "known", "new", "restarts", "s"], rows))
    print("outcomes:", dict(result.outcomes.most_common()))
    for item, count in result.known.items():
        print(f"known: {count} x {item}")
    for case, what in result.findings[:20]:
        print(f"FINDING {case.kind}: {what}\n  {fuzzer.reproduction(case)}")
    if restarts:
        print("restarted:", restarts)
    return not result.findings and not restarts


def run_soak(info: dict[str, Any], minutes: float, in_flight: int, chat: bool = True) -> bool:
    """Mixed load for ``minutes``: 1 call in 8 a chat with the LLM (unless not
    ``chat``); RSS per process."""
    channel = grpc.insecure_channel(info["orchestrator"])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    calls = [mixed_call(stub), chat_call(info["processes"]["envoy"]["grpc"])]
    turn = iter(range(10**12))

    def call() -> None:
        index = next(turn)
        calls[1 if chat and index % 8 == 0 else 0]()

    pids = {name: pid for name, (pid, _) in info["table"].started.items()}
    warm = faults.load_with_fault(_noop_plan(call, in_flight, 30.0))
    start_rss = {name: rss_mib(pid) for name, pid in pids.items()}
    result = faults.load_with_fault(_noop_plan(call, in_flight, minutes * 60))
    end_rss = {name: rss_mib(pid) for name, pid in pids.items()}
    channel.close()
    restarts = info["table"].restarted()
    errors = sum(result.failures().values()) + sum(warm.failures().values())
    print(
        format_table(
            ["soak", "requests", "errors", "restarts"],
            [[f"{minutes:g} min, {in_flight} in flight", result.requests, errors, len(restarts)]],
        )
    )
    if result.failures():
        print("errors by code:", result.failures())
    rows = [
        [name, start_rss[name], end_rss[name], 100 * (end_rss[name] / start_rss[name] - 1)]
        for name in sorted(pids)
    ]
    print(format_table(["process", "RSS start MiB", "RSS end MiB", "growth %"], rows))
    return errors == 0 and not restarts


def _noop_plan(call: faults.Call, in_flight: int, seconds: float) -> faults.FaultPlan:
    """Load with no fault."""
    return faults.FaultPlan("soak", call, None, in_flight=in_flight, duration_s=seconds)


# -- main ----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--fuzz-cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--soak-minutes", type=float, default=30.0)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument(
        "--replicas", type=int, default=2, help="of each stage for fuzz, soak and faults"
    )
    parser.add_argument("--overload-in-flight", type=int, default=256)
    parser.add_argument("--overload-s", type=float, default=20.0)
    parser.add_argument(
        "--overload-queued-batches",
        type=int,
        default=None,
        help="also overload a mesh whose stages set this default_queued_batches",
    )
    parser.add_argument(
        "--overload-rounds",
        type=int,
        default=1,
        help="overload runs in a row on one mesh, RSS after each (a leak grows every round)",
    )
    parser.add_argument(
        "--without-llm",
        action="store_true",
        help="the default models but the LLM's (fuzz, faults and soak then need no vLLM engine)",
    )
    parser.add_argument(
        "--standby",
        choices=sorted(STANDBY),
        default="yaml",
        help="for the single-replica run: a standby beside each stage (on, off, or as "
        "deploy/local/mesh.yaml says)",
    )
    parser.add_argument(
        "--keep-log", type=Path, default=None, help="copy the single-replica mesh's log here"
    )
    parser.add_argument("--slow", type=int, default=300, help="slowloris connections")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections")
    parser.add_argument("--half-open", type=int, default=500, help="half-open requests")
    parser.add_argument(
        "--skip", default="", help="comma-separated: fuzz,faults,single,soak,overload,abuse,storm"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    missing = missing_models(args.repository, MODELS)
    if missing:
        print(f"missing models in {args.repository}: {missing} (run `make models`)")
        return 2
    install_sigterm_exit()
    with tempfile.TemporaryDirectory(prefix="meshserve-reliability-repo-") as tmp:
        if args.without_llm:
            args.repository = without_llm(args.repository, Path(tmp))
        return 0 if run_parts(args, skip) else 1


def without_llm(source: Path, target: Path) -> Path:
    """A repository of links to every model of ``source`` but the LLM's."""
    for model in sorted(source.expanduser().iterdir()):
        if model.is_dir() and model.name not in LLM_MODELS:
            (target / model.name).symlink_to(model, target_is_directory=True)
    return target


def run_parts(args: argparse.Namespace, skip: set[str]) -> bool:
    """Every part not skipped, in order; True when every expectation held."""
    fine = True
    if {"fuzz", "faults", "soak"} - skip:
        with mesh(args.repository, replicas=args.replicas) as info:
            if "fuzz" not in skip:
                fine &= run_fuzz(info, args.fuzz_cases, args.seed)
            if "soak" not in skip:  # before the faults: their restarts are expected
                fine &= run_soak(info, args.soak_minutes, args.in_flight, not args.without_llm)
            if "faults" not in skip:
                rows, ok = fault_rows(info, args.in_flight, single=args.replicas < 2)
                print(format_table(HEADERS, rows))
                fine &= ok
    if "single" not in skip:
        standby = STANDBY[args.standby]
        with mesh(args.repository, 1, standby, args.keep_log) as info:
            rows, ok = fault_rows(info, args.in_flight, single=True)
            print(format_table(HEADERS, rows))
            fine &= ok
    if {"overload", "abuse"} - skip:
        fine &= run_overload_and_abuse(args, skip)
    if "overload" not in skip and args.overload_queued_batches is not None:
        fine &= run_bounded_overload(args)
    if "storm" not in skip:
        llm = [] if args.without_llm else ["--llm"]
        storm = ["--repository", str(args.repository), "--layout", "both", "--seed", str(args.seed)]
        fine &= cancel_storm.main([*storm, *llm]) == 0
    print("all expectations held" if fine else "SOME EXPECTATIONS FAILED")
    return fine


def run_overload_and_abuse(args: argparse.Namespace, skip: set[str]) -> bool:
    """Parts 5 and 6 on a mesh of the image models, Envoy at its default timeouts."""
    edge = yaml.safe_load((ROOT / "deploy" / "local" / "mesh.yaml").read_text())
    envoy = edge["services"]["envoy"]
    limits = {
        "headers_s": float(envoy["request_headers_timeout_s"]),
        "idle_s": float(envoy["connection_idle_timeout_s"]),
    }
    counts = {"slow": args.slow, "idle": args.idle, "half_open": args.half_open}
    fine = True
    with tempfile.TemporaryDirectory(prefix="meshserve-abuse-") as tmp:
        repository = abuse.image_repository(args.repository, Path(tmp) / "repo")
        with running_mesh(repository) as info:
            request = image_request()
            if "overload" not in skip:
                fine &= _overload_part(info, args)
            if "abuse" not in skip:
                rows, ok = asyncio.run(abuse.run_abuse(info.edge, request, counts, limits))
                print(format_table([*abuse.ABUSE_HEADERS, "as expected"], rows))
                fine &= ok
    return fine


def run_bounded_overload(args: argparse.Namespace) -> bool:
    """Part 5 again, every stage given a stage-wide default_queued_batches."""
    bound = {"default_queued_batches": args.overload_queued_batches}
    overrides = {stage: bound for stage in STAGES}
    with tempfile.TemporaryDirectory(prefix="meshserve-abuse-") as tmp:
        repository = abuse.image_repository(args.repository, Path(tmp) / "repo")
        with running_mesh(repository, overrides) as info:
            print(f"stages with default_queued_batches: {args.overload_queued_batches}")
            return _overload_part(info, args)


def _overload_part(info: MeshInfo, args: argparse.Namespace) -> bool:
    """Part 5: its table and the RSS of every process; only OK and RESOURCE_EXHAUSTED.
    With ``--overload-rounds`` above 1, RSS after every round too."""
    before = {name: rss_mib(pid) for name, pid in info.pids.items()}
    rows, rounds, codes = [], [], set()
    for index in range(args.overload_rounds):
        run = abuse.overload(
            info.orchestrator, image_request(), args.overload_in_flight, args.overload_s
        )
        answers, wall_s = asyncio.run(run)
        codes |= set(answers.codes)
        name = f"{args.overload_in_flight} in flight, {args.overload_s:g} s, round {index + 1}"
        rows.append(abuse.overload_row(name, answers, wall_s))
        rounds.append({name: rss_mib(pid) for name, pid in info.pids.items()})
    print(format_table(abuse.OVERLOAD_HEADERS, rows))
    print(abuse.rss_table(before, rounds[-1]))
    if len(rounds) > 1:
        names = sorted(before)
        table = [[i + 1, *(r[n] for n in names)] for i, r in enumerate(rounds)]
        print(format_table(["RSS MiB after round", *names], [[0, *map(before.get, names)], *table]))
    return codes <= {"OK", "RESOURCE_EXHAUSTED"}


if __name__ == "__main__":
    sys.exit(main())
