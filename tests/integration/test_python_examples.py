"""Triton's Python-backend examples, served by the mesh, pass their own clients.

The repository (tests/data/python_examples) holds models written to the
examples' contracts, placed as their READMEs say (auto_complete without a
config.pbtxt); each client (tests/clients/python_examples) talks to the mesh
as it would to tritonserver, only the address differing: HTTP clients to
Envoy, streaming gRPC clients to Envoy too, the metrics client to the
inference stage's /metrics.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import ROOT

EXAMPLES = ROOT / "tests" / "data" / "python_examples"
CLIENTS = ROOT / "tests" / "clients" / "python_examples"

MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: true
  restart_backoff_s: [0.2, 2.0]
  cpu_placement: off
"""

# An ensemble (served by the orchestrator, on no stage): OUTPUT0 = 2 (A + B), OUTPUT1 = 0.
TWICE = """
name: "twice"
platform: "ensemble"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map [ { key: "INPUT0" value: "INPUT0" }, { key: "INPUT1" value: "INPUT1" } ]
    output_map [ { key: "OUTPUT0" value: "sum" }, { key: "OUTPUT1" value: "unused" } ] },
  { model_name: "add_sub" model_version: -1
    input_map [ { key: "INPUT0" value: "sum" }, { key: "INPUT1" value: "sum" } ]
    output_map [ { key: "OUTPUT0" value: "OUTPUT0" }, { key: "OUTPUT1" value: "OUTPUT1" } ] }
] }
"""

# An ensemble around the decoupled square_int32: it streams as its step does.
SQUARES = """
name: "squares"
platform: "ensemble"
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SQUARE" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "square_int32" model_version: -1
    input_map { key: "IN" value: "COUNT" } output_map { key: "OUT" value: "SQUARE" } }
] }
"""

# bls_decoupled_sync's contract, but its target is the ensemble above: a decoupled
# model on no stage, so the BLS stream goes through the orchestrator.
BLS_SQUARES_CONFIG = """
name: "bls_squares"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

BLS_SQUARES = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="squares",
                inputs=[pb_utils.Tensor("COUNT", count)],
                requested_output_names=["SQUARE"],
            )
            total = np.array([0], np.int32)
            for answer in call.exec(decoupled=True):
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                if answer.output_tensors():
                    total += pb_utils.get_output_tensor_by_name(answer, "SQUARE").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("python-examples")
    repository = folder / "models"
    shutil.copytree(EXAMPLES, repository, ignore=shutil.ignore_patterns("README.md"))
    (repository / "twice").mkdir()
    (repository / "twice" / "config.pbtxt").write_text(TWICE)
    (repository / "squares").mkdir()
    (repository / "squares" / "config.pbtxt").write_text(SQUARES)
    (repository / "bls_squares" / "1").mkdir(parents=True)
    (repository / "bls_squares" / "config.pbtxt").write_text(BLS_SQUARES_CONFIG)
    (repository / "bls_squares" / "1" / "model.py").write_text(BLS_SQUARES)
    config = folder / "mesh.yaml"
    config.write_text(MESH)
    proc, info = start_mesh(repository, config, ["--grace-s", "5"])
    yield info
    stop_mesh(proc)


def edge(mesh: dict[str, Any]) -> str:
    return str(mesh["processes"]["envoy"]["grpc"])


def run_example(client: str, *args: str) -> str:
    """Run one example client; its output, which must end with its PASS line."""
    done = subprocess.run(
        [sys.executable, str(CLIENTS / client), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert done.returncode == 0, f"{client} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip().splitlines()[-1].startswith("PASS"), done.stdout
    return done.stdout


@pytest.mark.parametrize(
    ("client", "args"),
    [
        ("add_sub.py", ["add_sub"]),
        ("add_sub.py", ["pytorch"]),
        ("bls_async.py", []),
        ("bls_decoupled.py", ["bls_decoupled_sync", "1"]),
        ("bls_decoupled.py", ["bls_decoupled_async", "2"]),
        ("auto_complete.py", []),
    ],
)
def test_http_example_clients_pass(mesh: dict[str, Any], client: str, args: list[str]) -> None:
    run_example(client, edge(mesh), *args)


def test_bls_sync_reaches_both_models_and_reports_an_unknown_one(mesh: dict[str, Any]) -> None:
    printed = run_example("bls_sync.py", edge(mesh))
    assert "Request for unknown model: 'undefined_model' is not found" in printed


@pytest.mark.parametrize("client", ["repeat.py", "square.py"])
def test_decoupled_example_clients_pass_over_grpc_streams(
    mesh: dict[str, Any], client: str
) -> None:
    run_example(client, edge(mesh))


def test_custom_metrics_reach_the_stage_metrics_page(mesh: dict[str, Any]) -> None:
    port = mesh["processes"]["inference-0"]["metrics_port"]
    run_example("custom_metrics.py", edge(mesh), f"http://127.0.0.1:{port}/metrics")


def test_bls_to_a_model_on_another_stage_goes_through_the_orchestrator(
    mesh: dict[str, Any],
) -> None:
    """bls_sync asked for an ensemble: the orchestrator runs it, not the stage."""
    channel = grpc.insecure_channel(mesh["orchestrator"])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    request = pb.ModelInferRequest(model_name="bls_sync")
    encode_inputs(request, {"INPUT0": a, "INPUT1": b, "MODEL_NAME": np.array([b"twice"], object)})
    outputs = decode_outputs(stub.ModelInfer(request, timeout=60))
    channel.close()
    np.testing.assert_allclose(outputs["OUTPUT0"], 2 * (a + b))
    np.testing.assert_allclose(outputs["OUTPUT1"], np.zeros(4))


def test_a_decoupled_python_model_streams_through_an_ensemble(mesh: dict[str, Any]) -> None:
    channel = grpc.insecure_channel(edge(mesh))
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    requests = []
    for index, count in enumerate([3, 0]):
        request = pb.ModelInferRequest(model_name="squares", id=str(index))
        encode_inputs(request, {"COUNT": np.array([count], np.int32)})
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        requests.append(request)
    answers: dict[str, list[tuple[list[int], bool]]] = {"0": [], "1": []}
    for message in stub.ModelStreamInfer(iter(requests), timeout=60):
        assert not message.error_message, message.error_message
        response = message.infer_response
        values = [int(v) for v in decode_outputs(response).get("SQUARE", np.array([]))]
        answers[response.id].append(
            (values, response.parameters["triton_final_response"].bool_param)
        )
    channel.close()
    assert answers["0"] == [([3], False), ([3], False), ([3], False), ([], True)]
    assert answers["1"] == [([], True)]


def test_a_decoupled_bls_call_to_an_ensemble_streams_through_the_orchestrator(
    mesh: dict[str, Any],
) -> None:
    channel = grpc.insecure_channel(mesh["orchestrator"])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    sums = []
    for count in (4, 0, 3):
        request = pb.ModelInferRequest(model_name="bls_squares")
        encode_inputs(request, {"IN": np.array([count], np.int32)})
        sums.append(int(decode_outputs(stub.ModelInfer(request, timeout=60))["SUM"][0]))
    channel.close()
    assert sums == [16, 0, 9]
