"""An ensemble step's request and answer built and read without protobuf objects
for the tensors (services/orchestrator/step_wire.py): protobuf reads them alike."""

from __future__ import annotations

import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, WireTensor
from services.orchestrator.step_wire import answer_tensors, request_bytes
from shared.errors import MeshError

STEP = Step(1, "minilm", "2", {"input_ids": "ids"}, {"last_hidden_state": "hidden"})


def test_request_reads_as_the_protobuf_request_would() -> None:
    ids = np.arange(6, dtype=np.int64).reshape(1, 6)
    big = np.ones((1, 3, 224, 224), dtype=np.float32).tobytes()
    inputs = {
        "input_ids": WireTensor("INT64", (1, 6), memoryview(ids.tobytes())),
        "pixels": WireTensor("FP32", (1, 3, 224, 224), big),
    }
    priority = pb.InferParameter(int64_param=2)
    data = request_bytes(STEP, inputs, ["last_hidden_state"], "req-7", {"priority": priority})

    request = pb.ModelInferRequest.FromString(data)
    assert (request.model_name, request.model_version, request.id) == ("minilm", "2", "req-7")
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("input_ids", "INT64", [1, 6]),
        ("pixels", "FP32", [1, 3, 224, 224]),
    ]
    assert list(request.raw_input_contents) == [ids.tobytes(), big]
    assert [o.name for o in request.outputs] == ["last_hidden_state"]
    assert request.parameters["priority"].int64_param == 2


def test_answer_tensors_are_views_of_the_answer() -> None:
    hidden = np.random.default_rng(0).random((1, 6, 384), dtype=np.float32)
    response = pb.ModelInferResponse(model_name="minilm", model_version="2", id="~3")
    response.parameters["x"].string_param = "y"
    response.outputs.add(name="last_hidden_state", datatype="FP32", shape=[1, 6, 384])
    response.raw_output_contents.append(hidden.tobytes())
    response.outputs.add(name="empty", datatype="INT64", shape=[0])
    response.raw_output_contents.append(b"")
    answer = response.SerializeToString()

    tensors = answer_tensors("minilm", answer)

    assert list(tensors) == ["last_hidden_state", "empty"]
    tensor = tensors["last_hidden_state"]
    assert (tensor.datatype, tensor.shape) == ("FP32", (1, 6, 384))
    assert isinstance(tensor.raw, memoryview) and tensor.raw.obj is answer
    assert np.array_equal(np.frombuffer(tensor.raw, dtype=np.float32).reshape(1, 6, 384), hidden)
    assert bytes(tensors["empty"].raw) == b""


def test_an_answer_that_is_not_one_names_the_model() -> None:
    with pytest.raises(MeshError, match="model 'minilm': the stage's answer does not parse"):
        answer_tensors("minilm", b"\x2a\xff\xff")  # field 5, a length past the end
    typed = pb.ModelInferResponse(model_name="minilm")
    typed.outputs.add(name="out", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    with pytest.raises(MeshError, match="1 outputs with 0 raw_output_contents"):
        answer_tensors("minilm", typed.SerializeToString())
