"""A server built from shared/: tritonclient basics, health, reflection, metrics, errors."""

from __future__ import annotations

import os
import select
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deploy.local.procfs import tasks
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import ServiceProcess, run_client


@pytest.fixture(scope="module")
def bare_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    empty = tmp_path_factory.mktemp("empty-repo")
    service = ServiceProcess(
        "services.inference.main", ["--model-repository", str(empty), "--metrics-port", "0"]
    )
    yield service
    service.stop()


def test_tritonclient_server_live_ready_metadata(bare_service: ServiceProcess) -> None:
    answer = run_client("server_basics.py", bare_service.address)
    assert answer["live"] is True
    assert answer["ready"] is True
    assert answer["name"] == "meshserve"
    assert answer["version"]
    assert "model_repository" in answer["extensions"]


def test_health_and_reflection(bare_service: ServiceProcess) -> None:
    with grpc.insecure_channel(bare_service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(reflect.ServerReflectionInfo(iter([request])))
        names = {s.name for s in answer.list_services_response.service}
        assert "inference.GRPCInferenceService" in names
        assert "grpc.health.v1.Health" in names


def test_metrics_endpoint_serves_prometheus_text(bare_service: ServiceProcess) -> None:
    port = bare_service.info["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        body = reply.read().decode()
    assert "# TYPE nv_inference_request_success counter" in body


def test_unknown_model_is_not_found(bare_service: ServiceProcess) -> None:
    with grpc.insecure_channel(bare_service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(pb.ModelInferRequest(model_name="ghost"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "ghost" in caught.value.details()


def test_cuda_shared_memory_is_unimplemented_with_a_message(bare_service: ServiceProcess) -> None:
    with grpc.insecure_channel(bare_service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "CUDA shared memory is not supported" in caught.value.details()


def test_unexpected_error_is_internal_without_details(python_service: ServiceProcess) -> None:
    request = pb.ModelInferRequest(model_name="crash")
    encode_inputs(request, {"X": np.array([1.0], dtype=np.float32)})
    with grpc.insecure_channel(python_service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in caught.value.details()
        assert "Traceback" not in caught.value.details()
        # The traceback is in the server's log, and the server still serves.
        assert "secret internal detail" in python_service.logs()
        assert stub.ServerLive(pb.ServerLiveRequest()).live


def test_wrong_byte_length_is_invalid_argument_naming_the_tensor(
    python_service: ServiceProcess,
) -> None:
    request = pb.ModelInferRequest(model_name="add_sub")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.inputs.add(name="INPUT1", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.extend([b"\x00" * 16, b"\x00" * 15])
    with grpc.insecure_channel(python_service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'INPUT1'" in caught.value.details()
        assert "15 bytes" in caught.value.details()
        good = pb.ModelInferRequest(model_name="add_sub")
        encode_inputs(
            good, {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)}
        )
        outputs = decode_outputs(stub.ModelInfer(good))
        assert outputs["OUTPUT0"].tolist() == [[2.0] * 4]


def test_inputs_that_disagree_on_their_batch_size_are_invalid_argument(
    python_service: ServiceProcess,
) -> None:
    request = pb.ModelInferRequest(model_name="add_sub")
    encode_inputs(
        request, {"INPUT0": np.ones((2, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)}
    )
    with grpc.insecure_channel(python_service.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)  # numpy would broadcast it, and a batch be split wrong
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'INPUT1' has batch size 1, but input 'INPUT0' has 2" in caught.value.details()


def test_python_models_dir_is_used(python_models_repo: Path) -> None:
    assert (python_models_repo / "add_sub" / "1" / "model.py").is_file()


def _pings_until_goaway(address: str, pings: int, gap_s: float) -> bytes | None:
    """Open an HTTP/2 connection with no call on it and send ``pings`` PING frames
    ``gap_s`` apart, as a gRPC client's BDP probes and keepalives go; the debug
    data of the server's GOAWAY, None when it sent none."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, b""))
        received = b""
        start = time.monotonic()
        sent = 0
        while (now := time.monotonic()) < start + (pings - 1) * gap_s + 0.5:
            if sent < pings and now >= start + sent * gap_s:
                conn.sendall(_frame(6, 0, sent.to_bytes(8, "big")))
                sent += 1
            ready, _, _ = select.select([conn], [], [], 0.01)
            if ready:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                received += chunk
            received, frames = _split_frames(received)
            for kind, flags, payload in frames:
                if kind == 4 and not flags & 1:
                    conn.sendall(_frame(4, 1, b""))  # acknowledge the server's settings
                if kind == 7:
                    return payload[8:]
    return None


def _frame(kind: int, flags: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


def _split_frames(data: bytes) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    frames = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
        size = int.from_bytes(data[:3], "big")
        frames.append((data[3], data[4], data[9 : 9 + size]))
        data = data[9 + size :]
    return data, frames


def test_a_connection_pinged_as_grpc_clients_ping_is_kept(bare_service: ServiceProcess) -> None:
    # gRPC's server defaults allow one ping per two hours on a connection with no
    # call: the fourth of these would be answered GOAWAY "too_many_pings".
    assert _pings_until_goaway(bare_service.address, pings=4, gap_s=0.75) is None


def test_a_ping_flood_is_still_refused(bare_service: ServiceProcess) -> None:
    assert _pings_until_goaway(bare_service.address, pings=8, gap_s=0.01) == b"too_many_pings"


def test_the_stage_runs_on_uvloop_under_the_kernel_s_policy_and_as_asked_otherwise(
    bare_service: ServiceProcess, tmp_path: Path
) -> None:
    assert "event loop: uvloop, cpu policy: normal" in bare_service.logs()
    threads = [int(task.name) for task in tasks(bare_service.proc.pid)]
    assert {os.sched_getscheduler(thread) for thread in threads} == {os.SCHED_OTHER}
    own_loop = ServiceProcess(
        "services.inference.main",
        ["--model-repository", str(tmp_path)],
        env={"MESHSERVE_EVENT_LOOP": "asyncio", "MESHSERVE_CPU_POLICY": "batch"},
    )
    try:
        assert "event loop: asyncio, cpu policy: batch" in own_loop.logs()
        threads = [int(task.name) for task in tasks(own_loop.proc.pid)]
        assert {os.sched_getscheduler(thread) for thread in threads} == {os.SCHED_BATCH}
        with grpc.insecure_channel(own_loop.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(pb.ModelInferRequest(model_name="ghost"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        assert own_loop.stop() == 0
