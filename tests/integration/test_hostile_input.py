"""What one caller sends never hurts another caller (through Envoy, as clients call).

An error message may echo what the caller sent; unbounded, a 100 KB model
name became a 100 KB gRPC status, Envoy reset the HTTP/2 connection it shares
with other callers' requests, and their requests failed UNAVAILABLE.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.errors import MAX_MESSAGE_CHARS
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh

MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 1 }
  edge: true
  cpu_placement: "off"
"""


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("hostile")
    repository = build_repository(root / "repo", ["add_sub", "slow"], [])
    config = root / "mesh.yaml"
    config.write_text(MESH)
    proc, info = start_mesh(repository, config, ["--grace-s", "5"])
    yield str(info["processes"]["envoy"]["grpc"])
    stop_mesh(proc)


def add_request(model: str = "add_sub") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    ones = np.ones((1, 4), np.float32)
    encode_inputs(request, {"INPUT0": ones, "INPUT1": ones})
    return request


def test_a_huge_model_name_gets_a_bounded_error_and_hurts_no_one(edge: str) -> None:
    channel = grpc.insecure_channel(edge)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]

    def good(_: int) -> Any:
        return decode_outputs(stub.ModelInfer(add_request(), timeout=30))["OUTPUT0"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=9) as pool:
        others = [pool.submit(good, i) for i in range(8)]
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(add_request("a" * 100_000), timeout=30)
        results = [future.result() for future in others]
    channel.close()
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    details = caught.value.details()
    assert details.startswith("Request for unknown model: 'aaaa")
    assert len(details) < MAX_MESSAGE_CHARS + 100
    assert all(result.tolist() == [[2.0] * 4] for result in results)


def test_concurrent_callers_survive_a_stream_of_oversized_names(edge: str) -> None:
    """Many oversized errors in a row over one shared connection: good calls all pass."""
    channel = grpc.insecure_channel(edge)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
    bad = add_request("b" * 200_000)

    def hostile(_: int) -> grpc.StatusCode:
        try:
            stub.ModelInfer(bad, timeout=30)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def good(_: int) -> bool:
        answer = decode_outputs(stub.ModelInfer(add_request(), timeout=30))["OUTPUT1"]
        return bool(answer.tolist() == [[0.0] * 4])

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(hostile, range(20)))
        fine = list(pool.map(good, range(20)))
    channel.close()
    assert set(codes) == {grpc.StatusCode.NOT_FOUND}
    assert all(fine)
