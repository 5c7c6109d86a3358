"""The supervisor refuses a port plan that cannot work, and SIGTERM at start-up leaves nothing.

Each test runs the real supervisor (``python -m deploy.local.supervisor``) and
checks the processes it started by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.ports import free_port_run
from tests.harness import ROOT, RUNNING, log_tail, new_log
from tests.integration.test_supervisor import processes_mentioning

GRACE_S = 2.0
ONE_STAGE = """
defaults: { host: 127.0.0.1, grace_period_s: 1 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  restart_backoff_s: [0.2, 1.0]
"""

# A python model that starts a child of its own (as vLLM starts its engine) and
# then takes minutes to initialize: its stage is mid-start for as long as the test needs.
HOLD_MODEL = """
import json, os, subprocess, time
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        child = subprocess.Popen(["sleep", "300"])
        pids = {"stage": os.getpid(), "grandchild": child.pid}
        with Path(__file__).resolve().parents[3].joinpath("pids.json").open("a") as out:
            out.write(json.dumps(pids) + "\\n")
        time.sleep(EXIT_AFTER_S)
        os._exit(3)  # the stage dies, leaving its child behind

    def execute(self, requests):
        return []
"""
HOLD_CONFIG = """
name: "hold"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def hold_repository(root: Path, exit_after_s: float) -> Path:
    """A repository of the ``hold`` model; its stage exits ``exit_after_s`` into initialize."""
    model = root / "repo" / "hold"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(HOLD_CONFIG)
    (model / "1" / "model.py").write_text(f"EXIT_AFTER_S = {exit_after_s}\n{HOLD_MODEL}")
    return model.parent


def recorded(pids: Path) -> list[dict[str, int]]:
    """The PIDs each start of the ``hold`` model wrote: its stage and its child."""
    lines = pids.read_text().splitlines() if pids.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Started supervisors go in the list; whatever is left of them is killed after the test."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        RUNNING.pop(proc.pid, None)
    # Should a test fail, what its supervisor started must not outlive it either.
    pids = tmp_path / "pids.json"
    leftovers = processes_mentioning(str(tmp_path))
    if pids.exists():
        leftovers += [pid for line in recorded(pids) for pid in line.values()]
    for pid in leftovers:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def start(
    started: list[subprocess.Popen[str]], repository: Path, config: Path, *extra: str
) -> tuple[subprocess.Popen[str], Path]:
    """The supervisor on ``repository``, its stderr to a log (shown by a failed test)."""
    log = new_log("deploy.local.supervisor")
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.local.supervisor", "--model-repository",
             str(repository), "--config", str(config), *extra],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    started.append(proc)
    RUNNING[proc.pid] = ("deploy.local.supervisor", log)
    return proc, log


def test_colliding_replica_ports_are_refused_before_anything_starts(
    tmp_path: Path, supervisor: list[subprocess.Popen[str]]
) -> None:
    base = free_port_run(4)
    config = tmp_path / "mesh.yaml"
    config.write_text(f"""
defaults: {{ host: 127.0.0.1 }}
services:
  tokenizer: {{ grpc_port: {base}, metrics_port: -1 }}
  preprocess: {{ grpc_port: {base + 1}, metrics_port: -1 }}
supervisor:
  replica_port_step: 1
  stages:
    - {{ name: tokenizer, module: services.tokenizer.main, replicas: 2 }}
    - {{ name: preprocess, module: services.preprocess.main, replicas: 1 }}
""")
    repository = tmp_path / "repo"
    repository.mkdir()
    proc, log = start(supervisor, repository, config)

    assert proc.wait(20) != 0
    said = log.read_text()
    assert f"tokenizer-1 (gRPC) and preprocess-0 (gRPC) both want port {base + 1}" in said, said
    assert "[tokenizer-0]" not in said  # no service said a word: none was started
    assert processes_mentioning(str(repository)) == []


