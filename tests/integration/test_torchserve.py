"""TorchServe's users move in unchanged: their .mar archives (built here with the real
torch-model-archiver), their handlers, and their calls, through Envoy.

One small mesh for the module (inference, preprocess and postprocess stages,
the orchestrator serving the HTTP front door, Envoy with TorchServe's
management listener). The seed's flow runs as TorchServe's docs write it, with curl;
the built-in image_classifier handler over the repository's MobileNetV2
answers what the mesh's own image_classifier ensemble answers; a batchSize 8
archive gets its requests in batches.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from deploy.cli import main as cli
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import decode_outputs, encode_inputs
from tests.data.torchserve.archives import KITTEN_LABELS, echo_mar, kitten_mar, mobilenet_mar
from tests.e2e.conftest import start_mesh, stop_mesh

ENSEMBLE_PARTS = ("image_classifier", "image_preprocess", "mobilenet_v2_onnx", "imagenet_top5")
BATCHED_CONFIG = "batchSize: 8\nmaxBatchDelay: 1000\nminWorkers: 1\nmaxWorkers: 2\n"

MESH = """
defaults: {{ host: 127.0.0.1, grace_period_s: 1 }}
services:
  http_adapter: {{ model_store: "{store}", model_repository: "{repository}" }}
  envoy: {{ torchserve_management_port: 8081 }}
supervisor:
  stages:
    - {{ name: inference, module: services.inference.main, replicas: 1 }}
    - {{ name: preprocess, module: services.preprocess.main, replicas: 1 }}
    - {{ name: postprocess, module: services.postprocess.main, replicas: 1 }}
  edge: true
  jobs: {{ enabled: false }}
  trace_store: false
  restart_backoff_s: [0.2, 2.0]
  cpu_placement: off
