"""The reliability harness, short: fuzz the front doors, kill a replica, stall a stage.

One small mesh under the supervisor (python test models; the inference stage
with two replicas, a postprocess stage beside it, Envoy at the edge):

- a seeded fuzzer (``loadtests/fuzzer.py``) sends protobuf and JSON with random
  names, shapes, datatypes, contents and field types to Envoy and the
  orchestrator: no answer is 5xx, INTERNAL or UNKNOWN, and no process restarts;
- SIGKILL of one inference replica under 16 requests in flight fails none;
- a stalled (SIGSTOPped) stage makes its requests time out, not hang, while a
  model on another stage keeps serving; after SIGCONT the stage serves again.

The long versions (10,000 cases, every stage, 1 and 2 replicas, drain, soak)
are ``loadtests/reliability.py``.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from loadtests import faults, fuzzer
from shared.tensors import decode_outputs, encode_inputs
from tests.conftest import build_repository
from tests.e2e.conftest import start_mesh, stop_mesh

SEED = 24
GRPC_CASES = 1500
HTTP_CASES = 500

MESH = """
defaults: { host: 127.0.0.1, grace_period_s: 3 }
services: {}
supervisor:
  stages:
    - { name: inference, module: services.inference.main, replicas: 2 }
    - { name: postprocess, module: services.postprocess.main, replicas: 1 }
  edge: true
  cpu_placement: "off"
  restart_backoff_s: [0.2, 1.0]
"""

MEAN_POOL = """
backend: "embedding_pool"
max_batch_size: 8
input [ { name: "TOKEN_EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1, 8 ] },
        { name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 8 ] } ]
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("reliability")
    repository = build_repository(root / "repo", ["add_sub", "slow"], [])
    (repository / "mean_pool" / "1").mkdir(parents=True)
    (repository / "mean_pool" / "config.pbtxt").write_text(MEAN_POOL)
    config = root / "mesh.yaml"
    config.write_text(MESH)
    proc, info = start_mesh(repository, config, ["--grace-s", "5"])
    info["supervisor_pid"] = proc.pid
    info["table"] = faults.ProcessTable.from_ready(info)
    try:
        yield info
    finally:
        for pid in faults.stage_pids(proc.pid, "services."):
            subprocess.run(["kill", "-CONT", str(pid)], check=False)
        stop_mesh(proc)


@pytest.fixture(scope="module")
def stub(mesh: dict[str, Any]) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(mesh["orchestrator"]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def add_sub() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(
        request,
        {"INPUT0": np.full((1, 4), 3, np.float32), "INPUT1": np.ones((1, 4), np.float32)},
    )
    return request


def slow(ms: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow")
    encode_inputs(request, {"MS": np.array([ms], np.int32)})
    return request


def mean_pool() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mean_pool")
    encode_inputs(
        request,
        {
            "TOKEN_EMBEDDINGS": np.ones((1, 3, 8), np.float32),
            "ATTENTION_MASK": np.ones((1, 3), np.int64),
        },
    )
    return request


def test_fuzzed_requests_get_no_server_error_and_restart_nothing(mesh: dict[str, Any]) -> None:
    addresses = {"edge": mesh["processes"]["envoy"]["grpc"], "orchestrator": mesh["orchestrator"]}
    cases = [
        *fuzzer.grpc_cases(SEED, GRPC_CASES, ["edge", "orchestrator"]),
        *fuzzer.http_cases(SEED, HTTP_CASES),
    ]
    result = fuzzer.run_fuzz(cases, addresses)
    assert result.cases == GRPC_CASES + HTTP_CASES
    report = [
        f"{case.kind}: {what}\n  {fuzzer.reproduction(case)}" for case, what in result.findings
    ]
    assert not report, "\n".join(report[:10])
    assert mesh["table"].restarted() == []
    assert result.outcomes["OK"] > 0  # some cases were valid enough to be served


def test_sigkill_of_one_replica_under_16_in_flight_fails_no_request(
    mesh: dict[str, Any], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    requests = [slow(100), add_sub()]
    turn = iter(range(10**9))

    def call() -> None:
        stub.ModelInfer(requests[next(turn) % 2], timeout=30)

    victim = mesh["table"].pid("inference-1")
    plan = faults.FaultPlan("kill inference-1", call, victim, signal.SIGKILL, duration_s=3.0)
    result = faults.load_with_fault(plan)
    print(f"{plan.name}: {result.requests} requests, failures {result.failures()}")
    assert result.failures() == {}
    assert result.requests > 16
    # The supervisor brings the replica back; the other processes never went away.
    faults.wait_until(
        lambda: len(faults.stage_pids(mesh["supervisor_pid"], "services.inference.main")) == 2,
        timeout_s=15,
    )
    assert mesh["table"].restarted() == ["inference-1"]


def test_a_stalled_stage_times_out_while_another_stage_serves(
    mesh: dict[str, Any], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    stalled = faults.stage_pids(mesh["supervisor_pid"], "services.inference.main")
    assert len(stalled) == 2
    with faults.stopped(stalled):
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(add_sub(), timeout=2)
            assert caught.value.code() in {
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            }
            outputs = decode_outputs(stub.ModelInfer(mean_pool(), timeout=10))
            assert np.allclose(outputs["EMBEDDING"], 8**-0.5)  # mean pooled, L2-normalized

    def serves() -> bool:
        try:
            outputs = decode_outputs(stub.ModelInfer(add_sub(), timeout=2))
        except grpc.RpcError:
            return False
        return bool(outputs["OUTPUT0"].tolist() == [[4.0] * 4])

    faults.wait_until(serves, timeout_s=10)
    assert faults.stage_pids(mesh["supervisor_pid"], "services.inference.main") == stalled
