"""The HTTP front door inside the orchestrator: the REST app over the core, no gRPC hop.

One mesh in the test's process (tests/in_process.py: python-backend stage and
orchestrator, real grpc.aio servers on port 0) with the front door listening on
a real port over its core (gateway/http/in_orchestrator.py), called with
urllib as a client would. A last test runs the local mesh as it starts by
default (``supervisor.http_front_door: orchestrator``): Envoy sends REST to the
orchestrator, no HTTP adapter process runs, and once the orchestrator is killed
the supervisor's restart gives REST back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gateway.http.in_orchestrator import HttpDoor, OrchestratorHttpConfig
from tests.conftest import DATA, build_repository
from tests.e2e.conftest import start_mesh, stop_mesh
from tests.harness import RUNNING, scrape_metrics
from tests.in_process import MeshThread
from tests.integration.test_http_rest import GEN_CONFIG, GEN_MODEL
from tests.otlp import OtlpReceiver, Span

TIMEOUT_S = 0.5
"""The front door's request_timeout_s: the slow model outlasts it on purpose."""


class Door:
    """A front door over the mesh's core, started and drained in the mesh's loop."""

    def __init__(self, thread: MeshThread, registry: CollectorRegistry | None = None) -> None:
        mesh = thread.mesh
        parts = mesh.orchestrator.parts
        if registry is not None:  # a second door beside the first: metrics of its own
            parts = dataclasses.replace(parts, registry=registry)
        config = OrchestratorHttpConfig(
            http_port=0, request_timeout_s=TIMEOUT_S, grace_period_s=2.0
        )
        self.thread = thread
        self.http = HttpDoor(config, mesh.core, parts)
        self.address = thread.run(self.http.start(mesh.orchestrator.address))

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        url = f"http://{self.address}{path}"
        request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, dict(answer.headers), answer.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def drain(self) -> None:
        self.thread.run(self.http.drain())


@pytest.fixture(scope="module")
def thread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshThread]:
    repo = tmp_path_factory.mktemp("front-door-repo")
    for name in ("add_sub", "slow"):
        shutil.copytree(DATA / "models" / name, repo / name)
    (repo / "gen" / "1").mkdir(parents=True)  # a decoupled model: one response per word
    (repo / "gen" / "config.pbtxt").write_text(GEN_CONFIG)
    (repo / "gen" / "1" / "model.py").write_text(GEN_MODEL)
    mesh = MeshThread(repo, grace_s=2)
    yield mesh
    mesh.close()


@pytest.fixture(scope="module")
def door(thread: MeshThread) -> Iterator[Door]:
    opened = Door(thread)
    yield opened
    opened.drain()


def add_sub_body() -> bytes:
    tensor = {"shape": [1, 4], "datatype": "FP32"}
    inputs = [
        {"name": "INPUT0", **tensor, "data": [1, 2, 3, 4]},
        {"name": "INPUT1", **tensor, "data": [10, 10, 10, 10]},
    ]
    return json.dumps({"inputs": inputs}).encode()


def test_rest_infer_json_and_binary_answered_by_the_core(door: Door, thread: MeshThread) -> None:
    status, _, body = door.call("POST", "/v2/models/add_sub/infer", add_sub_body())
    assert status == 200, body
    outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
    assert outputs == {"OUTPUT0": [11, 12, 13, 14], "OUTPUT1": [-9, -8, -7, -6]}
    # The binary extension: the output's bytes after the JSON header.
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
                {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [2, 2, 2, 2]},
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    status, headers, body = door.call("POST", "/v2/models/add_sub/infer", header)
    assert status == 200, body
    length = int(headers["Inference-Header-Content-Length"])
    assert struct.unpack("<4f", body[length:]) == (3.0, 3.0, 3.0, 3.0)
    # The front door's metrics are the orchestrator's, on its registry.
    registry = thread.mesh.orchestrator.parts.registry
    labels = {"method": "POST", "route": "/v2/models/{name}/infer", "status": "200"}
    assert registry.get_sample_value("meshserve_http_requests_total", labels) == 2


def test_model_information_readiness_and_the_loopback_calls(door: Door) -> None:
    status, _, body = door.call("GET", "/v2/models/add_sub")
    assert status == 200 and json.loads(body)["inputs"][0]["name"] == "INPUT0"
    assert door.call("GET", "/v2/models/add_sub/ready")[0] == 200
    assert door.call("GET", "/v2/health/ready")[0] == 200
    status, _, body = door.call("GET", "/v2/models/add_sub/config")
    assert status == 200 and json.loads(body)["max_batch_size"] == 8
    status, _, body = door.call("POST", "/v2/repository/index", b"{}")
    assert {row["name"] for row in json.loads(body)} == {"add_sub", "slow", "gen"}
    # Server metadata, log settings and the OpenAI routes' meshserve.v1 calls are the
    # servicers': over gRPC to this process's own port.
    status, _, body = door.call("GET", "/v2")
    assert status == 200 and json.loads(body)["name"] == "meshserve"
    status, _, body = door.call("GET", "/v2/logging")
    assert status == 200 and "log_verbose_level" in json.loads(body)
    status, _, body = door.call("GET", "/v1/models")  # the pipelines: none here
    assert status == 200 and json.loads(body) == {"object": "list", "data": []}
    embed = json.dumps({"model": "nonexistent", "input": "hi"}).encode()
    status, _, body = door.call("POST", "/v1/embeddings", embed)
    assert status == 404 and "nonexistent" in json.loads(body)["error"]["message"]


