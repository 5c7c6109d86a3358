"""Bad input is the caller's error, named, never a 5xx / INTERNAL / UNKNOWN (issue 24).

One small mesh (an inference stage with ``add_sub``, the prepared ``minilm``
ONNX model, a torch embedding and a model whose weights are missing; Envoy in
front) takes what a careless or hostile client sends: an unknown query
parameter on a transcoded route, token ids out of a model's range, bytes that
are no protobuf message. Each answer is a 4xx / INVALID_ARGUMENT naming what
was wrong, with at most one log line and no traceback; a load error names the
model without the server's folders.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.prepare import prepare_repository
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository, cache_dir
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import RUNNING

MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: true
  cpu_placement: "off"
"""

EMBEDDER_CONFIG = """
backend: "pytorch"
max_batch_size: 8
input [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "VECTORS" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
"""

EMBEDDER = """
import torch


class Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.table(ids)
"""

# Model code that opens a file by its absolute path, as model code does.
MISSING_WEIGHTS = """
import os


class TritonPythonModel:
    def initialize(self, args):
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.bin"))
"""

UNDECODABLE = b"\xff\xff\xff\xff"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("bad-input")
    repo = build_repository(root / "repo", ["add_sub"], ["minilm"], prepare_repository(cache_dir()))
    (repo / "embedder" / "1").mkdir(parents=True)
    (repo / "embedder" / "config.pbtxt").write_text(EMBEDDER_CONFIG)
    (repo / "embedder" / "1" / "model.py").write_text(EMBEDDER)
    shutil.copytree(repo / "add_sub", repo / "missing_weights")
    config = repo / "missing_weights" / "config.pbtxt"
    config.write_text(config.read_text().replace('"add_sub"', '"missing_weights"'))
    (repo / "missing_weights" / "1" / "model.py").write_text(MISSING_WEIGHTS)
    (root / "mesh.yaml").write_text(MESH)
    proc, info = start_mesh(repo, root / "mesh.yaml", ["--grace-s", "5"])
    info["log"] = RUNNING[proc.pid][1]
    try:
        yield info
    finally:
        stop_mesh(proc)


@pytest.fixture(scope="module")
def stage(mesh: dict[str, Any]) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh["processes"]["inference-0"]["grpc"]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def rpc_error(method: Any, request: Any) -> grpc.RpcError:
    """The error ``method(request)`` answers (it must fail)."""
    with pytest.raises(grpc.RpcError) as caught:
        method(request, timeout=60)
    return caught.value


