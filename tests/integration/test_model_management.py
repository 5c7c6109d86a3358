"""Queues, timeouts, reloads, warmup and bad input on a live inference service.

Each test writes the small model configs it needs, so the behaviour under test
is visible next to the assertions.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.prepare import prepare_repository
from shared.instances import cuda_device_count
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA, cache_dir
from tests.harness import ROOT, ServiceProcess

SLOW_CODE = DATA / "models" / "slow" / "1" / "model.py"


def slow_model(repo: Path, name: str, extra: str, batch: int = 0, instances: int = 1) -> None:
    """A copy of the sleeping python model with its own config."""
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(SLOW_CODE, repo / name / "1" / "model.py")
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: {batch}
input [ {{ name: "MS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "MS_OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{extra}
""")


WARM_CODE = """
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(1.5)  # a slow load, so a test can watch ModelReady stay false
        self.log = Path(args["model_repository"]) / "executions.log"

    def execute(self, requests):
        with self.log.open("a") as log:
            log.write(f"{len(requests)}\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mgmt-repo")
    prepared = prepare_repository(cache_dir())
    # A real copy (not a link): the reload test adds a version folder.
    shutil.copytree(prepared / "mlp", root / "mlp")
    slow_model(
        root,
        "tiny_queue",
        """
dynamic_batching { default_queue_policy { max_queue_size: 2 } }""",
    )
    slow_model(
        root,
        "reject_timeout",
        """
dynamic_batching { default_queue_policy { timeout_action: REJECT
                                           default_timeout_microseconds: 300000 } }""",
    )
    slow_model(
        root,
        "delay_timeout",
        """
