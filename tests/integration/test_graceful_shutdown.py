"""SIGTERM while a slow RPC is in flight: NOT_SERVING at once, the RPC completes,
new RPCs are refused, and the process exits within its grace period."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import decode_outputs, encode_inputs
from tests.harness import ServiceProcess

GRACE_S = 8.0
SLOW_MS = 2500


def slow_request(ms: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow")
    encode_inputs(request, {"MS": np.array([ms], dtype=np.int32)})
    return request


def draining_service(repository: Path) -> ServiceProcess:
    """An inference service on the python test models, with a grace period of GRACE_S."""
    return ServiceProcess(
        "services.inference.main",
        ["--model-repository", str(repository), "--grace-period-s", str(GRACE_S)],
    )


def test_sigterm_drains_in_flight_rpc(python_models_repo: Path) -> None:
    service = draining_service(python_models_repo)
    try:
        channel = grpc.insecure_channel(service.address)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        slow = stub.ModelInfer.future(slow_request(SLOW_MS))
        time.sleep(0.5)  # the slow request is now executing
        sent = time.monotonic()
        service.signal(signal.SIGTERM)

        status = next(watch).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert time.monotonic() - sent < 1.0

        refused: list[grpc.StatusCode] = []

        def try_new() -> None:
            try:
                stub.ModelInfer(slow_request(1), timeout=5)
            except grpc.RpcError as exc:
                refused.append(exc.code())

        probe = threading.Thread(target=try_new)
        probe.start()
        probe.join()
        assert refused == [grpc.StatusCode.UNAVAILABLE]

        outputs = decode_outputs(slow.result(timeout=GRACE_S))
        assert outputs["MS_OUT"].tolist() == [SLOW_MS]
        service.proc.wait(timeout=GRACE_S)
        assert service.proc.returncode == 0
        assert time.monotonic() - sent < GRACE_S
        channel.close()
    finally:
        service.stop()


def test_an_idle_stream_does_not_hold_the_drain(python_models_repo: Path) -> None:
    """A ModelStreamInfer opened with no request yet (the orchestrator keeps such
    spares) is not work in flight: SIGTERM ends it and the process exits at once,
    not after its grace period; the caller sees UNAVAILABLE on it."""
    service = draining_service(python_models_repo)
    try:
        channel = grpc.insecure_channel(service.address)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        never = threading.Event()

        def no_requests() -> Iterator[pb.ModelInferRequest]:
            never.wait()
            yield from ()

        idle = stub.ModelStreamInfer(no_requests())
        time.sleep(0.5)  # the stream is open on the server
        sent = time.monotonic()
        service.signal(signal.SIGTERM)
        service.proc.wait(timeout=GRACE_S)
        assert service.proc.returncode == 0
        assert time.monotonic() - sent < GRACE_S / 2
        with pytest.raises(grpc.RpcError) as ended:
            next(idle)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE  # the caller may retry elsewhere
        never.set()
        channel.close()
    finally:
        service.stop()
