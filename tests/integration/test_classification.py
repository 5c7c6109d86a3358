"""Triton's classification extension: outputs answered as their top classes.

A stage answers it for its models, the orchestrator for its ensembles;
tritonclient's ``class_count`` asks for it, over gRPC and (in
test_http_adapter) HTTP.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA
from tests.harness import run_client
from tests.in_process import MeshThread

LABELS = ["zero", "one", "two", "three"]
# add_sub's sum under other names, its labels beside the ensemble's config.
ENSEMBLE = """name: "sum_classes"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "B" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "names.txt" },
  { name: "DIFF" data_type: TYPE_FP32 dims: [ 4 ] }
]
ensemble_scheduling { step [ {
  model_name: "add_sub" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "SUM" } output_map { key: "OUTPUT1" value: "DIFF" }
} ] }
"""
# Rows [1, 4, 2, 3] and [0, 0, 5, 5]: two classes of the first output with its
# labels (ties go to the lower index), every class of the second (10 > 4).
EXPECTED_FIRST = [["4.000000:1:one", "3.000000:3:three"], ["5.000000:2:two", "5.000000:3:three"]]
EXPECTED_SECOND = [
    ["4.000000:1", "3.000000:3", "2.000000:2", "1.000000:0"],
    ["5.000000:2", "5.000000:3", "0.000000:0", "0.000000:1"],
]


@pytest.fixture(scope="module")
def orchestrator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshThread]:
    """A stage and the orchestrator, served in this process (tests/in_process.py)."""
    repo = tmp_path_factory.mktemp("classes")
    shutil.copytree(DATA / "models" / "add_sub", repo / "add_sub")
    config = repo / "add_sub" / "config.pbtxt"
    config.write_text(
        config.read_text().replace(
            '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }',
            '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" }',
        )
    )
    (repo / "add_sub" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (repo / "sum_classes" / "1").mkdir(parents=True)
    (repo / "sum_classes" / "config.pbtxt").write_text(ENSEMBLE)
    (repo / "sum_classes" / "names.txt").write_text("\n".join(LABELS) + "\n")
    served = MeshThread(repo)
    yield served
    served.close()


def test_a_stage_model_answers_top_classes_with_its_labels(orchestrator: MeshThread) -> None:
    answer = run_client(
        "classify.py", "grpc", orchestrator.address, "add_sub", "OUTPUT0", "OUTPUT1"
    )
    assert answer == {"OUTPUT0": EXPECTED_FIRST, "OUTPUT1": EXPECTED_SECOND}


def test_an_ensemble_answers_top_classes_with_its_labels(orchestrator: MeshThread) -> None:
    # The ensemble's inputs are A and B: the client's INPUT0/INPUT1 under other names.
    request = pb.ModelInferRequest(model_name="sum_classes")
    encode_inputs(
        request,
        {
            "A": np.array([[1, 4, 2, 3], [0, 0, 5, 5]], dtype=np.float32),
            "B": np.zeros((2, 4), dtype=np.float32),
        },
    )
    request.outputs.add(name="SUM").parameters["classification"].int64_param = 2
    request.outputs.add(name="DIFF").parameters["classification"].int64_param = 10
    with grpc.insecure_channel(orchestrator.address) as channel:
        answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert [(o.name, o.datatype, list(o.shape)) for o in answer.outputs] == [
        ("SUM", "BYTES", [2, 2]),
        ("DIFF", "BYTES", [2, 4]),
    ]
    outputs = decode_outputs(answer)
    assert [[s.decode() for s in row] for row in outputs["SUM"]] == EXPECTED_FIRST
    assert [[s.decode() for s in row] for row in outputs["DIFF"]] == EXPECTED_SECOND


@pytest.mark.parametrize("model", ["add_sub", "sum_classes"])
def test_a_class_count_that_is_not_a_positive_integer_names_the_output(
    orchestrator: MeshThread, model: str
) -> None:
    names = ("INPUT0", "INPUT1", "OUTPUT0") if model == "add_sub" else ("A", "B", "SUM")
    ones = np.ones((1, 4), dtype=np.float32)
    with grpc.insecure_channel(orchestrator.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for bad in ("3", 0):
            request = pb.ModelInferRequest(model_name=model)
            encode_inputs(request, {names[0]: ones, names[1]: ones})
            param = request.outputs.add(name=names[2]).parameters["classification"]
            if isinstance(bad, str):
                param.string_param = bad
            else:
                param.int64_param = bad
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"output '{names[2]}'" in caught.value.details()
            assert "must be a positive integer" in caught.value.details()
        # Still serving.
        request = pb.ModelInferRequest(model_name=model)
        encode_inputs(request, {names[0]: ones, names[1]: ones})
        assert stub.ModelInfer(request, timeout=30).outputs
