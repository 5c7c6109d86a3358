"""The edge: real Envoy in front of the mesh, with curl, tritonclient (gRPC and
HTTP), a Node.js client built from protos/ alone, grpc-web, auth and limits."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from gateway.envoy.credentials import issue_token, write_jwt_keys, write_tls
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from models.sources import sample_image
from shared.tensors import decode_outputs, encode_inputs
from tests import grpcweb
from tests.harness import ROOT, ServiceProcess, run_client
from tests.otlp import OtlpReceiver

pytestmark = pytest.mark.e2e


def curl(url: str, *args: str) -> tuple[int, Any]:
    """Run the real curl; returns (HTTP status, parsed JSON body or text)."""
    done = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *args, url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    body, _, status = done.stdout.rpartition("\n")
    try:
        return int(status), json.loads(body)
    except json.JSONDecodeError:
        return int(status), body


@pytest.fixture(scope="module")
def edge(mesh: dict[str, Any]) -> str:
    return f"http://{mesh['processes']['envoy']['grpc']}"


def test_curl_classify_and_embed_through_transcoding(edge: str, tmp_path: Path) -> None:
    body = tmp_path / "classify.json"
    image = base64.b64encode(sample_image("coffee.png").read_bytes()).decode()
    body.write_text(json.dumps({"image": image}))
    status, answer = curl(
        f"{edge}/api/v1/classify",
        "-H",
        "content-type: application/json",
        "--data-binary",
        f"@{body}",
    )
    assert status == 200, answer
    assert answer["classes"][0]["label"] == "espresso"
    assert answer["classes"][0]["probability"] > 0.9

    status, answer = curl(
        f"{edge}/api/v1/embed",
        "-H",
        "content-type: application/json",
        "-d",
        json.dumps({"texts": ["A man is playing a guitar.", "Someone plays an acoustic guitar."]}),
    )
    assert status == 200, answer
    assert answer["dimensions"] == 384  # a JSON number, not an int64 string
    first, second = (np.array(e["values"]) for e in answer["embeddings"])
    assert float(first @ second) >= 0.5


def test_curl_lists_models_and_runs_json_tensors(edge: str) -> None:
    status, answer = curl(f"{edge}/api/v1/models")
    assert status == 200
    models = {m["name"]: m for m in answer["models"]}
    assert models["image_classifier"]["backend"] == "ensemble"
    assert models["mobilenet_v2_onnx"]["max_batch_size"] == 64
    assert models["mobilenet_v2_onnx"]["state"] == "MODEL_STATE_READY"

    request = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [[0.5] * 16]}]
    }
    status, answer = curl(
        f"{edge}/api/v1/models/mlp/infer",
        "-d",
        json.dumps(request),
        "-H",
        "content-type: application/json",
    )
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert output["name"] == "OUTPUT0" and output["shape"] == [1, 8]
    assert len(output["data"]) == 8


@pytest.mark.parametrize(
    ("path", "args", "status"),
    [
        ("/no/such/path", [], 404),
        ("/api/v1/no-such-call", [], 404),
        ("/api/v1/embed", ["-H", "content-type: application/json", "-d", "{not json"], 400),
        ("/api/v1/models/ghost", [], 404),
    ],
)
def test_http_errors_are_json_with_the_right_status(
    edge: str, path: str, args: list[str], status: int
) -> None:
    got, body = curl(f"{edge}{path}", *args)
    assert got == status, body
    assert isinstance(body, dict) and (body.get("error") or body.get("message")), body


def test_oversized_body_is_413(edge: str, tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"texts": ["x" * (17 * 1024 * 1024)]}))
    status, body = curl(
        f"{edge}/api/v1/embed", "-H", "content-type: application/json", "--data-binary", f"@{big}"
    )
    assert status == 413, body


def test_tritonclient_grpc_and_http_through_envoy(mesh: dict[str, Any], tmp_path: Path) -> None:
    address = mesh["processes"]["envoy"]["grpc"]
    inputs = {"INPUT0": np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **inputs)
    run_client(
        "infer_npz.py", address, "mlp", str(tmp_path / "in.npz"), str(tmp_path / "grpc.npz"), "sync"
    )
    direct = pb.ModelInferRequest(model_name="mlp")
    encode_inputs(direct, inputs)
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        want = decode_outputs(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(direct))
    with np.load(tmp_path / "grpc.npz") as got:
        np.testing.assert_allclose(got["OUTPUT0"], want["OUTPUT0"], rtol=1e-6)
    for binary in (False, True):
        out = tmp_path / f"http-{binary}.npz"
        run_client("http_infer_npz.py", address, "mlp", str(tmp_path / "in.npz"), str(out), binary)
        with np.load(out) as got:
            np.testing.assert_allclose(got["OUTPUT0"], want["OUTPUT0"], rtol=1e-6)


def test_node_client_from_protos_alone(mesh: dict[str, Any]) -> None:
    rows = [[0.25 * i for i in range(16)], [1.0] * 16]
    done = subprocess.run(
        [
            "node",
            str(ROOT / "tests" / "node" / "infer.js"),
            mesh["processes"]["envoy"]["grpc"],
            "mlp",
            "INPUT0",
            "OUTPUT0",
            json.dumps(rows),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    direct = pb.ModelInferRequest(model_name="mlp")
    encode_inputs(direct, {"INPUT0": np.array(rows, dtype=np.float32)})
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        want = decode_outputs(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(direct))
    assert answer["model_name"] == "mlp" and answer["shape"] == [2, 8]
    np.testing.assert_allclose(np.array(answer["values"]).reshape(2, 8), want["OUTPUT0"], rtol=1e-6)


def test_grpc_web_through_envoy(edge: str) -> None:
    reply = grpcweb.call(
        edge,
        "inference.GRPCInferenceService/ServerLive",
        pb.ServerLiveRequest().SerializeToString(),
    )
    assert reply.status == 0, reply.message
    assert pb.ServerLiveResponse.FromString(reply.payload).live


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("creds")
    jwks, pem = write_jwt_keys(out)
    cert, key = write_tls(out, days=1)
    return {"jwks": jwks, "token": issue_token(pem, "tester", days=1), "cert": cert, "key": key}


@pytest.fixture(scope="module")
def secured_edge(mesh: dict[str, Any], credentials: dict[str, Any]) -> Iterator[str]:
    """A second edge with auth and TLS on, in front of the same mesh."""
    process = ServiceProcess(
        "gateway.envoy.main",
        [
            "--orchestrator",
            mesh["orchestrator"],
            "--http-adapter",
            mesh["http_front_door"],
            "--jwks-file",
            str(credentials["jwks"]),
            "--access-log",
            "false",
            "--tls-cert",
            str(credentials["cert"]),
            "--tls-key",
            str(credentials["key"]),
        ],
    )
    yield process.address
    process.stop()


def test_auth_on_http_grpc_and_grpc_web(secured_edge: str, credentials: dict[str, Any]) -> None:
    url = f"https://{secured_edge}"
    tls = ["--cacert", str(credentials["cert"])]
    status, body = curl(f"{url}/api/v1/models", *tls)
    assert status == 401 and "error" in body
    status, _ = curl(f"{url}/api/v1/models", *tls, "-H", "authorization: Bearer not.a.jwt")
    assert status == 401
    status, _ = curl(
        f"{url}/api/v1/models", *tls, "-H", f"authorization: Bearer {credentials['token']}"
    )
    assert status == 200

    root = credentials["cert"].read_bytes()
    channel_credentials = grpc.ssl_channel_credentials(root_certificates=root)
    with grpc.secure_channel(secured_edge, channel_credentials) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = [("authorization", f"Bearer {credentials['token']}")]
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10, metadata=metadata).live


def test_grpc_web_needs_a_token_too(mesh: dict[str, Any], credentials: dict[str, Any]) -> None:
    process = ServiceProcess(
        "gateway.envoy.main",
        [
            "--orchestrator",
            mesh["orchestrator"],
            "--http-adapter",
            mesh["http_front_door"],
            "--jwks-file",
            str(credentials["jwks"]),
            "--access-log",
            "false",
        ],
    )
    try:
        base = f"http://{process.address}"
        method = "inference.GRPCInferenceService/ServerLive"
        request = pb.ServerLiveRequest().SerializeToString()
        assert grpcweb.call(base, method, request).status == 16  # UNAUTHENTICATED
        reply = grpcweb.call(
            base, method, request, {"authorization": f"Bearer {credentials['token']}"}
        )
        assert reply.status == 0
    finally:
        process.stop()


def test_rate_limit_gives_429_and_resource_exhausted(mesh: dict[str, Any]) -> None:
    process = ServiceProcess(
        "gateway.envoy.main",
        [
            "--orchestrator",
            mesh["orchestrator"],
            "--http-adapter",
            mesh["http_front_door"],
            "--rate-limit-rps",
            "3",
            "--access-log",
            "false",
        ],
    )
    try:
        statuses = [curl(f"http://{process.address}/api/v1/health")[0] for _ in range(8)]
        assert 200 in statuses and 429 in statuses, statuses
        with grpc.insecure_channel(process.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            codes = []
            for _ in range(8):
                try:
                    stub.ServerLive(pb.ServerLiveRequest(), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
    finally:
        process.stop()


def test_trace_of_an_http_request_starts_at_envoy(edge: str, otlp: OtlpReceiver) -> None:
    status, _ = curl(
        f"{edge}/api/v1/embed",
        "-H",
        "content-type: application/json",
        "-H",
        "x-test-marker: trace-me",
        "-d",
        json.dumps({"texts": ["hello"]}),
    )
    assert status == 200

    def envoy_roots(spans: list) -> list:  # type: ignore[type-arg]
        return [
            s
            for s in spans
            if s.service == "envoy"
            and not s.parent_id
            # Every exporting process: each sends its spans on its own schedule.
            and {"tokenizer", "inference", "postprocess"}
            <= {o.service for o in spans if o.trace_id == s.trace_id}
            # The orchestrator's server span's name tells this request's trace from
            # the session's other traces that went through Envoy (a chat's, say).
            and any(
                o.trace_id == s.trace_id
                and o.service == "orchestrator"
                and o.kind == 2
                and o.name == "meshserve.v1.MeshService/Embed"
                for o in spans
            )
        ]

    spans = otlp.wait_for(lambda spans: bool(envoy_roots(spans)))
    roots = envoy_roots(spans)
    assert roots, sorted({s.service for s in spans})
    root = roots[-1]
    mine = [s for s in spans if s.trace_id == root.trace_id]
    (orchestrator,) = [s for s in mine if s.service == "orchestrator" and s.kind == 2]
    assert orchestrator.parent_id == root.span_id
    assert {"tokenizer", "inference", "postprocess"} <= {s.service for s in mine}
