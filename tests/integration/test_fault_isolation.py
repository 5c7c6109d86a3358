"""One model that cannot load never takes the others down (issue 16).

A repository holds a good model beside broken ones (model code that raises in
``initialize``, a config.pbtxt with a syntax error, a missing import, model
code that calls ``sys.exit``). The mesh starts as users start it, under the
supervisor: the good model serves, each broken one answers UNAVAILABLE naming
its error, the index and the stage's metrics say which and why, and no
process is restarted. Errors carry Triton's words, which Triton's clients
match on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import RUNNING

# Two stages: a config whose backend cannot be read is listed by both, and the
# orchestrator's index must still show it once.
MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
    - { name: postprocess, module: services.postprocess.main, replicas: 1 }
  edge: false
  cpu_placement: "off"
  restart_backoff_s: [0.2, 1.0]
"""

# What each broken model's error must name (its exception's text).
BROKEN = {
    "broken_init": "broken_init cannot open its weights",
    "broken_config": "config.pbtxt:3",
    "broken_import": "No module named 'no_such_module_for_meshserve'",
    "exits_in_init": "SystemExit(3)",
    "broken_ensemble": "input 'X' has no data_type",
}

STAGE_MODELS = [name for name in BROKEN if name != "broken_ensemble"]

# Line 3 never closes its brace: text_format stops there.
BAD_CONFIG = 'backend: "python"\nmax_batch_size: 8\ninput [ { name: "X" data_type: TYPE_FP32 \n'

# Parses, but fails validation: the orchestrator (which serves ensembles) reports it.
BAD_ENSEMBLE = """
platform: "ensemble"
input [ { name: "X" dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_sub" input_map { key: "INPUT0" value: "X" }
  output_map { key: "OUTPUT0" value: "Y" } } ] }
"""


def python_model(repo: Path, name: str, body: str) -> None:
    """A copy of add_sub named ``name`` whose model.py is ``body``."""
    shutil.copytree(repo / "add_sub", repo / name)
    config = repo / name / "config.pbtxt"
    config.write_text(config.read_text().replace('"add_sub"', f'"{name}"'))
    (repo / name / "1" / "model.py").write_text(body)


def broken_config(repo: Path, name: str) -> None:
    shutil.copytree(repo / "add_sub", repo / name)
    (repo / name / "config.pbtxt").write_text(BAD_CONFIG)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("faults")
    repo = build_repository(root / "repo", ["add_sub"], [])
    python_model(
        repo,
        "broken_init",
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('broken_init cannot open its weights')\n",
    )
    python_model(repo, "broken_import", "import no_such_module_for_meshserve\n")
    python_model(
        repo,
        "exits_in_init",
        "import sys\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
        "        sys.exit(3)\n",
    )
    broken_config(repo, "broken_config")
    broken_config(repo, "fixed_later")
    (repo / "broken_ensemble").mkdir()
    (repo / "broken_ensemble" / "config.pbtxt").write_text(BAD_ENSEMBLE)
    config = root / "mesh.yaml"
    config.write_text(MESH)
    proc, info = start_mesh(repo, config, ["--grace-s", "5"])
    info["log"] = RUNNING[proc.pid][1]
    try:
        yield info
    finally:
        stop_mesh(proc)


