"""The orchestrator in front of real stages: forwarding, ensembles as dataflow
graphs, load-time validation, errors naming the step, replicas.

The stages and the orchestrator are served in this process (tests/in_process.py);
tritonclient runs in a child process: its generated ``inference`` modules
cannot share a process with ours."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import DATA
from tests.harness import run_client
from tests.in_process import MeshThread


def scale_model(repo: Path, name: str, factor: float, sleep_ms: int = 0, width: int = 4) -> None:
    """The python model ``scale`` as ``name``: Y = X * factor, rows of ``width`` FP32."""
    shutil.copytree(DATA / "models" / "scale", repo / name)
    config = repo / name / "config.pbtxt"
    config.write_text(
        config.read_text()
        .replace('name: "scale"', f'name: "{name}"')
        .replace('string_value: "2"', f'string_value: "{factor}"')
        .replace('string_value: "0"', f'string_value: "{sleep_ms}"')
        .replace("dims: [ 4 ]", f"dims: [ {width} ]")
    )


def ensemble(repo: Path, name: str, body: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f'platform: "ensemble"\nmax_batch_size: 8\n{body}')


# (a + b) and (a - b) from add_sub, then both branches scaled concurrently.
DIAMOND = """
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM_X2" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "DIFF_X3" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "double_slow" model_version: -1
    input_map { key: "X" value: "sum" } output_map { key: "Y" value: "SUM_X2" } },
  { model_name: "triple_slow" model_version: -1
    input_map { key: "X" value: "diff" } output_map { key: "Y" value: "DIFF_X3" } }
] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("orch-repo")
    shutil.copytree(DATA / "models" / "add_sub", root / "add_sub")
    scale_model(root, "double_slow", 2, sleep_ms=400)
    scale_model(root, "triple_slow", 3, sleep_ms=400)
    scale_model(root, "double", 2)
    ensemble(root, "diamond", DIAMOND)
    return root


@pytest.fixture(scope="module")
def mesh(repo: Path) -> Iterator[MeshThread]:
    """Two inference replicas and the orchestrator, served in this process."""
    # No grace: a stage stopped by a test goes at once, as a killed one would.
    served = MeshThread(repo, replicas=2, refresh_interval_s=0.5, grace_s=0)
    yield served
    served.close()


