"""Start each server of the peer benchmark, one at a time, on free ports; stop it by PID.

    kserve()     KServe 0.21's ModelServer (kserve_server.py in its venv): v2 REST + gRPC
    fastapi()    the FastAPI + torch baseline (fastapi_server.py in its venv)
    mesh()       the local mesh (supervisor, --ports auto) on the MLP repository, tracing
                 and batch jobs off, only the inference stage: stage, orchestrator, HTTP
                 adapter, Envoy
    torchserve   in torchserve.py (shared with bench_torchserve.py)

Each yields a ``Running``: where it listens and the PID of every process of the
server (a process and its descendants), whose CPU the benchmark reads from /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from common import MESH_READY_MARKER, ROOT, _mesh_info, _stop_mesh
from peers.torchserve import stop_tree, tree

from deploy.local.procfs import start_ticks
from shared.ports import free_port

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Running:
    """A started server."""

    http: str = ""
    """host:port of its HTTP listener (empty: none)."""
    grpc: str = ""
    """host:port of its gRPC listener (empty: none)."""
    pids: dict[str, int] = field(default_factory=dict)
    """Process label -> PID: every process of the server."""
    extra: dict[str, str] = field(default_factory=dict)
    """More addresses (the mesh: the inference stage's, Envoy's)."""


def _labelled(pid: int, prefix: str) -> dict[str, int]:
    return {f"{prefix}-{i}": child for i, child in enumerate(tree(pid))}


def _wait_http(url: str, body: bytes | None, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``url`` answers 200 (a POST of ``body`` when given), or the process dies."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
        request.add_header("content-type", "application/json")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(request, timeout=5) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} never answered 200; log tail:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def _child(command: list[str], folder: Path, name: str) -> Iterator[subprocess.Popen[bytes]]:
    log_path = folder / f"{name}.log"
    with log_path.open("w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            command,
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop_tree(proc)


@contextlib.contextmanager
def kserve(python: Path, model_pt: Path, folder: Path, model: str) -> Iterator[Running]:
    """KServe's ModelServer with the MLP as ``model``."""
    http, grpc = free_port(), free_port()
    command = [str(python), str(HERE / "kserve_server.py"), "--model_pt", str(model_pt)]
    command += ["--name", model, "--http_port", str(http), "--grpc_port", str(grpc)]
    with _child(command, folder, "kserve") as proc:
        _wait_http(
            f"http://127.0.0.1:{http}/v2/models/{model}/ready", None, proc, folder / "kserve.log"
        )
        yield Running(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", _labelled(proc.pid, "kserve"))


@contextlib.contextmanager
def fastapi(python: Path, model_pt: Path, folder: Path, body: bytes) -> Iterator[Running]:
    """The FastAPI baseline; ``body`` is the request it is checked with."""
    port = free_port()
    command = [str(python), str(HERE / "fastapi_server.py"), str(model_pt), str(port)]
    with _child(command, folder, "fastapi") as proc:
        _wait_http(f"http://127.0.0.1:{port}/predict", body, proc, folder / "fastapi.log")
        yield Running(http=f"127.0.0.1:{port}", pids=_labelled(proc.pid, "fastapi"))


def mesh_config(folder: Path, overrides: dict[str, dict[str, object]], root: Path) -> Path:
    """``root``'s default mesh YAML, cut to the inference stage, tracing and jobs off."""
    document = yaml.safe_load((root / "deploy" / "local" / "mesh.yaml").read_text())
    supervisor = document.setdefault("supervisor", {})
    supervisor["trace_store"] = False
    supervisor["jobs"] = {"enabled": False}
    supervisor["stages"] = [s for s in supervisor["stages"] if s["name"] == "inference"]
    for section, settings in overrides.items():
        # "supervisor": the supervisor's own settings; "defaults": every service's;
        # any other name: that service's.
        services = document["services"]
        if section in ("supervisor", "defaults"):
            target = document.setdefault(section, {})
        else:
            target = services.setdefault(section, {})
        target.update(settings)
    path = folder / "mesh.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _supervisor(root: Path, repository: Path, config: Path, log: Path) -> subprocess.Popen[str]:
    """The supervisor of the source tree ``root`` (this one, or an older copy to compare)."""
    command = [sys.executable, "-m", "deploy.local.supervisor", "--model-repository"]
    command += [str(repository), "--config", str(config), "--ports", "auto"]
    command += ["--ready-timeout-s", "120"]
    with log.open("w") as stderr:
        return subprocess.Popen(
            command,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}:{root}/protos"},
            start_new_session=True,
        )


@contextlib.contextmanager
def mesh(
    repository: Path,
    folder: Path,
    overrides: dict[str, dict[str, object]] | None = None,
    root: Path = ROOT,
) -> Iterator[Running]:
    """The mesh of source tree ``root``; ``extra``: ``stage`` (inference-0's gRPC),
    ``edge`` (Envoy's port), ``front_door`` (where Envoy sends REST)."""
    config = mesh_config(folder, overrides or {}, root)
    log = folder / "mesh.log"
    proc = _supervisor(root, repository, config, log)
    started: dict[int, int | None] = {}
    try:
        ready = _ready_document(proc, log)
        info = _mesh_info(ready, proc.pid)
        started = {pid: start_ticks(pid) for pid in info.pids.values()}
        pids = {k: v for k, v in info.pids.items() if k != "envoy_wrapper"}
        pids["supervisor"] = proc.pid
        stage = ready["processes"]["inference-0"]["grpc"]
        # Where Envoy sends REST: the HTTP adapter, or the orchestrator's own front door.
        front_door = str(ready.get("http_front_door", ""))
        yield Running(
            http=info.edge,
            grpc=info.orchestrator,
            pids=pids,
            extra={"stage": stage, "edge": info.edge, "front_door": front_door},
        )
    finally:
        _stop_mesh(proc, started)


def _ready_document(proc: subprocess.Popen[str], log: Path) -> dict[str, object]:
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith(MESH_READY_MARKER):
            document: dict[str, object] = json.loads(line.split(" ", 1)[1])
            return document
    raise RuntimeError(f"the mesh did not become ready:\n{log.read_text()[-3000:]}")