dynamic_batching { default_queue_policy { timeout_action: DELAY
                                           default_timeout_microseconds: 100000 } }""",
    )
    (root / "warm" / "1").mkdir(parents=True)
    (root / "warm" / "1" / "model.py").write_text(WARM_CODE)
    (root / "warm" / "config.pbtxt").write_text("""
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
model_warmup [ { name: "zeros" batch_size: 1 count: 3
                 inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
""")
    return root


@pytest.fixture(scope="module")
def service(repo: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "services.inference.main",
        [
            "--model-repository",
            str(repo),
            "--metrics-port",
            "0",
            "--load-models",
            "mlp",
            "--load-models",
            "tiny_queue",
            "--load-models",
            "reject_timeout",
            "--load-models",
            "delay_timeout",
        ],
    )
    yield process
    process.stop()


@pytest.fixture
def stub(service: ServiceProcess) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(service.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def sleep_request(model: str, ms: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, {"MS": np.array([ms], dtype=np.int32)})
    return request


def mlp_request(rows: int = 1, version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mlp", model_version=version)
    encode_inputs(request, {"INPUT0": np.ones((rows, 16), dtype=np.float32)})
    return request


def assert_still_serves(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    outputs = decode_outputs(stub.ModelInfer(mlp_request(), timeout=30))
    assert outputs["OUTPUT0"].shape == (1, 8)


def wait_pending(service: ServiceProcess, model: str, count: int, timeout: float = 10) -> None:
    """Wait until ``count`` requests of ``model`` sit in its queue (not executing)."""
    series = ("nv_inference_pending_request_count", frozenset({("model", model), ("version", "1")}))
    deadline = time.monotonic() + timeout
    while service.metrics().get(series) != count:
        assert time.monotonic() < deadline, f"{model}: never {count} queued requests"
        time.sleep(0.02)


def test_full_queue_is_resource_exhausted_promptly(
    service: ServiceProcess, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    # One instance busy for 1.5 s, two requests queued: the next one is refused.
    busy = [stub.ModelInfer.future(sleep_request("tiny_queue", 1500)) for _ in range(3)]
    wait_pending(service, "tiny_queue", 2)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(sleep_request("tiny_queue", 1), timeout=10)
    assert time.monotonic() - started < 0.5
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tiny_queue" in caught.value.details()
    assert [decode_outputs(f.result(timeout=15))["MS_OUT"][0] for f in busy] == [1500] * 3


def test_queue_timeout_reject(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    running = stub.ModelInfer.future(sleep_request("reject_timeout", 1500))
    time.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(sleep_request("reject_timeout", 1), timeout=10)
    waited = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "timeout" in caught.value.details().lower()
    assert 0.2 < waited < 1.2  # rejected at its 300 ms timeout, not after the busy one
    assert decode_outputs(running.result(timeout=10))["MS_OUT"][0] == 1500


def test_queue_timeout_delay_still_executes(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    running = stub.ModelInfer.future(sleep_request("delay_timeout", 800))
    time.sleep(0.1)
    delayed = stub.ModelInfer(sleep_request("delay_timeout", 5), timeout=10)
    assert decode_outputs(delayed)["MS_OUT"][0] == 5
    assert decode_outputs(running.result(timeout=10))["MS_OUT"][0] == 800


@pytest.mark.parametrize(
    ("mutate", "code", "fragments"),
    [
        (
            lambda r: setattr(r.inputs[0], "datatype", "INT32"),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'INPUT0'", "INT32", "FP32"],
        ),
        (
            lambda r: (r.inputs[0].ClearField("shape"), r.inputs[0].shape.extend([2, 8])),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'INPUT0'", "[2, 8]"],
        ),
        (
            lambda r: (r.ClearField("inputs"), r.ClearField("raw_input_contents")),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["missing input 'INPUT0'"],
        ),
        (
            lambda r: r.outputs.add(name="LOGITS"),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["unknown output 'LOGITS'"],
        ),
        (
            lambda r: r.raw_input_contents.__setitem__(0, b"\x00" * 63),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["'INPUT0'", "63 bytes"],
        ),
        (
            lambda r: setattr(r, "model_name", "resnet9000"),
            grpc.StatusCode.NOT_FOUND,
            ["resnet9000"],
        ),
        (
            lambda r: setattr(r, "model_version", "7"),
            grpc.StatusCode.NOT_FOUND,
            ["mlp", "version '7'"],
        ),
        (
            lambda r: (
                r.inputs[0].ClearField("shape"),
                r.inputs[0].shape.extend([65, 16]),
                r.raw_input_contents.__setitem__(0, b"\x00" * 65 * 64),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            ["batch size 65", "max_batch_size"],
        ),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    stub: pb_grpc.GRPCInferenceServiceStub,
    mutate,
    code,
    fragments,  # type: ignore[no-untyped-def]
) -> None:
    request = mlp_request()
    mutate(request)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=10)
    assert caught.value.code() == code
    for fragment in fragments:
        assert fragment in caught.value.details()
    assert_still_serves(stub)


def test_reload_to_new_version_under_load_fails_nothing(
    repo: Path, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    stop = threading.Event()
    failures: list[str] = []
    versions: list[str] = []

    def generate() -> None:
        while not stop.is_set():
            try:
                versions.append(stub.ModelInfer(mlp_request(2), timeout=10).model_version)
            except grpc.RpcError as exc:
                failures.append(f"{exc.code()}: {exc.details()}")

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(generate)
        time.sleep(0.5)
        shutil.copytree(repo / "mlp" / "1", repo / "mlp" / "2")
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"), timeout=60)
        time.sleep(0.5)
        stop.set()
    assert failures == []
    assert versions[0] == "1" and versions[-1] == "2"
    assert len(versions) > 20
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(mlp_request(version="1"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_load_runs_warmup_before_ready_and_unload_stops_serving(
    repo: Path, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    log = repo / "warm" / "executions.log"
    loading = stub.RepositoryModelLoad.future(
        pb.RepositoryModelLoadRequest(model_name="warm"), timeout=60
    )
    time.sleep(0.5)
    assert not stub.ModelReady(pb.ModelReadyRequest(name="warm")).ready
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert {(m.name, m.state) for m in index.models} >= {("warm", "UNAVAILABLE")}
    loading.result()
    assert stub.ModelReady(pb.ModelReadyRequest(name="warm")).ready
    assert log.read_text().split() == ["1", "1", "1"]  # three warmup runs, before ready
    request = pb.ModelInferRequest(model_name="warm")
    encode_inputs(request, {"X": np.array([[1.0, 2.0]], dtype=np.float32)})
    assert decode_outputs(stub.ModelInfer(request))["Y"].tolist() == [[2.0, 4.0]]

    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="warm"))
    assert not stub.ModelReady(pb.ModelReadyRequest(name="warm")).ready
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.skipif(cuda_device_count() > 0, reason="this host has CUDA; see scripts/gpu_check.py")
def test_kind_gpu_without_cuda_fails_to_load_with_a_clear_message(
    repo: Path, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    slow_model(repo, "on_gpu", "", instances=1)
    config = repo / "on_gpu" / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="on_gpu"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KIND_GPU" in caught.value.details()
    assert "CUDA is not available" in caught.value.details()
    assert_still_serves(stub)


@pytest.mark.skipif(cuda_device_count() > 0, reason="this host has CUDA; see scripts/gpu_check.py")
def test_the_gpu_check_script_on_a_host_without_cuda_checks_the_refusal() -> None:
    """``make gpu-check`` on a CPU host: the service stays up and reports each
    KIND_GPU model UNAVAILABLE with its reason, and the script says PASS."""
    prepare_repository(cache_dir(), models=["mlp", "mobilenet_v2"], echo=lambda _: None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cache", str(cache_dir())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "CUDA not available" in done.stdout
    refusal = next(line for line in done.stdout.splitlines() if line.startswith("KIND_GPU"))
    assert "| PASS" in refusal and "KIND_GPU" in refusal.split("|")[2], refusal
