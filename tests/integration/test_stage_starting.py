"""A stage that is (re)starting: its models are UNAVAILABLE, never unknown, and
serve as soon as they are loaded; a light model serves while a heavy one loads.

A restarted stage binds its port and answers RepositoryIndex before its models
are loaded (health NOT_SERVING until they are). Clients retry UNAVAILABLE, not
NOT_FOUND, so the orchestrator must not call a model of a starting stage
unknown; and it asks such a stage again every fraction of a second, not at its
refresh interval, so the model serves at once when it is in. The stage and the
orchestrator are real grpc.aio servers in the test's event loop.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.inference.python import PythonBackend
from services.inference.pytorch import PyTorchBackend
from services.orchestrator.main import OrchestratorConfig, build_parts
from shared.server import MeshServer
from shared.stage import StageConfig, build_stage_parts
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA

LOAD_S = 1.0
"""How long the model takes to load (its initialize sleeps)."""

LATE_CODE = f"""
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({LOAD_S})

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""

LATE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def late_repository(root: Path) -> Path:
    (root / "late" / "1").mkdir(parents=True)
    (root / "late" / "1" / "model.py").write_text(LATE_CODE)
    (root / "late" / "config.pbtxt").write_text(LATE_CONFIG)
    shutil.copytree(DATA / "models" / "add_sub", root / "add_sub")  # listed, never loaded
    return root


async def code_of(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def assert_still_loading(call: object) -> None:
    """The call is refused UNAVAILABLE, saying its model is not loaded yet."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        assert "not loaded yet" in (exc.details() or "")
    else:
        raise AssertionError("a model still loading answered")


def test_a_starting_stage_models_are_unavailable_then_serve_at_once(tmp_path: Path) -> None:
    repo = late_repository(tmp_path / "repo")
    request = pb.ModelInferRequest(model_name="late")
    encode_inputs(request, {"X": np.array([1.0, 2.0], np.float32)})

    async def scenario() -> None:
        config = StageConfig(
            service_name="inference-0", model_repository=repo, load_models=["late"]
        )
        stage = MeshServer(config, build_stage_parts(config, {"python": PythonBackend()}))
        starting = asyncio.create_task(stage.start())  # binds, then loads
        # The port is bound before the models load; nothing announces it.
        while stage.port == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        orchestrator_config = OrchestratorConfig(
            grpc_port=0,
            metrics_port=-1,
            stages=[f"inference={stage.address}"],
            model_repository=repo,
            refresh_interval_s=300,  # longer than the test: only the probe can see it load
        )
        orchestrator = MeshServer(orchestrator_config, build_parts(orchestrator_config))
        await orchestrator.start()
        channel = grpc.aio.insecure_channel(orchestrator.address)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            assert not starting.done()
            await assert_still_loading(stub.ModelInfer(request, timeout=10))
            await starting
            loaded = asyncio.get_running_loop().time()
            # Serving is what is measured: ask until it answers.
            while await code_of(stub.ModelInfer(request, timeout=10)) != grpc.StatusCode.OK:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            assert asyncio.get_running_loop().time() - loaded < 2.0
            answer = await stub.ModelInfer(request, timeout=10)
            assert decode_outputs(answer)["Y"].tolist() == [1.0, 2.0]
            # Once the stage is up, a model it lists but did not load is unknown again.
            other = pb.ModelInferRequest(model_name="add_sub")
            assert await code_of(stub.ModelInfer(other, timeout=10)) == grpc.StatusCode.NOT_FOUND
        finally:
            await channel.close()
            await orchestrator.stop()
            await stage.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


HEAVY_LOAD_S = 1.0
"""How long the torch model takes to build (its constructor sleeps)."""

HEAVY_CODE = f"""
import time

import torch


class Heavy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        time.sleep({HEAVY_LOAD_S})

    def forward(self, x):
        return x
"""

TENSORS = """
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_a_light_model_serves_while_a_heavy_one_loads_and_the_stage_never_says_unknown(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    (repo / "heavy" / "1").mkdir(parents=True)
    (repo / "heavy" / "1" / "model.py").write_text(HEAVY_CODE)
    (repo / "heavy" / "config.pbtxt").write_text('backend: "pytorch"' + TENSORS)
    (repo / "light" / "1").mkdir(parents=True)
    (repo / "light" / "1" / "model.py").write_text(
        LATE_CODE.replace(f"sleep({LOAD_S})", "sleep(0)")
    )
    (repo / "light" / "config.pbtxt").write_text(LATE_CONFIG)

    def infer(model: str) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name=model)
        encode_inputs(request, {"X": np.array([3.0, 4.0], np.float32)})
        return request

    async def scenario() -> None:
        config = StageConfig(service_name="inference-0", model_repository=repo)
        backends = {"python": PythonBackend(), "pytorch": PyTorchBackend()}
        stage = MeshServer(config, build_stage_parts(config, backends))
        starting = asyncio.create_task(stage.start())
        while stage.port == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        channel = grpc.aio.insecure_channel(stage.address)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            # Asked straight, the stage says "loading" (UNAVAILABLE) for both at first.
            code = await code_of(stub.ModelInfer(infer("heavy"), timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE
            while await code_of(stub.ModelInfer(infer("light"), timeout=10)) != grpc.StatusCode.OK:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            # The light model serves; the heavy one is still loading, and says so.
            assert not starting.done()
            await assert_still_loading(stub.ModelInfer(infer("heavy"), timeout=10))
            await starting
            answer = await stub.ModelInfer(infer("heavy"), timeout=10)
            assert decode_outputs(answer)["Y"].tolist() == [3.0, 4.0]
            # Once started, a model it does not have is unknown again.
            unknown = await code_of(stub.ModelInfer(infer("nothing"), timeout=10))
            assert unknown == grpc.StatusCode.NOT_FOUND
        finally:
            await channel.close()
            await stage.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
