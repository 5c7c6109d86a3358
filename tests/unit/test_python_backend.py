"""The python backend in-process: Triton's model API, its errors, configs and metrics."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from prometheus_client import CollectorRegistry

from inference import model_config_pb2 as mc
from services.inference import python_utils as pb_utils
from services.inference.python import PythonInstance, PythonStreamingInstance
from services.inference.python_config import ModelConfig, completed_config, model_config_dict
from services.inference.python_metrics import METRICS
from shared import errors
from shared.backend import InstanceSpec, ModelSpec
from shared.request import InferRequest, InferResponse
from shared.statistics import render

INSTANCE = InstanceSpec(name="m_0_0", kind="KIND_CPU", device="cpu", intra_op_threads=1)


def write_model(tmp_path: Path, config_text: str, source: str) -> ModelSpec:
    config = text_format.Parse(config_text, mc.ModelConfig())
    version = tmp_path / config.name / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(source))
    return ModelSpec(config.name, 1, version, config)


ECHO_CONFIG = """
name: "echo"
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

ECHO = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                raise pb_utils.TritonModelException("negative input")
            if x[0] == 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "zero is not allowed", pb_utils.TritonError.INVALID_ARG)))
                continue
            seen = {
                "dims": self.config["input"][0]["dims"],
                "parameters": json.loads(request.parameters()),
                "requested": request.requested_output_names(),
                "cancelled": request.is_cancelled(),
                "instance": self.args["model_instance_name"],
            }
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", x * 2),
                 pb_utils.Tensor("ARGS", np.array([json.dumps(seen).encode()], dtype=object))],
                parameters={"doubled": True}))
        return responses
"""


def echo_request(value: int, **kwargs: object) -> InferRequest:
    return InferRequest("echo", "1", {"X": np.array([value], np.int32)}, **kwargs)  # type: ignore[arg-type]


def test_a_model_sees_triton_shaped_arguments_and_requests(tmp_path: Path) -> None:
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, ECHO), INSTANCE)
    (answer,) = instance.execute([echo_request(3, parameters={"user": "ada", "n": 2})])
    assert isinstance(answer, InferResponse)
    assert answer.outputs["Y"].tolist() == [6]
    assert answer.parameters == {"doubled": True}
    seen = json.loads(answer.outputs["ARGS"][0])
    # dims are numbers, as in Triton's model_config JSON (not protobuf's "1" strings)
    assert seen == {
        "dims": [1],
        "parameters": {"user": "ada", "n": 2},
        "requested": [],
        "cancelled": False,
        "instance": "m_0_0",
    }
    instance.close()


def test_requested_outputs_filter_the_response(tmp_path: Path) -> None:
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, ECHO), INSTANCE)
    (answer,) = instance.execute([echo_request(1, requested_outputs=["Y"])])
    assert isinstance(answer, InferResponse)
    assert list(answer.outputs) == ["Y"]


def test_model_errors_keep_triton_codes_and_messages(tmp_path: Path) -> None:
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, ECHO), INSTANCE)
    good, bad = instance.execute([echo_request(5), echo_request(0)])
    assert isinstance(good, InferResponse)
    assert isinstance(bad, errors.InvalidArgument)
    assert bad.message == "zero is not allowed"
    raised = instance.execute([echo_request(-1), echo_request(2)])
    # An exception in execute fails the whole batch, with Triton's wording.
    for failure in raised:
        assert isinstance(failure, errors.ModelError)
        assert failure.code.name == "INTERNAL"
        assert failure.message == (
            "Failed to process the request(s) for model instance 'm_0_0', "
            "message: TritonModelException: negative input"
        )


def test_an_unexpected_exception_is_internal_without_its_text(tmp_path: Path) -> None:
    source = """
    class TritonPythonModel:
        def execute(self, requests):
            raise KeyError("secret-path")
    """
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, source), INSTANCE)
    (failure,) = instance.execute([echo_request(1)])
    assert isinstance(failure, errors.MeshError)
    assert "secret-path" not in failure.message
    assert failure.message == errors.GENERIC_INTERNAL_MESSAGE


def test_a_wrong_number_of_responses_names_the_model(tmp_path: Path) -> None:
    source = """
    class TritonPythonModel:
        def execute(self, requests):
            return []
    """
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, source), INSTANCE)
    (failure,) = instance.execute([echo_request(1)])
    assert isinstance(failure, errors.ModelError)
    assert "model 'echo': execute returned 0 responses for 1 requests" in failure.message


def test_triton_error_codes_map_to_the_error_tree() -> None:
    cases = {
        pb_utils.TritonError.NOT_FOUND: errors.NotFound,
        pb_utils.TritonError.INVALID_ARG: errors.InvalidArgument,
        pb_utils.TritonError.UNAVAILABLE: errors.Unavailable,
        pb_utils.TritonError.UNSUPPORTED: errors.Unimplemented,
        pb_utils.TritonError.CANCELLED: errors.Cancelled,
        pb_utils.TritonError.INTERNAL: errors.ModelError,
    }
    for code, kind in cases.items():
        assert type(pb_utils.TritonError("x", code).as_mesh_error()) is kind
    assert type(pb_utils.TritonError("x").as_mesh_error()) is errors.ModelError
    back = pb_utils.TritonError.from_mesh_error(errors.NotFound("gone"))
    assert (back.code(), back.message()) == (pb_utils.TritonError.NOT_FOUND, "gone")


DECOUPLED_CONFIG = """
name: "counter"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