def test_a_decoupled_model_streams_through_the_core(door: Door) -> None:
    body = json.dumps({"text_input": "one two three", "parameters": {"max_tokens": 2}})
    status, headers, answer = door.call("POST", "/v2/models/gen/generate_stream", body.encode())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), answer
    events = [
        json.loads(line.removeprefix("data: "))
        for line in answer.decode().splitlines()
        if line.startswith("data: ")
    ]
    assert [event["text_output"] for event in events] == [" one", " two", ""]
    assert events[-1]["finish_reason"] == "length"


def test_errors_keep_their_statuses_and_messages(door: Door) -> None:
    status, _, body = door.call("POST", "/v2/models/nonexistent/infer", add_sub_body())
    assert status == 404 and "nonexistent" in json.loads(body)["error"]
    wrong = add_sub_body().replace(b"[1, 4]", b"[1, 5]", 1)
    status, _, body = door.call("POST", "/v2/models/add_sub/infer", wrong)
    assert status == 400 and "INPUT0" in json.loads(body)["error"]
    slow = {"name": "MS", "shape": [1], "datatype": "INT32", "data": [int(TIMEOUT_S * 3000)]}
    payload = json.dumps({"inputs": [slow]}).encode()
    status, _, body = door.call("POST", "/v2/models/slow/infer", payload)
    assert status == 504 and "request_timeout_s" in json.loads(body)["error"], body


def test_drain_lets_the_request_in_flight_finish_and_refuses_new_ones(thread: MeshThread) -> None:
    door = Door(thread, CollectorRegistry())
    slow = {"name": "MS", "shape": [1], "datatype": "INT32", "data": [400]}
    payload = json.dumps({"inputs": [slow]}).encode()
    answers: list[int] = []
    caller = threading.Thread(
        target=lambda: answers.append(door.call("POST", "/v2/models/slow/infer", payload)[0])
    )
    caller.start()
    while not door.http.core.router.endpoints[0].in_flight:
        threading.Event().wait(0.01)
    drained = threading.Thread(target=door.drain)
    drained.start()
    threading.Event().wait(0.1)
    assert door.http.door is not None and door.http.door.state.draining
    caller.join(10)
    drained.join(10)
    assert answers == [200]
    with pytest.raises(urllib.error.URLError):
        door.call("GET", "/v2/health/ready")


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def check_trace(receiver: OtlpReceiver) -> None:
    """The HTTP server span is the orchestrator's; its stage call and the stage's span
    hang below it, in the caller's trace."""

    def complete(spans: list[Span]) -> bool:
        kinds = {(s.service, s.kind) for s in spans if s.trace_id == TRACE_ID}
        return {("orchestrator", 2), ("orchestrator", 3), ("inference", 2)} <= kinds

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == TRACE_ID]
    (server,) = [s for s in spans if s.service == "orchestrator" and s.kind == 2]  # SERVER
    assert server.name == "POST /v2/models/{name}/infer"
    assert server.attributes["meshserve.model"] == "add_sub"
    (client,) = [s for s in spans if s.service == "orchestrator" and s.kind == 3]  # CLIENT
    assert client.parent_id == server.span_id
    (stage,) = [s for s in spans if s.service == "inference" and s.kind == 2]
    assert stage.parent_id == client.span_id


def rest_comes_back(url: str, within_s: float) -> list[float]:
    """POST add_sub's body until it is answered 200 (refusals and 503s while the
    orchestrator restarts); its OUTPUT0."""
    deadline = time.monotonic() + within_s
    while True:
        request = urllib.request.Request(url, data=add_sub_body(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
                return list(outputs["OUTPUT0"])
        except (urllib.error.URLError, ConnectionError) as exc:
            assert time.monotonic() < deadline, f"REST did not come back: {exc}"
            time.sleep(0.2)


MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3, otlp_endpoint: "%s" }
services:
  http_adapter: { max_body_bytes: 4096 }
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: true
  orchestrator_standby: true
  trace_store: false
  jobs: { enabled: false }
"""


def test_the_local_mesh_serves_rest_from_the_orchestrator(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    repo = build_repository(tmp_path / "repo", ["add_sub"], [])
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH % receiver.endpoint)
    proc, info = start_mesh(repo, config, ["--grace-s", "5"])
    _, log = RUNNING[proc.pid]
    try:
        assert set(info["processes"]) == {"orchestrator", "inference-0", "envoy"}
        orchestrator = info["orchestrator"].rsplit(":", 1)[0]
        assert info["http_front_door"].startswith(f"{orchestrator}:")
        edge = info["processes"]["envoy"]["grpc"]
        request = urllib.request.Request(
            f"http://{edge}/v2/models/add_sub/infer",
            data=add_sub_body(),
            headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
        assert outputs["OUTPUT0"] == [11, 12, 13, 14]
        check_trace(receiver)
        # The adapter's settings in the mesh YAML hold for the orchestrator's front door.
        big = np.zeros(2048, np.float32).tolist()
        large = json.dumps({"inputs": [{"name": "X", "shape": [2048], "data": big}]}).encode()
        request = urllib.request.Request(
            f"http://{edge}/v2/models/add_sub/infer", data=large, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 413
        samples = scrape_metrics(info["orchestrator_metrics_port"])
        assert any(
            name == "meshserve_http_requests_total" and ("status", "200") in labels
            for name, labels in samples
        )
        # The front door lives and dies with the orchestrator; its restart brings REST back.
        os.kill(info["processes"]["orchestrator"]["pid"], signal.SIGKILL)
        assert rest_comes_back(f"http://{edge}/v2/models/add_sub/infer", 30) == [11, 12, 13, 14]
    finally:
        stop_mesh(proc)
    assert proc.returncode == 0
    # The restart was the orchestrator's standby taking over, not a fresh interpreter.
    assert "orchestrator: the standby" in log.read_text()
