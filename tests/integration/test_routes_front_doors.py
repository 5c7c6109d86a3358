"""A route through every front door: tritonclient, curl through Envoy, the CLI, the OpenAI SDK.

The stage and the orchestrator run in this process (tests/in_process.py); the
HTTP adapter and Envoy are their own processes in front of it, as in the
mesh. tritonclient (gRPC and HTTP) runs in a child process; curl calls
``/api/v1`` through Envoy (inference, and the RouteService transcoded to
JSON); ``meshserve route status`` prints the route; the OpenAI SDK calls the
route by name (the route is between two one-step ensembles of a cheap python
model, so no LLM has to start).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from prometheus_client import generate_latest

from shared.ports import free_port
from tests.harness import ROOT, ServiceProcess, run_client
from tests.in_process import MeshThread
from tests.integration.test_routes import write_repository

VEC_CONFIG = """name: "vec"
backend: "python"
max_batch_size: 8
version_policy: { all {} }
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""

# [version, characters, 1] per text: which version answered shows in the vector.
VEC = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = float(args["model_version"])

    def execute(self, requests):
        responses = []
        for r in requests:
            texts = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)
            rows = [[self.version, len(t), 1.0] for t in texts]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("EMBEDDING", np.array(rows, dtype=np.float32))]))
        return responses
"""

EMBED_ENSEMBLE = """platform: "ensemble"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [ { model_name: "vec" model_version: VERSION
  input_map { key: "TEXT" value: "TEXT" } output_map { key: "EMBEDDING" value: "EMBEDDING" } } ] }
"""

EMBEDDER_ROUTE = """
  embedder:
    targets: [{model: embed_v1, weight: 50}, {model: embed_v2, weight: 50}]
"""


@dataclass
class Doors:
    """The in-process mesh and the processes in front of it."""

    mesh: MeshThread
    adapter: ServiceProcess
    envoy: ServiceProcess

    @property
    def edge(self) -> str:
        return f"http://{self.envoy.address}"


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Doors]:
    root = tmp_path_factory.mktemp("route-doors")
    repo = write_repository(root / "repo")
    for version in ("1", "2"):
        (repo / "vec" / version).mkdir(parents=True)
        (repo / "vec" / version / "model.py").write_text(VEC)
        (repo / f"embed_v{version}" / "1").mkdir(parents=True)
        (repo / f"embed_v{version}" / "config.pbtxt").write_text(
            EMBED_ENSEMBLE.replace("VERSION", version)
        )
    (repo / "vec" / "config.pbtxt").write_text(VEC_CONFIG)
    routes = repo / "routes.yaml"
    routes.write_text(routes.read_text() + EMBEDDER_ROUTE)
    mesh = MeshThread(repo)
    orchestrator = ["--orchestrator", mesh.address]
    quick = ["--grace-period-s", "1"]
    port = free_port()
    commands = [
        ("gateway.http.main", ["--http-port", str(port), *orchestrator, *quick]),
        ("gateway.envoy.main", [*orchestrator, "--http-adapter", f"127.0.0.1:{port}", *quick]),
    ]
    # Both start at once: each is a Python process that takes seconds to import.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServiceProcess, module, args) for module, args in commands]
    processes = [start.result() for start in starts if start.exception() is None]
    try:
        for start in starts:
            start.result()
        yield Doors(mesh, *processes)
    finally:
        for process in processes:
            process.signal(signal.SIGTERM)
        for process in processes:
            process.stop()
        mesh.close()


def curl(*args: str) -> tuple[dict[str, str], Any]:
    """curl's response headers (lower-case names) and JSON body."""
    done = subprocess.run(
        ["curl", "-sS", "-D", "-", "--max-time", "30", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    head, _, body = done.stdout.replace("\r\n", "\n").partition("\n\n")
    headers = {}
    for line in head.splitlines()[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers, json.loads(body)


CLI = [sys.executable, "-m", "deploy.cli"]
X = [1.0, 2.0, 3.0, 4.0]
INFER_BODY = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X}]})


