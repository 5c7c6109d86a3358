"""The inference service with real models, driven by unmodified tritonclient.

tritonclient runs in a child process (tests/clients/); outputs come back as
.npz files and are compared here with a local forward of the same model file.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.export import load_torchscript
from models.prepare import prepare_repository
from models.sources import sample_image
from services.preprocess.transform import preprocess
from tests.conftest import build_repository, cache_dir
from tests.harness import ServiceProcess, run_client

REAL_MODELS = ["mlp", "mobilenet_v2", "mobilenet_v2_onnx"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prepared = prepare_repository(cache_dir())
    return build_repository(
        tmp_path_factory.mktemp("infer-repo"), ["add_sub"], REAL_MODELS, prepared
    )


@pytest.fixture(scope="module")
def service(repo: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "services.inference.main", ["--model-repository", str(repo), "--metrics-port", "0"]
    )
    yield process
    process.stop()


def local_forward(repo: Path, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The expected outputs, from the same model file run in this process."""
    folder = repo / model / "1"
    if model == "mobilenet_v2_onnx":
        session = ort.InferenceSession(
            str(folder / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        (logits,) = session.run(["logits"], inputs)
        return {"logits": logits}
    if model == "add_sub":
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
    module = load_torchscript(folder / "model.pt")
    ((_, array),) = inputs.items()
    with torch.inference_mode():
        out = module(torch.from_numpy(array)).numpy()
    return {"OUTPUT0" if model == "mlp" else "logits": out}


def model_inputs(model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    if model == "mlp":
        return {"INPUT0": rng.standard_normal((3, 16)).astype(np.float32)}
    if model == "add_sub":
        return {
            "INPUT0": rng.standard_normal((2, 4)).astype(np.float32),
            "INPUT1": rng.standard_normal((2, 4)).astype(np.float32),
        }
    coffee = preprocess(sample_image("coffee.png").read_bytes())
    noise = rng.standard_normal((3, 224, 224)).astype(np.float32)
    return {"input": np.stack([coffee, noise])}


def infer(
    service: ServiceProcess,
    tmp_path: Path,
    model: str,
    inputs: dict[str, np.ndarray],
    mode: str = "sync",
    version: str = "",
) -> tuple[dict[str, np.ndarray], str]:
    in_path, out_path = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(in_path, **inputs)
    answer = run_client(
        "infer_npz.py", service.address, model, str(in_path), str(out_path), mode, version
    )
    with np.load(out_path) as outputs:
        return dict(outputs), answer["model_version"]


@pytest.mark.parametrize("mode", ["sync", "aio", "stream"])
@pytest.mark.parametrize("model", ["mlp", "mobilenet_v2", "mobilenet_v2_onnx", "add_sub"])
def test_tritonclient_outputs_match_local_forward(
    service: ServiceProcess, repo: Path, tmp_path: Path, model: str, mode: str
) -> None:
    inputs = model_inputs(model)
    outputs, version = infer(service, tmp_path, model, inputs, mode)
    expected = local_forward(repo, model, inputs)
    assert version == "1"
    assert set(outputs) == set(expected)
    for name, want in expected.items():
        assert outputs[name].shape == want.shape
        np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-4)


def test_mobilenet_recognises_the_espresso(service: ServiceProcess, tmp_path: Path) -> None:
    outputs, _ = infer(service, tmp_path, "mobilenet_v2_onnx", model_inputs("mobilenet_v2"))
    labels = (cache_dir() / "repository" / "mobilenet_v2_onnx" / "labels.txt").read_text()
    top1 = int(np.argmax(outputs["logits"][0]))
    assert labels.splitlines()[top1] == "espresso"


def test_concurrent_callers_are_batched_and_get_their_own_rows(
    service: ServiceProcess, repo: Path, tmp_path: Path
) -> None:
    callers, rows = 48, 2
    rng = np.random.default_rng(11)
    # Each caller's rows carry its own offset, so any mix-up shows in the outputs.
    inputs = {
        f"caller{i}": (rng.standard_normal((rows, 16)) + 10 * i).astype(np.float32)
        for i in range(callers)
    }
    np.savez(tmp_path / "in.npz", **inputs)
    stats = run_client(
        "concurrent_rows.py",
        service.address,
        "mlp",
        "INPUT0",
        "OUTPUT0",
        callers,
        rows,
        str(tmp_path / "in.npz"),
        str(tmp_path / "out.npz"),
    )
    with np.load(tmp_path / "out.npz") as outputs:
        for i in range(callers):
            want = local_forward(repo, "mlp", {"INPUT0": inputs[f"caller{i}"]})["OUTPUT0"]
            np.testing.assert_allclose(outputs[f"caller{i}"], want, rtol=1e-4, atol=1e-4)
    assert max(stats["batch_sizes"]) > rows, stats
    assert stats["execution_count"] < stats["inference_count"], stats


def test_metrics_count_requests_and_batches(service: ServiceProcess, tmp_path: Path) -> None:
    infer(service, tmp_path, "mlp", model_inputs("mlp"))
    port = service.info["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    success = [
        line
        for line in body.splitlines()
        if line.startswith('nv_inference_request_success{model="mlp",version="1"}')
    ]
    assert success and float(success[0].split()[-1]) >= 1
    assert "# TYPE nv_inference_request_success counter" in body
    assert 'meshserve_batch_size_bucket{le="1.0",model="mlp",version="1"}' in body
    assert 'nv_inference_pending_request_count{model="mlp",version="1"}' in body


def test_the_heap_is_frozen_once_ready_and_again_after_a_model_reload(
    service: ServiceProcess,
) -> None:
    """What the stage loaded is out of the collector's full passes (shared/gc_heap.py),
    and a model's reload, which unfreezes the heap to collect what it drops, leaves
    it frozen again."""
    frozen = ("meshserve_gc_frozen_objects", frozenset())
    full = ("python_gc_collections_total", frozenset({("generation", "2")}))
    before = service.metrics()
    assert before[frozen] > 10_000  # torch and ORT are in
    with grpc.insecure_channel(service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="add_sub"), timeout=60)
    after = service.metrics()
    assert after[frozen] > 10_000
    assert after[full] > before[full]  # the reload's collection, before freezing again


def test_model_metadata_and_config_through_tritonclient(service: ServiceProcess) -> None:
    answer = run_client("model_info.py", service.address, "mobilenet_v2_onnx")
    assert answer["metadata"]["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": ["-1", "3", "224", "224"]}
    ]
    assert answer["metadata"]["platform"] == "onnxruntime"
    assert answer["config"]["config"]["max_batch_size"] == 64
    assert answer["ready"] is True
    names = {(m["name"], m.get("state")) for m in answer["index"]}
    assert ("mobilenet_v2_onnx", "READY") in names
    assert json.dumps(answer["statistics"])  # serialisable, non-empty below
    assert answer["statistics"]["model_stats"][0]["name"] == "mobilenet_v2_onnx"
