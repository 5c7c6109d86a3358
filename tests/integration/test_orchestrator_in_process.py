"""The orchestrator and its stages in one process: the core, both front doors, the
router and streams, each a real grpc.aio server on port 0 in the test's event loop.

Python-backend stages serve the test models (tests/in_process.py). No process
is spawned, so each test starts its own mesh.
"""

from __future__ import annotations

import asyncio
import shutil
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from meshserve.v1 import meshserve_pb2 as api
from shared.errors import InvalidArgument, NotFound, Unavailable
from shared.stream_messages import FINAL_RESPONSE
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA
from tests.in_process import Mesh, running

# add_sub, then its sum doubled and its difference tripled, concurrently.
DIAMOND = """
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM_X2" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "DIFF_X3" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "double" model_version: -1
    input_map { key: "X" value: "sum" } output_map { key: "Y" value: "SUM_X2" } },
  { model_name: "triple" model_version: -1
    input_map { key: "X" value: "diff" } output_map { key: "Y" value: "DIFF_X3" } }
] }
"""

# repeat_int32 streams; each of its responses is negated by the step after it.
NEGATED_REPEAT = """
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "NEG" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "repeat_int32" model_version: -1
    input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" }
    input_map { key: "WAIT" value: "WAIT" }
    output_map { key: "OUT" value: "out" } output_map { key: "IDX" value: "IDX" } },
  { model_name: "negate" model_version: -1
    input_map { key: "X" value: "out" } output_map { key: "Y" value: "NEG" } }
] }
"""

NEGATE_CONFIG = """
name: "negate"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

NEGATE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                "Y", -pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""


def _scale(repo: Path, name: str, factor: float) -> None:
    shutil.copytree(DATA / "models" / "scale", repo / name)
    config = repo / name / "config.pbtxt"
    config.write_text(
        config.read_text()
        .replace('name: "scale"', f'name: "{name}"')
        .replace('string_value: "2"', f'string_value: "{factor}"')
    )


def _ensemble(repo: Path, name: str, body: str, batch: int) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: {batch}\n{body}'
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    shutil.copytree(DATA / "models" / "add_sub", tmp_path / "add_sub")
    _scale(tmp_path, "double", 2)
    _scale(tmp_path, "triple", 3)
    shutil.copytree(DATA / "python_examples" / "repeat_int32", tmp_path / "repeat_int32")
    (tmp_path / "negate" / "1").mkdir(parents=True)
    (tmp_path / "negate" / "config.pbtxt").write_text(NEGATE_CONFIG)
    (tmp_path / "negate" / "1" / "model.py").write_text(textwrap.dedent(NEGATE))
    _ensemble(tmp_path, "diamond", DIAMOND, 8)
    _ensemble(tmp_path, "negated_repeat", NEGATED_REPEAT, 0)
    return tmp_path


def in_mesh(
    repo: Path, scenario: Callable[[Mesh], Awaitable[None]], replicas: int = 1, **kwargs: list[str]
) -> None:
    async def run() -> None:
        async with running(repo, replicas, **kwargs) as mesh:
            await asyncio.wait_for(scenario(mesh), 60)

    asyncio.run(run())


def infer_request(model: str, **inputs: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, inputs)
    return request


def add_sub_request() -> pb.ModelInferRequest:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    return infer_request("add_sub", INPUT0=a, INPUT1=np.ones((2, 4), np.float32))


def repeat_request(model: str, values: list[int]) -> pb.ModelInferRequest:
    return infer_request(
        model,
        IN=np.array(values, np.int32),
        DELAY=np.zeros(len(values), np.uint32),
        WAIT=np.zeros(1, np.uint32),
    )


async def status_of(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def test_a_stage_model_is_forwarded_with_its_raw_tensors_untouched(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        request = add_sub_request()
        direct = await mesh.core.infer(request, timeout_s=10)
        answer = await mesh.v2.ModelInfer(request, timeout=10)
        assert (answer.model_name, answer.model_version) == ("add_sub", "1")
        assert list(answer.raw_output_contents) == list(direct.raw_output_contents)
        outputs = decode_outputs(answer)
        np.testing.assert_array_equal(outputs["OUTPUT0"], np.arange(8).reshape(2, 4) + 1)
        np.testing.assert_array_equal(outputs["OUTPUT1"], np.arange(8).reshape(2, 4) - 1)
        await requests_without_a_deadline_share_a_stream(mesh)

    in_mesh(repo, scenario)


async def requests_without_a_deadline_share_a_stream(mesh: Mesh) -> None:
    """Forwarded as messages on an open stream (no deadline, no trace), each request
    still gets its own answer under its own id, as ModelInfer gives it, and a
    stage's error keeps its status and words."""
    requests = []
    for index in range(12):
        request = add_sub_request()
        request.raw_input_contents[0] = np.full((2, 4), index, np.float32).tobytes()
        request.id = f"caller-{index}" if index % 3 else ""
        requests.append(request)
    answers = await asyncio.gather(*(mesh.v2.ModelInfer(r) for r in requests))
    for index, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert answer.id == request.id
        assert decode_outputs(answer)["OUTPUT0"].tolist() == [[index + 1.0] * 4] * 2
        assert FINAL_RESPONSE not in answer.parameters
    (endpoint,) = mesh.core.router.endpoints
    assert endpoint.forward_streams, "no request travelled on a stream"
    bad = add_sub_request()
    bad.inputs[0].shape[:] = [2, 3]
    error = await status_of(mesh.v2.ModelInfer(bad))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "INPUT0" in (error.details() or "")


