"""Mutual TLS between the services: the mesh answers, a caller without its certificate cannot.

One small mesh under the supervisor (the inference stage with the python
add_sub model, the orchestrator and Envoy), every service given the same
development certificate (``deploy/local/certs.py``) in the mesh YAML's
``defaults``. Requests through Envoy cross every hop over TLS (Envoy ->
orchestrator -> stage, REST to the orchestrator's HTTP front door as by
default, or to the HTTP adapter process with ``http_front_door: process``); a
process on the host that dials the orchestrator, a stage or the HTTP front
door directly is refused in the handshake, whether it brings no certificate or
one another CA signed.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from deploy.local.certs import MeshCertificates, make_certificates, write_ca, write_leaf
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh

MESH = """
defaults:
  host: 127.0.0.1
  grace_period_s: 2
{tls}services:
  orchestrator: {{ wire_port: 0 }}
supervisor:
  stages:
    - {{ name: inference, module: services.inference.main, replicas: 1 }}
  edge: true
  cpu_placement: "off"
"""

ADD_SUB = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
    ]
}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> MeshCertificates:
    return make_certificates(tmp_path_factory.mktemp("mtls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A certificate for the same names, signed by a CA the mesh does not trust."""
    out = tmp_path_factory.mktemp("stranger")
    return write_leaf(out, write_ca(out, 1), [], 1)


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory, certificates: MeshCertificates
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("mtls-mesh")
    repository = build_repository(root / "repo", ["add_sub"], [])
    config = root / "mesh.yaml"
    config.write_text(MESH.format(tls=certificates.yaml()))
    proc, info = start_mesh(repository, config, ["--grace-s", "5"])
    try:
        yield info
    finally:
        stop_mesh(proc)


def _address(info: dict[str, Any], prefix: str) -> str:
    found = [p["grpc"] for name, p in info["processes"].items() if name.startswith(prefix)]
    assert found, f"no {prefix} process in {sorted(info['processes'])}"
    return str(found[0])


def _ready(channel: grpc.Channel) -> bool:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    reply: pb.ServerReadyResponse = stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
    return reply.ready


def _mesh_credentials(certificates: MeshCertificates) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        certificates.ca.read_bytes(), certificates.key.read_bytes(), certificates.cert.read_bytes()
    )


def test_a_request_through_the_edge_crosses_every_hop_over_mutual_tls(
    mesh: dict[str, Any],
) -> None:
    edge = _address(mesh, "envoy")
    request = urllib.request.Request(
        f"http://{edge}/v2/models/add_sub/infer",
        data=json.dumps(ADD_SUB).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=20) as reply:
        outputs = {o["name"]: o["data"] for o in json.load(reply)["outputs"]}
    assert outputs["OUTPUT0"] == [2, 3, 4, 5]
    assert outputs["OUTPUT1"] == [0, 1, 2, 3]
    # Native gRPC through Envoy reaches the orchestrator over TLS too: its gRPC
    # port, and its wire door for ModelInfer.
    with grpc.insecure_channel(edge) as channel:
        assert _ready(channel)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        request = pb.ModelInferRequest(model_name="add_sub")
        for tensor in ADD_SUB["inputs"]:
            request.inputs.add(name=tensor["name"], datatype="FP32", shape=[1, 4])
            request.inputs[-1].contents.fp32_contents.extend(tensor["data"])
        reply, call = stub.ModelInfer.with_call(request, timeout=20)
    first = reply.outputs[0]
    sums = (
        np.frombuffer(reply.raw_output_contents[0], np.float32).tolist()
        if reply.raw_output_contents
        else list(first.contents.fp32_contents)
    )
    assert (first.name, sums) == ("OUTPUT0", [2, 3, 4, 5])
    assert "x-grpc-status" in {m.key for m in call.initial_metadata()}


@pytest.mark.parametrize("target", ["orchestrator", "inference"])
def test_a_caller_without_the_mesh_certificate_is_refused(
    mesh: dict[str, Any],
    certificates: MeshCertificates,
    stranger: tuple[Path, Path],
    target: str,
) -> None:
    address = _address(mesh, target)
    # With the mesh's certificate the service answers: the refusals below are
    # about the caller's certificate, not a service that is down.
    with grpc.secure_channel(address, _mesh_credentials(certificates)) as channel:
        assert _ready(channel)
    no_cert = grpc.ssl_channel_credentials(certificates.ca.read_bytes())
    other_ca = grpc.ssl_channel_credentials(
        certificates.ca.read_bytes(), stranger[1].read_bytes(), stranger[0].read_bytes()
    )
    refused = [grpc.insecure_channel(address)] + [
        grpc.secure_channel(address, credentials) for credentials in (no_cert, other_ca)
    ]
    for channel in refused:
        with channel, pytest.raises(grpc.RpcError) as caught:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            stub.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="add_sub"), timeout=5
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # Nothing got through: the model still serves.
    with grpc.secure_channel(address, _mesh_credentials(certificates)) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        ready = stub.ModelReady(pb.ModelReadyRequest(name="add_sub"), timeout=5)
        assert ready.ready


def test_the_http_front_door_wants_the_mesh_certificate_too(
    mesh: dict[str, Any], certificates: MeshCertificates
) -> None:
    door = mesh["http_front_door"]
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{door}/v2/health/live", timeout=5)
    without = ssl.create_default_context(cafile=str(certificates.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(f"https://{door}/v2/health/live", timeout=5, context=without)
    with_cert = ssl.create_default_context(cafile=str(certificates.ca))
    with_cert.load_cert_chain(str(certificates.cert), str(certificates.key))
    with urllib.request.urlopen(
        f"https://{door}/v2/health/live", timeout=5, context=with_cert
    ) as reply:
        assert reply.status == 200
