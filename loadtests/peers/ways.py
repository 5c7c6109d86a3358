"""Every way the peer benchmark sends the same one-row request, by server.

    mesh        stage direct (gRPC to the inference stage, without and with batching),
                orchestrator (gRPC), Envoy gRPC, Envoy v2 REST JSON, Envoy v2 REST
                binary, Envoy meshserve.v1 JSON
    kserve      v2 gRPC, v2 REST JSON, v2 REST binary
    torchserve  REST ``/predictions/<model>`` with ``{"data": [...]}`` (batching 8 / 5 ms)
    fastapi     ``/predict`` with ``{"data": [...]}``

Bodies are built once; gRPC goes out as prepared bytes (``common.GrpcTarget``), HTTP as
a prepared POST (``common.HttpTarget``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from common import INFER_METHOD, GrpcTarget, HttpTarget, Target
from peers.model import BATCHED, MODEL, sample_row
from peers.servers import Running

from inference import grpc_service_pb2 as pb
from shared.tensors import encode_inputs

GRPC_CONNECTIONS = 4
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class Way:
    """One server's one protocol: a label and how to aim load at the running server."""

    server: str
    label: str
    target: Callable[[Running, int], Target]
    """(running server, in-flight) -> a fresh target."""
    perf_analyzer: Callable[[Running], tuple[str, str]] | None = None
    """(running server) -> (address, protocol) for Triton's perf_analyzer, where it
    speaks this way (its HTTP client sends and asks for binary tensors)."""


def grpc_payload(model: str) -> bytes:
    """The serialised ModelInferRequest of one row."""
    request = pb.ModelInferRequest(model_name=model)
    encode_inputs(request, {"INPUT0": sample_row()})
    payload: bytes = request.SerializeToString()
    return payload


def _tensor(row: np.ndarray) -> dict[str, object]:
    return {"name": "INPUT0", "datatype": "FP32", "shape": list(row.shape), "data": row.tolist()}


def rest_json() -> bytes:
    """The KServe v2 REST JSON body."""
    return json.dumps({"inputs": [_tensor(sample_row())]}).encode()


def rest_binary() -> tuple[bytes, dict[str, str]]:
    """The v2 REST body with the input and the output as binary data, and its headers."""
    row = sample_row()
    header = {
        "inputs": [
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": list(row.shape),
                "parameters": {"binary_data_size": row.nbytes},
            }
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
    text = json.dumps(header).encode()
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(text))}
    return text + row.tobytes(), headers


def plain_json() -> bytes:
    """``{"data": [...]}``: TorchServe's and the FastAPI baseline's body."""
    return json.dumps({"data": sample_row()[0].tolist()}).encode()


_JSON = {"content-type": "application/json"}


def _grpc(address: Callable[[Running], str], model: str) -> Callable[[Running, int], Target]:
    payload = grpc_payload(model)
    return lambda run, n: GrpcTarget(address(run), INFER_METHOD, payload, min(n, GRPC_CONNECTIONS))


def _post(path: str, body: bytes, headers: dict[str, str]) -> Callable[[Running, int], Target]:
    return lambda run, n: HttpTarget(f"http://{run.http}{path}", body, n, headers)


def all_ways() -> list[Way]:
    """Every way, grouped by server in the order the servers start."""
    binary, binary_headers = rest_binary()
    infer = f"/v2/models/{MODEL}/infer"
    return [
        Way(
            "mesh",
            "stage direct",
            _grpc(lambda r: r.extra["stage"], MODEL),
            lambda r: (r.extra["stage"], "grpc"),
        ),
        Way("mesh", "stage direct b8", _grpc(lambda r: r.extra["stage"], BATCHED)),
        Way(
            "mesh", "orchestrator gRPC", _grpc(lambda r: r.grpc, MODEL), lambda r: (r.grpc, "grpc")
        ),
        Way("mesh", "Envoy gRPC", _grpc(lambda r: r.http, MODEL), lambda r: (r.http, "grpc")),
        Way("mesh", "Envoy REST JSON", _post(infer, rest_json(), _JSON)),
        Way(
            "mesh",
            "Envoy REST binary",
            _post(infer, binary, binary_headers),
            lambda r: (r.http, "http"),
        ),
        Way(
            "mesh",
            "Envoy meshserve.v1 JSON",
            _post(f"/api/v1/models/{MODEL}/infer", rest_json(), _JSON),
        ),
        # perf_analyzer cannot load KServe: its servers answer no ModelConfig.
        Way("kserve", "KServe gRPC", _grpc(lambda r: r.grpc, MODEL)),
        Way("kserve", "KServe REST JSON", _post(infer, rest_json(), _JSON)),
        Way("kserve", "KServe REST binary", _post(infer, binary, binary_headers)),
        Way(
            "torchserve", "TorchServe REST b8", _post(f"/predictions/{MODEL}", plain_json(), _JSON)
        ),
        Way("fastapi", "FastAPI JSON", _post("/predict", plain_json(), _JSON)),
    ]