COUNTER = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.stopped = threading.Event()

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self.count, args=(request.get_response_sender(), n)).start()

    def count(self, sender, n):
        i = 0
        while n < 0 or i < n:  # n < 0: until the caller goes away
            if sender.is_cancelled():
                self.stopped.set()
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
            i += 1
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def test_a_decoupled_model_streams_then_sees_its_caller_leave(tmp_path: Path) -> None:
    spec = write_model(tmp_path, DECOUPLED_CONFIG, COUNTER)

    async def scenario() -> tuple[list[tuple[list[int], bool]], bool]:
        instance = PythonStreamingInstance(spec, INSTANCE)
        finite = InferRequest("counter", "1", {"N": np.array([3], np.int32)})
        got = [
            (r.outputs.get("I", np.array([])).tolist(), r.final)
            async for r in instance.stream(finite)
        ]
        endless = InferRequest("counter", "1", {"N": np.array([-1], np.int32)})
        stream = instance.stream(endless)
        async for _ in stream:
            break
        await stream.aclose()  # the caller went away
        stopped = await asyncio.to_thread(instance.loaded.model.stopped.wait, 5)
        await instance.close()
        return got, stopped

    got, stopped = asyncio.run(scenario())
    assert got == [([0], False), ([1], False), ([2], False), ([], True)]
    assert stopped, "the model never saw is_cancelled()"


def test_model_config_dict_writes_numbers_and_every_list() -> None:
    config = text_format.Parse(ECHO_CONFIG, mc.ModelConfig())
    document = model_config_dict(config)
    assert document["input"][0]["dims"] == [1]
    assert document["max_batch_size"] == 0
    assert pb_utils.get_output_config_by_name(document, "ARGS")["data_type"] == "TYPE_STRING"
    assert pb_utils.triton_string_to_numpy("TYPE_INT32") is np.int32
    assert pb_utils.using_decoupled_model_transaction_policy(document) is False


def test_auto_complete_fills_a_minimal_config_and_refuses_contradictions() -> None:
    class Model:
        @staticmethod
        def auto_complete_config(config: ModelConfig) -> ModelConfig:
            config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
            config.add_output({"name": "B", "data_type": "TYPE_FP32", "dims": [4]})
            config.set_max_batch_size(8)
            config.set_dynamic_batching()
            return config

    minimal = mc.ModelConfig(name="m", backend="python")
    completed = completed_config(minimal, Model)
    assert completed.max_batch_size == 8
    assert completed.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in completed.input] == [("A", [4])]

    contradicting = text_format.Parse(
        'name: "m" backend: "python" input [ { name: "A" data_type: TYPE_INT8 dims: [ 4 ] } ]',
        mc.ModelConfig(),
    )
    with pytest.raises(errors.ConfigError, match="input 'A': the configuration says data_type"):
        completed_config(contradicting, Model)
    larger = mc.ModelConfig(name="m", backend="python", max_batch_size=16)
    with pytest.raises(errors.ConfigError, match="max_batch_size 16"):
        completed_config(larger, Model)


def test_custom_metrics_are_served_under_their_own_names() -> None:
    registry = CollectorRegistry()
    METRICS.attach(registry)
    family = pb_utils.MetricFamily(
        "unit_test_latency_ns", "Time spent", pb_utils.MetricFamily.COUNTER
    )
    metric = family.Metric(labels={"model": "m", "version": "1"})
    again = pb_utils.MetricFamily(
        "unit_test_latency_ns", "Time spent", pb_utils.MetricFamily.COUNTER
    )
    again.Metric(labels={"version": "1", "model": "m"}).increment(5)  # the same series
    metric.increment(2)
    assert metric.value() == 7
    gauge = pb_utils.MetricFamily("unit_test_depth", "Depth", pb_utils.MetricFamily.GAUGE).Metric()
    gauge.set(3)
    text = render(registry).decode()
    assert "# TYPE unit_test_latency_ns counter" in text
    assert 'unit_test_latency_ns{model="m",version="1"} 7.0' in text
    assert "unit_test_depth 3.0" in text
    with pytest.raises(ValueError, match="cannot be decremented"):
        metric.increment(-1)
    with pytest.raises(ValueError, match="exists as a counter"):
        pb_utils.MetricFamily("unit_test_latency_ns", "x", pb_utils.MetricFamily.GAUGE)


def test_bls_without_a_bound_stage_is_a_clear_error() -> None:
    request = pb_utils.InferenceRequest(model_name=b"other", inputs=[], requested_output_names=[])
    assert request.model_name() == "other"  # bytes from a BYTES tensor work as in Triton
    with pytest.raises(pb_utils.TritonModelException, match="no server is bound"):
        request.exec()


def test_sys_exit_in_execute_fails_the_batch_not_the_stage(tmp_path: Path) -> None:
    source = """
    import sys
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
            if x[0] < 0:
                sys.exit(2)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]) for _ in requests]
    """
    instance = PythonInstance(write_model(tmp_path, ECHO_CONFIG, source), INSTANCE)
    (failure,) = instance.execute([echo_request(-1)])
    assert isinstance(failure, errors.MeshError)
    assert failure.message == errors.GENERIC_INTERNAL_MESSAGE
    (answer,) = instance.execute([echo_request(4)])  # the instance still serves
    assert isinstance(answer, InferResponse)
    assert answer.outputs["Y"].tolist() == [4]