@pytest.fixture(scope="module")
def stub(mesh: dict[str, Any]) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def stage(mesh: dict[str, Any]) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh["processes"]["inference-0"]["grpc"]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def add_request(model: str = "add_sub", version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    encode_inputs(
        request,
        {"INPUT0": np.full((1, 4), 3, np.float32), "INPUT1": np.ones((1, 4), np.float32)},
    )
    return request


def assert_add_sub_serves(stub: pb_grpc.GRPCInferenceServiceStub, model: str = "add_sub") -> None:
    outputs = decode_outputs(stub.ModelInfer(add_request(model), timeout=30))
    assert outputs["OUTPUT0"].tolist() == [[4.0] * 4]
    assert outputs["OUTPUT1"].tolist() == [[2.0] * 4]


def rpc_error(method: Any, request: Any) -> grpc.RpcError:
    """The error ``method(request)`` answers (it must fail)."""
    with pytest.raises(grpc.RpcError) as caught:
        method(request, timeout=60)
    return caught.value


def metrics(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            pairs = (pair.split("=", 1) for pair in labels.rstrip("}").split(",") if pair)
            samples[name, frozenset((k, json.loads(v)) for k, v in pairs)] = float(value)
    return samples


def test_broken_models_are_unavailable_with_their_errors_and_the_rest_serves(
    mesh: dict[str, Any], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    assert_add_sub_serves(stub)
    for name, error in BROKEN.items():
        for method, request in (
            (stub.ModelInfer, add_request(name)),
            (stub.ModelMetadata, pb.ModelMetadataRequest(name=name)),
        ):
            failure = rpc_error(method, request)
            assert failure.code() == grpc.StatusCode.UNAVAILABLE, (name, failure.details())
            assert f"failed to load '{name}'" in failure.details()
            assert error in failure.details()
        assert not stub.ModelReady(pb.ModelReadyRequest(name=name)).ready

    rows = stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
    by_name: dict[str, list[Any]] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    assert [(r.state, r.version) for r in by_name["add_sub"]] == [("READY", "1")]
    repository = Path(mesh["repository"])
    for name, error in BROKEN.items():
        (row,) = by_name[name]  # once, though both stages list an unreadable config
        assert row.state == "UNAVAILABLE"
        assert error in row.reason
        assert len(row.reason) <= 1000
        # Any caller reads the reason: no folder of the server's in it.
        assert str(repository) not in row.reason and str(repository.resolve()) not in row.reason
    assert "broken_config/config.pbtxt:3:" in by_name["broken_config"][0].reason
    ready = {r.name for r in stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True)).models}
    assert ready == {"add_sub"}


def test_the_stage_metrics_and_log_name_each_failure(mesh: dict[str, Any]) -> None:
    samples = metrics(mesh["processes"]["inference-0"]["metrics_port"])
    for name in STAGE_MODELS:
        labels = frozenset({("model", name)})
        assert samples[("meshserve_model_load_failures_total", labels)] >= 1
        assert samples[("meshserve_model_ready", labels)] == 0
    assert samples[("meshserve_model_ready", frozenset({("model", "add_sub")}))] == 1
    log = Path(mesh["log"]).read_text()
    for name, error in BROKEN.items():
        if name not in STAGE_MODELS:
            continue
        lines = [line for line in log.splitlines() if f"failed to load '{name}'" in line]
        assert lines and "ERROR" in lines[0] and error in lines[0], (name, lines)


def test_no_process_restarts_for_a_model_fault(mesh: dict[str, Any]) -> None:
    time.sleep(3)  # the supervisor restarts a stage that exited within 0.2 s
    for process in mesh["processes"].values():
        assert subprocess.run(["kill", "-0", str(process["pid"])], check=False).returncode == 0
    assert "restarting" not in Path(mesh["log"]).read_text()


def test_a_fixed_model_serves_after_a_runtime_load(
    mesh: dict[str, Any], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    folder = Path(mesh["repository"]) / "fixed_later"
    failure = rpc_error(stub.ModelInfer, add_request("fixed_later"))
    assert failure.code() == grpc.StatusCode.UNAVAILABLE
    text = (Path(mesh["repository"]) / "add_sub" / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(text.replace('"add_sub"', '"fixed_later"'))
    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="fixed_later"), timeout=60)
    assert_add_sub_serves(stub, "fixed_later")
    rows = stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
    assert [(r.state, r.reason) for r in rows if r.name == "fixed_later"] == [("READY", "")]


# Triton's error texts, which clients written for Triton match on.


def test_unknown_model_in_tritons_words_on_the_orchestrator_and_the_stage(
    stub: pb_grpc.GRPCInferenceServiceStub, stage: pb_grpc.GRPCInferenceServiceStub
) -> None:
    for target in (stub, stage):
        failure = rpc_error(target.ModelInfer, add_request("nope"))
        assert failure.code() == grpc.StatusCode.NOT_FOUND
        assert failure.details().startswith("Request for unknown model: 'nope' is not found")
    failure = rpc_error(stage.ModelInfer, add_request(version="7"))
    assert failure.code() == grpc.StatusCode.NOT_FOUND
    assert failure.details().startswith(
        "Request for unknown model: 'add_sub' version 7 is not found"
    )


def test_failed_loads_say_failed_to_load(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    bad = pb.RepositoryModelLoadRequest(model_name="add_sub")
    bad.parameters["config"].string_param = '{"max_batch_size": '
    failure = rpc_error(stub.RepositoryModelLoad, bad)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failed to load 'add_sub'" in failure.details()
    assert "not a valid JSON model config" in failure.details()
    assert_add_sub_serves(stub)  # the versions that served keep serving

    unknown = pb.RepositoryModelLoadRequest(model_name="nope")
    failure = rpc_error(stub.RepositoryModelLoad, unknown)
    assert failure.code() == grpc.StatusCode.NOT_FOUND
    assert "failed to load 'nope', failed to poll from model repository" in failure.details()

    failure = rpc_error(
        stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="broken_init")
    )
    assert "failed to load 'broken_init'" in failure.details()
    assert BROKEN["broken_init"] in failure.details()

    # A runtime load names the model and its file in the repository, nothing above it.
    failure = rpc_error(
        stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="broken_config")
    )
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failed to load 'broken_config'" in failure.details()
    assert "broken_config/config.pbtxt:3:" in failure.details()
    assert "/broken_config/" not in failure.details()