def test_tritonclient_grpc_and_http_through_a_route(doors: Doors) -> None:
    answers = run_client("route_infer.py", doors.mesh.address, doors.adapter.address, "canary")
    for protocol, override in (("grpc", "m:2"), ("http", "m:1")):
        cases = answers[protocol]
        assert cases["metadata"] == "canary"
        factor = int(override[-1])
        assert cases["override"] == {"target": override, "Y": [x * factor for x in X]}
        if protocol == "http":
            assert cases["override_parameter"] == {"target": "m:2", "Y": [x * 2 for x in X]}
        sticky = cases["sticky"]
        assert sticky[0]["target"] in ("m:1", "m:2") and sticky.count(sticky[0]) == 3


def test_curl_through_envoy_infers_and_changes_the_route(doors: Doors) -> None:
    url = doors.edge
    json_type = "Content-Type: application/json"
    headers, body = curl(
        "-H", json_type, "-H", "x-meshserve-route-target: m:2",
        "-d", INFER_BODY, f"{url}/api/v1/models/canary/infer",
    )  # fmt: skip
    assert headers["x-meshserve-route-target"] == "m:2"
    assert body["outputs"][0]["data"] == [2 * x for x in X]
    # KServe v2 REST (the HTTP adapter behind Envoy) takes and answers the same headers.
    headers, body = curl(
        "-H", json_type, "-H", "x-meshserve-route-target: m:2",
        "-d", INFER_BODY, f"{url}/v2/models/canary/infer",
    )  # fmt: skip
    assert headers["x-meshserve-route-target"] == "m:2"
    assert body["parameters"] == {"route_target": "m:2"}

    _, status = curl(f"{url}/api/v1/routes/canary")
    targets = status["status"]["route"]["targets"]
    assert [(t["id"], t["weight"]) for t in targets] == [("m:1", 90), ("m:2", 10)]
    weights = json.dumps({"weights": {"m:1": 0, "m:2": 1}})
    curl("-H", json_type, "-d", weights, f"{url}/api/v1/routes/canary/weights")
    headers, body = curl("-H", json_type, "-d", INFER_BODY, f"{url}/api/v1/models/canary/infer")
    assert headers["x-meshserve-route-target"] == "m:2"

    printed = subprocess.run(
        [*CLI, "route", "status", "canary", "--url", doors.mesh.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    ).stdout
    print(printed)
    rows = {line.split()[0]: line.split() for line in printed.splitlines()[2:4]}
    assert rows["m:1"][1:3] == ["0", "0.0%"] and rows["m:2"][1:3] == ["1", "100.0%"]
    assert int(rows["m:2"][3]) >= 2  # requests in the window
    assert "weights" in printed

    _, rolled = curl("-H", json_type, "-d", "{}", f"{url}/api/v1/routes/canary/rollback")
    targets = rolled["status"]["route"]["targets"]
    assert [(t["id"], t["weight"]) for t in targets] == [("m:1", 1), ("m:2", 0)]

    # What the orchestrator's /metrics serves.
    text = generate_latest(doors.mesh.mesh.orchestrator.parts.registry).decode()
    assert 'meshserve_route_requests_total{outcome="success",route="canary",target="m:2"}' in text
    assert 'meshserve_route_weight{route="canary",target="m:1"} 1.0' in text


def test_openai_sdk_calls_a_route_by_name(doors: Doors) -> None:
    client = openai.OpenAI(base_url=f"{doors.edge}/v1", api_key="unused", max_retries=0)
    assert "embedder" in [model.id for model in client.models.list()]
    versions = set()
    for _ in range(6):
        answer = client.embeddings.create(model="embedder", input=["hello", "hi"])
        vectors = [item.embedding for item in answer.data]
        assert [v[1:] for v in vectors] == [[5.0, 1.0], [2.0, 1.0]]
        assert vectors[0][0] == vectors[1][0]  # one request, one target
        versions.add(vectors[0][0])
    assert versions <= {1.0, 2.0} and versions