def http(url: str, body: Any = None) -> tuple[int, Any]:
    """GET (or POST JSON ``body``); the status and the parsed JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


# (a) an unknown query parameter on a transcoded route


def test_unknown_query_parameters_are_ignored_on_transcoded_routes(
    mesh: dict[str, Any],
) -> None:
    """Ignored, as the adapter's REST routes on the same port ignore them."""
    edge = f"http://{mesh['processes']['envoy']['grpc']}"
    status, answer = http(f"{edge}/api/v1/models?x=a")
    assert status == 200, answer
    assert "add_sub" in {model["name"] for model in answer["models"]}

    status, answer = http(f"{edge}/api/v1/models?ready_only=true&utm_source=a+b")
    assert status == 200, answer
    assert "missing_weights" not in {model["name"] for model in answer["models"]}

    tensor = {"datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    inputs = [{**tensor, "name": "INPUT0"}, {**tensor, "name": "INPUT1"}]
    status, answer = http(f"{edge}/api/v1/models/add_sub/infer?x=a", {"inputs": inputs})
    assert status == 200, answer
    outputs = {output["name"]: output["data"] for output in answer["outputs"]}
    assert outputs["OUTPUT0"] == [2, 4, 6, 8]


# (b) values out of a model's range


def minilm_request(input_ids: list[int], token_type_ids: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="minilm")
    ids = np.array([input_ids], np.int64)
    encode_inputs(
        request,
        {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.array([token_type_ids], np.int64),
        },
    )
    return request


def test_out_of_range_token_ids_to_an_onnx_model_are_invalid_argument(
    mesh: dict[str, Any], stage: pb_grpc.GRPCInferenceServiceStub
) -> None:
    log = Path(mesh["log"])
    before = log.stat().st_size
    failure = rpc_error(stage.ModelInfer, minilm_request([101, 1_000_000_000, 102], [0, 0, 0]))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.details()
    assert "model 'minilm'" in failure.details()
    assert "input 'input_ids'" in failure.details()
    assert "out of" in failure.details()

    failure = rpc_error(stage.ModelInfer, minilm_request([101, 7592, 102], [101, 101, 101]))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.details()
    assert "model 'minilm'" in failure.details()
    assert len(failure.details()) < 600

    # The model still serves, and no traceback was logged for the caller's error.
    outputs = decode_outputs(stage.ModelInfer(minilm_request([101, 7592, 102], [0, 0, 0])))
    assert outputs["last_hidden_state"].shape == (1, 3, 384)
    assert "Traceback" not in log.read_text()[before:]


def test_an_index_out_of_a_torch_embedding_is_invalid_argument(
    stage: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    request = pb.ModelInferRequest(model_name="embedder")
    encode_inputs(request, {"IDS": np.array([[1, 2, 99]], np.int64)})
    failure = rpc_error(stage.ModelInfer, request)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.details()
    assert "model 'embedder'" in failure.details()
    assert "out of" in failure.details()

    request = pb.ModelInferRequest(model_name="embedder")
    encode_inputs(request, {"IDS": np.array([[1, 2, 9]], np.int64)})
    assert decode_outputs(stage.ModelInfer(request))["VECTORS"].shape == (1, 3, 4)


# (c) bytes that are no protobuf message


@pytest.mark.parametrize("target", ["stage", "orchestrator", "edge"])
def test_an_undecodable_message_is_invalid_argument_with_one_log_line(
    mesh: dict[str, Any], target: str
) -> None:
    address = {
        "stage": mesh["processes"]["inference-0"]["grpc"],
        "orchestrator": mesh["orchestrator"],
        "edge": mesh["processes"]["envoy"]["grpc"],
    }[target]
    log = Path(mesh["log"])
    before = log.stat().st_size
    method = "/inference.GRPCInferenceService/ModelInfer"
    with grpc.insecure_channel(address) as channel:
        unary = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        failure = rpc_error(unary, UNDECODABLE)
        assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.details()
        assert "not a valid inference.ModelInferRequest message" in failure.details()

        streaming = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(streaming(iter([UNDECODABLE]), timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert "not a valid inference.ModelInferRequest message" in caught.value.details()
    written = log.read_text()[before:]
    assert "Traceback" not in written
    assert "Exception deserializing" not in written
    assert written.count("not a valid inference.ModelInferRequest") <= 2


# Item 9: a load error names the model, without the server's folders


def test_a_load_error_names_the_model_without_server_paths(
    mesh: dict[str, Any], stage: pb_grpc.GRPCInferenceServiceStub
) -> None:
    repository = Path(mesh["repository"])
    hidden = {str(repository), str(repository.resolve()), str(Path.home())}
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        rows = [
            row
            for target in (stage, stub)
            for row in target.RepositoryIndex(pb.RepositoryIndexRequest()).models
            if row.name == "missing_weights"
        ]
        load = rpc_error(
            stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="missing_weights")
        )
    assert rows and all(row.state == "UNAVAILABLE" for row in rows)
    assert load.code() == grpc.StatusCode.INVALID_ARGUMENT, load.details()
    assert "failed to load 'missing_weights'" in load.details()
    for reason in [row.reason for row in rows] + [load.details()]:
        assert "FileNotFoundError" in reason
        assert "missing_weights/1/weights.bin" in reason
        assert not any(folder in reason for folder in hidden), reason
    # The log keeps the details: the repository's path and the model code's traceback.
    text = Path(mesh["log"]).read_text()
    assert str(repository.absolute()) in text
    assert "Traceback" in text