def test_an_ensemble_runs_its_graph_through_both_front_doors(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        a = np.full((1, 4), 5, np.float32)
        b = np.full((1, 4), 2, np.float32)
        outputs = decode_outputs(
            await mesh.v2.ModelInfer(infer_request("diamond", A=a, B=b), timeout=10)
        )
        assert outputs["SUM_X2"].tolist() == [[14.0] * 4]
        assert outputs["DIFF_X3"].tolist() == [[9.0] * 4]
        tensors = [api.Tensor(name=n, datatype="FP32", shape=[1, 4]) for n in "AB"]
        for tensor, value in zip(tensors, (5, 2), strict=True):
            tensor.data.extend([value] * 4)
        answer = await mesh.api.Infer(api.InferRequest(model="diamond", inputs=tensors))
        by_name = {t.name: list(t.data) for t in answer.outputs}
        assert by_name == {"SUM_X2": [14.0] * 4, "DIFF_X3": [9.0] * 4}

    in_mesh(repo, scenario)


def test_metadata_config_index_and_statistics_of_stage_models_and_ensembles(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        ensemble = await mesh.v2.ModelMetadata(pb.ModelMetadataRequest(name="diamond"))
        assert ensemble.platform == "ensemble" and [i.name for i in ensemble.inputs] == ["A", "B"]
        stage = await mesh.v2.ModelMetadata(pb.ModelMetadataRequest(name="add_sub"))
        assert stage.platform == "python" and stage.versions == ["1"]
        config = await mesh.v2.ModelConfig(pb.ModelConfigRequest(name="double"))
        assert config.config.parameters["factor"].string_value == "2"
        await mesh.v2.ModelInfer(add_sub_request())
        stats = await mesh.v2.ModelStatistics(pb.ModelStatisticsRequest())
        counts = {s.name: s.inference_count for s in stats.model_stats}
        assert counts["add_sub"] == 2 and counts["diamond"] == 0
        index = await mesh.v2.RepositoryIndex(pb.RepositoryIndexRequest(ready=True))
        assert {m.name for m in index.models} >= {"add_sub", "diamond", "negated_repeat"}
        listed = await mesh.api.ListModels(api.ListModelsRequest(ready_only=True))
        stages = {m.name: m.stage for m in listed.models}
        assert stages["diamond"] == "orchestrator" and stages["add_sub"] == "inference"
        model = (await mesh.api.GetModel(api.GetModelRequest(name="double"))).model
        assert (model.backend, model.max_batch_size) == ("python", 8)
        health = await mesh.api.Health(api.HealthRequest())
        assert health.status == api.SERVING_STATUS_SERVING
        assert (await mesh.v2.ServerReady(pb.ServerReadyRequest())).ready

    in_mesh(repo, scenario)


def test_a_decoupled_model_streams_each_response_then_a_final_flag(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        request = repeat_request("repeat_int32", [4, 5, 6])
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        call = mesh.v2.ModelStreamInfer(iter([request]))
        messages = [message async for message in call]
        assert all(not m.error_message for m in messages)
        values = [decode_outputs(m.infer_response) for m in messages if m.infer_response.outputs]
        assert [int(v["OUT"][0]) for v in values] == [4, 5, 6]
        assert messages[-1].infer_response.parameters[FINAL_RESPONSE].bool_param
        direct = [r async for r in mesh.core.stream(repeat_request("repeat_int32", [7, 8]))]
        assert [int(decode_outputs(r)["OUT"][0]) for r in direct] == [7, 8]

    in_mesh(repo, scenario)


def test_a_streaming_ensemble_runs_its_later_steps_once_per_response(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        responses = [r async for r in mesh.core.stream(repeat_request("negated_repeat", [1, 2, 3]))]
        outputs = [decode_outputs(r) for r in responses if r.outputs]
        assert [int(o["NEG"][0]) for o in outputs] == [-1, -2, -3]
        assert [int(o["IDX"][0]) for o in outputs] == [0, 1, 2]
        with pytest.raises(InvalidArgument, match="is decoupled"):
            await mesh.core.infer(repeat_request("negated_repeat", [1]))

    in_mesh(repo, scenario)


def test_errors_speak_tritons_words_and_name_the_tensor(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        unknown = await status_of(mesh.v2.ModelInfer(infer_request("ghost"), timeout=10))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND
        assert "Request for unknown model: 'ghost' is not found" in (unknown.details() or "")
        with pytest.raises(NotFound, match="'ghost'"):
            await mesh.core.metadata("ghost")
        bad = infer_request("diamond", A=np.ones((1, 4), np.float32), B=np.ones((1, 4), np.int32))
        wrong = await status_of(mesh.v2.ModelInfer(bad, timeout=10))
        assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'B' has datatype INT32, expected FP32" in (wrong.details() or "")
        nan = np.full((1, 4), np.nan, np.float32)
        step = await status_of(mesh.v2.ModelInfer(infer_request("diamond", A=nan, B=nan)))
        assert step.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ensemble 'diamond' step 0 ('add_sub')" in (step.details() or "")
        assert "INPUT0 contains NaN" in (step.details() or "")
        in_stream = mesh.v2.ModelStreamInfer(iter([infer_request("ghost")]))
        (message,) = [m async for m in in_stream]
        assert "Request for unknown model: 'ghost'" in message.error_message
        # A JSON tensor whose negative dims multiply to its element count (found by the fuzzer).
        negative = api.Tensor(name="A", datatype="FP32", shape=[-2, -2])
        negative.data.extend([1.0] * 4)
        call = mesh.api.Infer(api.InferRequest(model="diamond", inputs=[negative]))
        shaped = await status_of(call)
        assert shaped.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensor 'A': shape [-2, -2] has a negative dimension" in (shaped.details() or "")

    in_mesh(repo, scenario)


def test_a_stage_that_is_down_answers_unavailable(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        await mesh.stages[0].stop()
        down = await status_of(mesh.v2.ModelInfer(add_sub_request(), timeout=10))
        assert down.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage 'inference'" in (down.details() or "")
        with pytest.raises(Unavailable, match="no ready replica"):
            await mesh.core.infer(add_sub_request())
        assert not (await mesh.v2.ServerReady(pb.ServerReadyRequest())).ready

    in_mesh(repo, scenario)


def test_a_replica_that_went_away_is_retried_on_another(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        gone, other = mesh.core.router.endpoints
        await mesh.stages[0].stop()  # the router has not noticed: no refresh yet
        for _ in range(3):
            answer = await mesh.v2.ModelInfer(add_sub_request(), timeout=10)
            assert answer.model_name == "add_sub"
        assert not gone.ready and other.ready

    in_mesh(repo, scenario, replicas=2)


def test_a_model_not_loaded_loads_on_the_stage_whose_index_lists_it(repo: Path) -> None:
    async def scenario(mesh: Mesh) -> None:
        request = infer_request("double", X=np.ones((1, 4), np.float32))
        before = await status_of(mesh.v2.ModelInfer(request, timeout=10))
        assert before.code() == grpc.StatusCode.NOT_FOUND
        await mesh.v2.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="double"))
        assert decode_outputs(await mesh.v2.ModelInfer(request))["Y"].tolist() == [[2.0] * 4]
        await mesh.core.unload("double", {})
        assert not await mesh.core.model_ready("double")
        with pytest.raises(NotFound, match="failed to poll from model repository"):
            await mesh.core.load("ghost", {})

    in_mesh(repo, scenario, load=["add_sub"])
