"""The ``meshserve`` command serves a Triton repository written by hand, as a user would.

The repository holds a python model, an ONNX model built here with
``onnx.helper`` and an ensemble of the two; ``meshserve serve --model-repository
DIR`` serves it, tritonclient gets the right answer from each, and
``meshserve models`` / ``unload`` / ``load`` manage them on the running mesh.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.engine_cores import ENGINE_CORES_ENV, format_cores
from tests.conftest import affine_onnx
from tests.harness import RUNNING, log_tail, new_log, run_client

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "meshserve"
# The console script once the project is installed; the module otherwise.
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "deploy.cli"]

# Python and ONNX models and ensembles all live on the inference stage and the orchestrator.
MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: false
  cpu_placement: "off"
"""

TRIPLE_CONFIG = """
name: "triple"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

TRIPLE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = pb_utils.Tensor("Y", (x * 3).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[y]))
        return responses
"""

AFFINE_CONFIG = """
name: "affine"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

PIPELINE_CONFIG = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "affine" model_version: -1
      input_map { key: "X" value: "X" } output_map { key: "Y" value: "shifted" } },
    { model_name: "triple" model_version: -1
      input_map { key: "X" value: "shifted" } output_map { key: "Y" value: "Y" } }
  ]
}
"""


def write_repository(repo: Path) -> Path:
    """A Triton repository, as its docs describe it: config.pbtxt and version folders."""
    for name, config in (
        ("triple", TRIPLE_CONFIG),
        ("affine", AFFINE_CONFIG),
        ("pipeline", PIPELINE_CONFIG),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
    (repo / "triple" / "1" / "model.py").write_text(TRIPLE_MODEL)
    affine_onnx(repo / "affine" / "1" / "model.onnx")
    return repo


def meshserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("cli")
    repo = write_repository(root / "repo")
    (root / "mesh.yaml").write_text(MESH)
    log = new_log("meshserve serve")
    flags = ["--config", str(root / "mesh.yaml"), "--ports", "auto", "--grace-s", "5"]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*COMMAND, "serve", "--model-repository", str(repo), *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    RUNNING[proc.pid] = ("meshserve serve", log)
    try:
        yield _ready_info(proc, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        RUNNING.pop(proc.pid, None)


def _ready_info(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("MESHSERVE_MESH_READY"):
            info: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return info
    raise AssertionError(f"meshserve serve did not become ready:\n{log_tail(log)}")


def test_tritonclient_gets_each_models_answer(mesh: dict[str, Any]) -> None:
    reply = run_client("cli_repository.py", mesh["orchestrator"], ["triple", "affine", "pipeline"])
    x = np.array(reply["x"], dtype=np.float32)
    answers = {name: np.array(y, dtype=np.float32) for name, y in reply["answers"].items()}
    np.testing.assert_allclose(answers["triple"], x * 3)
    np.testing.assert_allclose(answers["affine"], x * 2 + 1)
    np.testing.assert_allclose(answers["pipeline"], (x * 2 + 1) * 3)


def test_models_lists_each_model_ready(mesh: dict[str, Any]) -> None:
    done = meshserve("models", "--url", mesh["orchestrator"])
    assert done.returncode == 0, done.stderr
    states = {line.split()[0]: line.split()[2] for line in done.stdout.splitlines()[1:]}
    assert states == {"affine": "READY", "pipeline": "READY", "triple": "READY"}


def test_unload_then_load_a_model(mesh: dict[str, Any]) -> None:
    url = mesh["orchestrator"]
    unloaded = meshserve("unload", "triple", "--url", url)
    assert unloaded.returncode == 0, unloaded.stderr
    listed = meshserve("models", "--url", url).stdout
    assert "READY" not in next(line for line in listed.splitlines() if line.startswith("triple"))
    loaded = meshserve("load", "triple", "--url", url)
    assert loaded.returncode == 0, loaded.stderr
    reply = run_client("cli_repository.py", url, ["pipeline"])
    x = np.array(reply["x"], dtype=np.float32)
    np.testing.assert_allclose(np.array(reply["answers"]["pipeline"]), (x * 2 + 1) * 3)


def test_an_error_prints_the_servers_words_and_exits_non_zero(mesh: dict[str, Any]) -> None:
    done = meshserve("load", "no_such_model", "--url", mesh["orchestrator"])
    assert done.returncode != 0
    assert "no_such_model" in done.stderr and done.stderr.startswith("error: ")


@pytest.mark.parametrize("command", ["serve", "models", "load", "unload"])
def test_every_command_describes_itself(command: str) -> None:
    done = meshserve(command, "--help")
    assert done.returncode == 0, done.stderr
    description = done.stdout.split("\n\n")[1]
    assert len(description.split()) >= 4, done.stdout
    assert "--url" in done.stdout or command == "serve"


def test_no_command_is_an_error_with_usage() -> None:
    done = meshserve()
    assert done.returncode == 2 and "usage: meshserve" in done.stderr


def test_every_service_learns_the_cores_its_engines_may_take(mesh: dict[str, Any]) -> None:
    # The placement/engine contract (shared/engine_cores.py): the supervisor names them.
    expected = format_cores(os.sched_getaffinity(0))
    for name, process in mesh["processes"].items():
        environment = Path(f"/proc/{process['pid']}/environ").read_bytes().split(b"\0")
        assert f"{ENGINE_CORES_ENV}={expected}".encode() in environment, name