"""


@pytest.fixture(scope="module")
def mesh(
    prepared_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("torchserve")
    repository, store = folder / "models", folder / "model-store"
    repository.mkdir()
    for name in ENSEMBLE_PARTS:
        (repository / name).symlink_to(prepared_repository / name, target_is_directory=True)
    config = folder / "mesh.yaml"
    config.write_text(MESH.format(store=store, repository=repository))
    # The archives are built while the mesh starts (registration needs them, start-up not).
    with ThreadPoolExecutor(2) as pool:
        built: list[Future[Any]] = [
            pool.submit(kitten_mars, folder, store),
            pool.submit(mobilenet_mar, folder / "mobilenet", store, prepared_repository),
            pool.submit(echo_mar, folder / "echo", store),
            pool.submit(echo_mar, folder / "echo-2", store / "v2", version="2.0"),
        ]
        proc, info = start_mesh(repository, config, ["--grace-s", "2"])
        for archive in built:
            archive.result()
    info["management"] = f"http://127.0.0.1:{management_port(info)}"
    info["edge"] = f"http://{info['processes']['envoy']['grpc']}"
    info["folder"] = folder
    yield info
    stop_mesh(proc)


def kitten_mars(folder: Path, store: Path) -> None:
    """kitten.mar and kitten_b8.mar, one after the other (torch.jit.script is not
    thread-safe)."""
    kitten_mar(folder / "kitten", store)
    kitten_mar(folder / "b8", store, name="kitten_b8", config=BATCHED_CONFIG)


def management_port(info: dict[str, Any]) -> int:
    """The free port --ports auto gave TorchServe's management listener (Envoy's flag)."""
    pid = info["processes"]["envoy"]["pid"]
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(args[args.index("--torchserve-management-port") + 1])


def call(method: str, url: str, body: bytes | None = None) -> tuple[int, Any]:
    """One HTTP call; (status, JSON answer)."""
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def curl(*args: str) -> Any:
    """The real curl, as TorchServe's docs use it; its JSON answer."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (Debian package curl; make system-packages)")
    done = subprocess.run(
        ["curl", "-sS", "--fail-with-body", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def kitten_jpeg(folder: Path) -> Path:
    """chelsea.png (a tabby cat) as the seed's kitten.jpg."""
    path = folder / "kitten.jpg"
    if not path.exists():
        buffer = io.BytesIO()
        Image.open(sample_image("chelsea.png")).convert("RGB").save(buffer, "JPEG")
        path.write_bytes(buffer.getvalue())
    return path


def test_the_seed_flow_runs_unchanged(mesh: dict[str, Any]) -> None:
    """Register, scale to 2 workers, curl -T a photo, describe, unregister."""
    admin, edge = mesh["management"], mesh["edge"]
    registered = curl("-X", "POST", f"{admin}/models?url=kitten.mar&initial_workers=1")
    assert registered == {"status": 'Model "kitten" Version: 1.0 registered with 1 initial workers'}
    scaled = curl("-X", "PUT", f"{admin}/models/kitten?min_worker=2&synchronous=true")
    assert scaled["status"].startswith("Workers scaled to 2")

    answer = curl("-T", str(kitten_jpeg(mesh["folder"])), f"{edge}/predictions/kitten")
    # The handler's JSON: its top-3 classes of the photo, most likely first, and the batch.
    scores = [value for key, value in answer.items() if key != "batch"]
    assert set(answer) - {"batch"} <= set(KITTEN_LABELS) and len(scores) == 3
    assert scores == sorted(scores, reverse=True) and 0 < scores[-1] <= scores[0] <= 1
    assert answer["batch"] == 1

    [described] = curl(f"{admin}/models/kitten")
    assert described["modelName"] == "kitten" and described["modelVersion"] == "1.0"
    assert described["minWorkers"] == 2 and len(described["workers"]) == 2
    assert {w["status"] for w in described["workers"]} == {"READY"}
    listed = curl(f"{admin}/models")["models"]
    assert {"modelName": "kitten", "modelUrl": "kitten.mar"} in listed

    # A normal model of the mesh: in the v2 index, answering v2 inference too.
    status, index = call("POST", f"{edge}/v2/repository/index", b"{}")
    assert status == 200 and {"name": "kitten", "version": "1", "state": "READY"} in [
        {k: row.get(k) for k in ("name", "version", "state")} for row in index
    ]
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(mesh["orchestrator"]))  # type: ignore[no-untyped-call]
    request = pb.ModelInferRequest(model_name="kitten")
    jpeg = kitten_jpeg(mesh["folder"]).read_bytes()
    encode_inputs(request, {"body": np.array([[jpeg]], dtype=np.object_)})
    v2 = json.loads(decode_outputs(stub.ModelInfer(request, timeout=60))["output"][0, 0])
    assert v2 == answer

    assert curl("-X", "DELETE", f"{admin}/models/kitten") == {
        "status": 'Model "kitten" unregistered'
    }
    status, missing = call("GET", f"{admin}/models/kitten")
    assert status == 404 and missing["type"] == "ModelNotFoundException"
    status, gone = call("POST", f"{edge}/predictions/kitten", jpeg)
    assert status == 404, gone


def test_management_refuses_what_torchserve_refuses(mesh: dict[str, Any]) -> None:
    admin, edge = mesh["management"], mesh["edge"]
    status, answer = call("POST", f"{admin}/models?url=https://example.com/x.mar")
    assert status == 400 and "model store" in answer["message"]
    status, answer = call("POST", f"{admin}/models?url=../../etc/passwd")
    assert status == 400 and "outside the model store" in answer["message"]
    status, answer = call("POST", f"{admin}/models?url=nothing.mar")
    assert status == 404 and answer["type"] == "ModelNotFoundException"
    status, answer = call("POST", f"{admin}/models?url=kitten.mar&batch_size=0")
    assert status == 400 and "batch_size" in answer["message"]
    # The management API is not on the inference port.
    status, _ = call("GET", f"{edge}/models")
    assert status == 404
    status, pong = call("GET", f"{edge}/ping")
    assert status == 200 and pong == {"status": "Healthy"}


def test_builtin_image_classifier_answers_as_the_mesh_ensemble(mesh: dict[str, Any]) -> None:
    """The same MobileNetV2 weights, TorchServe's image_classifier handler vs the
    mesh's image_classifier ensemble: the same top-5 for the same photos."""
    admin, edge = mesh["management"], mesh["edge"]
    # An unpacked archive (--archive-format no-archive) is registered by its folder's name.
    curl("-X", "POST", f"{admin}/models?url=mobilenet_ts&initial_workers=1&synchronous=true")
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(mesh["orchestrator"]))  # type: ignore[no-untyped-call]
    for photo in ("chelsea.png", "coffee.png"):
        data = sample_image(photo).read_bytes()
        status, handler_top5 = call("POST", f"{edge}/predictions/mobilenet_ts", data)
        assert status == 200, handler_top5
        request = pb.ModelInferRequest(model_name="image_classifier")
        encode_inputs(request, {"IMAGE": np.array([[data]], dtype=np.object_)})
        outputs = decode_outputs(stub.ModelInfer(request, timeout=60))
        labels = [label.decode() for label in outputs["LABELS"][0]]
        assert list(handler_top5) == labels, photo
        assert np.allclose(list(handler_top5.values()), outputs["PROBABILITIES"][0], atol=2e-3)
    call("DELETE", f"{admin}/models/mobilenet_ts")


