"""Triton's system shared-memory extension through the mesh, driven by tritonclient's
own shared_memory utilities over gRPC and HTTP: on the orchestrator (whose HTTP
front door shares its process) and on a stage called directly."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import DATA
from tests.harness import ServiceProcess, run_client
from tests.integration.test_orchestrator import ensemble

ALLOW = "--allow-client-shm=true"  # as Triton spells it
# add_sub as a one-step ensemble: its request is read and answered by the core.
PIPELINE = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "INPUT1" }
    output_map { key: "OUTPUT0" value: "OUTPUT0" } output_map { key: "OUTPUT1" value: "OUTPUT1" } }
] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shm-repo")
    shutil.copytree(DATA / "models" / "add_sub", root / "add_sub")
    ensemble(root, "pipeline", PIPELINE)
    return root


@pytest.fixture(scope="module")
def stage(repo: Path) -> Iterator[ServiceProcess]:
    served = ServiceProcess("services.inference.main", ["--model-repository", str(repo), ALLOW])
    yield served
    assert served.stop() == 0, served.logs()


@pytest.fixture(scope="module")
def orchestrator(repo: Path, stage: ServiceProcess) -> Iterator[ServiceProcess]:
    served = ServiceProcess(
        "gateway.http.in_orchestrator",
        [
            *["--model-repository", str(repo), "--stages", f"inference={stage.address}"],
            *["--http-port", "0", "--metrics-port", "-1", ALLOW],
        ],
    )
    yield served
    assert served.stop() == 0, served.logs()


def check(result: dict, carried_nothing: object) -> None:
    assert "system_shared_memory" in result["extensions"]
    assert result["registered"] == ["in", "out"]
    assert result["sum"] == [[11.0, 22.0, 33.0, 44.0]]
    assert result["diff"] == [[-9.0, -18.0, -27.0, -36.0]]
    assert result["carried"] == carried_nothing
    assert result["mixed_sum"] == [[21.0, 42.0, 63.0, 84.0]]
    assert result["mixed_diff"] == [[-19.0, -38.0, -57.0, -76.0]]
    errors = result["errors"]
    assert (
        "input 'INPUT0': shared-memory region 'ghost' is not registered" in errors["unknown_region"]
    )
    assert (
        "16 bytes at offset 24 run past the end of region 'in' (32 bytes)"
        in (errors["past_the_end"])
    )
    assert (
        "output 'OUTPUT0': its 16 bytes do not fit the 8 bytes given in region 'out'"
        in (errors["output_too_small"])
    )
    assert "'in' is already registered" in errors["twice"]
    assert "cannot open shared-memory object" in errors["no_object"]
    assert "is not a shared-memory object name" in errors["bad_key"]
    assert "CUDA shared memory is not supported" in errors["cuda"]
    assert result["after"] == [[11.0, 22.0, 33.0, 44.0]]
    assert result["left"] == ["out"]
    assert result["finally"] == []


@pytest.mark.parametrize("model", ["add_sub", "pipeline"])
def test_tritonclient_grpc_passes_tensors_through_the_orchestrator(
    orchestrator: ServiceProcess, model: str
) -> None:
    check(run_client("shared_memory.py", "grpc", orchestrator.address, model), [0, 0])


def test_tritonclient_http_passes_tensors_through_the_front_door(
    orchestrator: ServiceProcess,
) -> None:
    result = run_client("shared_memory.py", "http", orchestrator.info["http"], "add_sub")
    check(result, [False, False])


def test_tritonclient_grpc_passes_tensors_to_a_stage_directly(stage: ServiceProcess) -> None:
    check(run_client("shared_memory.py", "grpc", stage.address, "add_sub"), [0, 0])


def test_without_the_setting_registration_is_refused_naming_it(repo: Path) -> None:
    served = ServiceProcess("services.inference.main", ["--model-repository", str(repo)])
    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions == {}
            with pytest.raises(grpc.RpcError) as caught:
                stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(name="r", key="/r", byte_size=16)
                )
            metadata = stub.ServerMetadata(pb.ServerMetadataRequest())
    finally:
        served.stop()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow-client-shm" in caught.value.details()
    assert "system_shared_memory" not in metadata.extensions