@pytest.fixture
def stub(mesh: MeshThread) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def diamond_request(a: np.ndarray, b: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": a, "B": b})
    return request


def test_ensemble_runs_independent_branches_concurrently(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    # The first call also opens the channels to both replicas: time a later one.
    stub.ModelInfer(diamond_request(a, b), timeout=30)
    started = time.monotonic()
    outputs = decode_outputs(stub.ModelInfer(diamond_request(a, b), timeout=30))
    elapsed = time.monotonic() - started
    np.testing.assert_allclose(outputs["SUM_X2"], (a + b) * 2)
    np.testing.assert_allclose(outputs["DIFF_X3"], (a - b) * 3)
    # Two 400 ms branches after add_sub: concurrent takes ~0.4 s, serial ~0.8 s.
    assert elapsed < 0.75, elapsed


def test_ensemble_equals_its_steps_called_one_by_one(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    whole = decode_outputs(stub.ModelInfer(diamond_request(a, b), timeout=30))
    step = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(step, {"INPUT0": a, "INPUT1": b})
    first = decode_outputs(stub.ModelInfer(step, timeout=30))
    for model, tensor, output in (
        ("double_slow", "OUTPUT0", "SUM_X2"),
        ("triple_slow", "OUTPUT1", "DIFF_X3"),
    ):
        request = pb.ModelInferRequest(model_name=model)
        encode_inputs(request, {"X": first[tensor]})
        np.testing.assert_array_equal(decode_outputs(stub.ModelInfer(request))["Y"], whole[output])


def test_tritonclient_through_the_orchestrator(mesh: MeshThread, tmp_path: Path) -> None:
    a = np.full((1, 4), 5, dtype=np.float32)
    b = np.full((1, 4), 2, dtype=np.float32)
    np.savez(tmp_path / "in.npz", A=a, B=b)
    answer = run_client(
        "infer_npz.py",
        mesh.address,
        "diamond",
        str(tmp_path / "in.npz"),
        str(tmp_path / "out.npz"),
        "sync",
    )
    assert sorted(answer["outputs"]) == ["DIFF_X3", "SUM_X2"]
    with np.load(tmp_path / "out.npz") as out:
        assert out["SUM_X2"].tolist() == [[14.0] * 4]
        assert out["DIFF_X3"].tolist() == [[9.0] * 4]
    info = run_client("model_info.py", mesh.address, "diamond")
    assert info["metadata"]["platform"] == "ensemble"
    assert info["ready"] is True
    assert {m["name"] for m in info["index"]} >= {"diamond", "add_sub", "double"}


def test_step_error_names_the_step_and_tensor(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    a = np.full((1, 4), np.nan, dtype=np.float32)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(diamond_request(a, a), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert "ensemble 'diamond' step 0 ('add_sub')" in details
    assert "INPUT0 contains NaN" in details


def test_bad_ensemble_input_names_the_tensor(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="diamond")
    encode_inputs(request, {"A": np.ones((1, 4), np.float32), "B": np.ones((1, 4), np.int32)})
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'B' has datatype INT32, expected FP32" in caught.value.details()


def test_an_ensemble_version_it_lacks_is_not_found(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    a = np.ones((1, 4), dtype=np.float32)
    request = diamond_request(a, a)
    request.model_version = "1"
    answer = stub.ModelInfer(request, timeout=30)
    assert (answer.model_name, answer.model_version) == ("diamond", "1")
    request.model_version = "7"
    calls = [
        lambda: stub.ModelInfer(request, timeout=30),
        lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="diamond", version="7")),
        lambda: stub.ModelConfig(pb.ModelConfigRequest(name="diamond", version="7")),
        lambda: stub.ModelStatistics(pb.ModelStatisticsRequest(name="diamond", version="7")),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "ensemble 'diamond' has no version '7'" in caught.value.details()
    ready = stub.ModelReady(pb.ModelReadyRequest(name="diamond", version="7"))
    assert ready.ready is False
    assert stub.ModelReady(pb.ModelReadyRequest(name="diamond", version="1")).ready is True


@pytest.mark.parametrize(("model", "names"), [("diamond", "AB"), ("add_sub", ["INPUT0", "INPUT1"])])
@pytest.mark.parametrize("kind", ["input", "output"])
def test_a_tensor_in_an_unregistered_region_is_refused_naming_both(
    stub: pb_grpc.GRPCInferenceServiceStub, model: str, names: Sequence[str], kind: str
) -> None:
    # An ensemble's request is read here; a stage model's goes on as it is and its
    # stage refuses it: the same answer either way.
    request = pb.ModelInferRequest(model_name=model)
    ones = np.ones((1, 4), dtype=np.float32)
    encode_inputs(request, {names[0]: ones, names[1]: ones})
    tensor = request.inputs[0] if kind == "input" else request.outputs.add(name="X")
    tensor.parameters["shared_memory_region"].string_param = "region0"
    tensor.parameters["shared_memory_byte_size"].int64_param = 16
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{kind} '{tensor.name}': shared-memory region 'region0' is not registered" in (
        caught.value.details()
    )


def test_caller_deadline_bounds_the_ensemble(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    a = np.ones((1, 4), dtype=np.float32)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(diamond_request(a, a), timeout=0.2)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize(
    ("name", "body", "fragments"),
    [
        (
            "missing_tensor",
            DIAMOND.replace(
                'value: "diff" } output_map { key: "Y" value: "DIFF',
                'value: "nowhere" } output_map { key: "Y" value: "DIFF',
            ),
            ["step 2 ('triple_slow')", "'nowhere'", "no input or step produces"],
        ),
        (
            "unknown_model",
            DIAMOND.replace('model_name: "double_slow"', 'model_name: "ghost"'),
            ["step 1 ('ghost')", "unknown model 'ghost'"],
        ),
        (
            "cycle",
            DIAMOND.replace('{ key: "INPUT1" value: "B" }', '{ key: "INPUT1" value: "SUM_X2" }'),
            ["cycle", "step 0 ('add_sub')", "step 1 ('double_slow')"],
        ),
        (
            "bad_dtype",
            DIAMOND.replace('name: "B" data_type: TYPE_FP32', 'name: "B" data_type: TYPE_INT32'),
            ["step 0 ('add_sub') input 'INPUT1'", "datatype INT32 does not match FP32"],
        ),
        (
            "bad_shape",
            DIAMOND.replace(
                'name: "A" data_type: TYPE_FP32 dims: [ 4 ]',
                'name: "A" data_type: TYPE_FP32 dims: [ 5 ]',
            ),
            ["step 0 ('add_sub') input 'INPUT0'", "shape [-1, 5] does not match [-1, 4]"],
        ),
    ],
)
def test_invalid_ensemble_is_rejected_at_load_naming_the_step(
    repo: Path,
    stub: pb_grpc.GRPCInferenceServiceStub,
    name: str,
    body: str,
    fragments: list[str],
) -> None:
    ensemble(repo, name, body)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for fragment in fragments:
        assert fragment in caught.value.details()
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
    (row,) = [m for m in index.models if m.name == name]
    assert row.state == "UNAVAILABLE" and fragments[0] in row.reason


def double_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="double")
    encode_inputs(request, {"X": np.ones((1, 4), dtype=np.float32)})
    return request


def test_replica_killed_under_load_requests_keep_succeeding_then_unavailable(
    mesh: MeshThread, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    stop = threading.Event()
    failures: list[str] = []
    successes = [0]

    def generate(timeout: float | None) -> None:
        # Without a deadline a request is forwarded on an open stream: those too
        # are answered by the other replica once their stream ends with the drain.
        while not stop.is_set():
            try:
                stub.ModelInfer(double_request(), timeout=timeout)
                successes[0] += 1
            except grpc.RpcError as exc:
                failures.append(f"{exc.code()}: {exc.details()}")

    with ThreadPoolExecutor(4) as pool:
        for index in range(4):
            pool.submit(generate, 10 if index % 2 else None)
        time.sleep(0.5)
        mesh.run(mesh.mesh.stages[0].stop())
        time.sleep(1.5)
        stop.set()
    assert failures == []
    assert successes[0] > 20

    mesh.run(mesh.mesh.stages[1].stop())
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(double_request(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stage 'inference'" in caught.value.details()
    assert stub.ServerLive(pb.ServerLiveRequest()).live