def test_batch_size_8_runs_concurrent_predictions_in_batches(mesh: dict[str, Any]) -> None:
    admin, edge = mesh["management"], mesh["edge"]
    curl("-X", "POST", f"{admin}/models?url=kitten_b8.mar&synchronous=true")
    [described] = curl(f"{admin}/models/kitten_b8")
    assert (described["batchSize"], described["maxBatchDelay"]) == (8, 1000)
    jpeg = kitten_jpeg(mesh["folder"]).read_bytes()
    with ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(lambda _: call("POST", f"{edge}/predictions/kitten_b8", jpeg), range(16))
        )
    assert all(status == 200 for status, _ in answers), answers
    batches = [answer["batch"] for _, answer in answers]
    assert max(batches) > 1 and max(batches) <= 8, batches
    # The mesh's statistics show it too.
    status, stats = call("GET", f"{edge}/v2/models/kitten_b8/stats")
    sizes = {int(row["batch_size"]) for row in stats["model_stats"][0]["batch_stats"]}
    assert status == 200 and max(sizes) > 1, stats
    # And TorchServe's own metric names, on the inference stage's /metrics.
    port = mesh["processes"]["inference-0"]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    counted = [
        line
        for line in text.splitlines()
        if line.startswith("ts_inference_requests_total{") and 'model_name="kitten_b8"' in line
    ]
    assert counted and float(counted[0].split()[-1]) >= 16, counted
    assert "ts_queue_latency_microseconds{" in text
    assert "ts_inference_latency_microseconds{" in text


def test_streamed_parts_headers_explanations_and_versions(mesh: dict[str, Any]) -> None:
    """A function handler's intermediate responses come first in the answer; its
    request headers and TorchServe's explain header reach it; two versions of a
    model, the default one moved, one removed; the list pages."""
    admin, edge = mesh["management"], mesh["edge"]
    curl("-X", "POST", f"{admin}/models?url=echo.mar&initial_workers=1&synchronous=true")
    curl("-sS", f"{edge}/ping")  # skips without curl
    said = subprocess.run(
        [
            "curl",
            "-sS",
            "-H",
            "Content-Type: text/plain",
            "--data-binary",
            "hi",
            f"{edge}/predictions/echo",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert said == "first;second;last:text/plain"
    assert curl("--data-binary", "abcd", f"{edge}/explanations/echo") == {"explanation": 4}

    curl("-X", "POST", f"{admin}/models?url=v2/echo.mar&initial_workers=1&synchronous=true")
    assert [d["modelVersion"] for d in curl(f"{admin}/models/echo/all")] == ["1.0", "2.0"]
    assert curl("--data-binary", "x", f"{edge}/explanations/echo/2.0") == {"explanation": 1}
    status, answer = call("POST", f"{edge}/predictions/echo/3.0", b"x")
    assert status == 404 and "3.0" in answer["message"]
    curl("-X", "PUT", f"{admin}/models/echo/2.0/set-default")
    [default] = curl(f"{admin}/models/echo")
    assert default["modelVersion"] == "2.0" and default["isDefault"]
    status, answer = call("DELETE", f"{admin}/models/echo/2.0")
    assert status == 400 and "default" in answer["message"]
    curl("-X", "DELETE", f"{admin}/models/echo/1.0")
    assert [d["modelVersion"] for d in curl(f"{admin}/models/echo/all")] == ["2.0"]

    everything = [m["modelName"] for m in curl(f"{admin}/models")["models"]]
    paged, token = [], "0"
    while token:
        page = curl(f"{admin}/models?limit=1&next_page_token={token}")
        paged += [m["modelName"] for m in page["models"]]
        token = page.get("nextPageToken", "")
    assert "echo" in everything and paged == everything
    curl("-X", "DELETE", f"{admin}/models/echo")


def test_import_mar_writes_a_model_folder_with_torchserve_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``meshserve import-mar``: config.properties' entry for the model sets its
    batching and workers; a flag wins over it."""
    archive = echo_mar(tmp_path / "build", tmp_path / "store")
    properties = tmp_path / "config.properties"
    entry = {"echo": {"1.0": {"batchSize": 4, "maxBatchDelay": 50, "minWorkers": 2}}}
    properties.write_text(f"default_workers_per_model=3\nmodels={json.dumps(entry)}\n")
    repository = tmp_path / "models"
    command = ["import-mar", str(archive), "--repository", str(repository)]
    command += ["--config-properties", str(properties)]
    with pytest.raises(SystemExit) as done:
        cli([*command, "--max-batch-delay", "7"])
    assert done.value.code == 0, capsys.readouterr().err
    config = (repository / "echo" / "config.pbtxt").read_text()
    assert 'backend: "torchserve"' in config and "max_batch_size: 4" in config
    assert "count: 2 kind: KIND_CPU" in config and "max_queue_delay_microseconds: 7000" in config
    assert (repository / "echo" / "1" / "MAR-INF" / "MANIFEST.json").is_file()
    with pytest.raises(SystemExit) as again:
        cli(command)
    assert again.value.code == 1 and "already registered" in capsys.readouterr().err