def test_a_port_already_taken_is_named_with_the_process_that_wanted_it(
    tmp_path: Path, supervisor: list[subprocess.Popen[str]]
) -> None:
    config = tmp_path / "mesh.yaml"
    repository = tmp_path / "repo"
    repository.mkdir()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config.write_text(f"""
defaults: {{ host: 127.0.0.1 }}
services:
  inference: {{ grpc_port: {port}, metrics_port: -1 }}
supervisor:
  stages:
    - {{ name: inference, module: services.inference.main, replicas: 1 }}
""")
        proc, log = start(supervisor, repository, config)
        assert proc.wait(20) != 0
    said = log.read_text()
    assert f"port {port} that inference-0 (gRPC) wants on 127.0.0.1 is not free" in said, said
    assert processes_mentioning(str(repository)) == []


def test_sigterm_during_start_up_stops_the_stage_and_what_it_started(
    tmp_path: Path, supervisor: list[subprocess.Popen[str]]
) -> None:
    repository = hold_repository(tmp_path, exit_after_s=300)
    config = tmp_path / "mesh.yaml"
    config.write_text(ONE_STAGE)
    proc, log = start(supervisor, repository, config, "--ports", "auto", "--grace-s", str(GRACE_S))
    [pids] = wait_for_starts(tmp_path / "pids.json", 1, proc, log)
    assert running(pids["stage"]) and running(pids["grandchild"])

    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(GRACE_S + 30)
    took = time.monotonic() - began

    assert not running(pids["stage"])
    assert not running(pids["grandchild"])
    assert took < GRACE_S + 5, f"the supervisor took {took:.1f}s to stop"
    said = log.read_text()
    assert "SIGTERM while starting" in said, said
    assert "mesh stopped in" in said, said
    assert processes_mentioning(str(repository)) == []


def test_what_a_crashed_stage_left_behind_is_ended_before_it_restarts(
    tmp_path: Path, supervisor: list[subprocess.Popen[str]]
) -> None:
    repository = hold_repository(tmp_path, exit_after_s=0.5)
    config = tmp_path / "mesh.yaml"
    config.write_text(ONE_STAGE)
    proc, log = start(supervisor, repository, config, "--ports", "auto", "--grace-s", "2")

    first, _restarted = wait_for_starts(tmp_path / "pids.json", 2, proc, log)
    assert not running(first["stage"])
    assert not running(first["grandchild"])  # ended before the stage was started again
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(GRACE_S + 30) == 0
    for started in recorded(tmp_path / "pids.json"):
        assert not running(started["stage"]) and not running(started["grandchild"])


def wait_for_starts(
    pids: Path, count: int, proc: subprocess.Popen[str], log: Path
) -> list[dict[str, int]]:
    """The PIDs of the first ``count`` starts of the ``hold`` model, once they are running."""
    deadline = time.monotonic() + 60
    while len(recorded(pids)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, log_tail(log)
        time.sleep(0.1)
    return recorded(pids)[:count]


def test_a_killed_supervisor_leaves_nothing_running(
    tmp_path: Path, supervisor: list[subprocess.Popen[str]]
) -> None:
    # SIGKILL reaches no handler: the services (each in a session of its own)
    # are ended by the reaper the supervisor started, once its pipe closes.
    repository = hold_repository(tmp_path, exit_after_s=300)
    config = tmp_path / "mesh.yaml"
    config.write_text(ONE_STAGE)
    proc, log = start(supervisor, repository, config, "--ports", "auto", "--grace-s", "1")
    [pids] = wait_for_starts(tmp_path / "pids.json", 1, proc, log)
    assert running(pids["stage"]) and running(pids["grandchild"])

    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 20
    while (running(pids["stage"]) or running(pids["grandchild"])) and time.monotonic() < deadline:
        time.sleep(0.1)

    assert not running(pids["stage"]), log_tail(log)
    assert not running(pids["grandchild"]), log_tail(log)
    said = log.read_text()
    assert "the supervisor exited and left" in said and str(pids["stage"]) in said, said
    assert processes_mentioning(str(repository)) == []
