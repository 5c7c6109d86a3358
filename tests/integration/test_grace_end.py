"""Requests still running when a service's grace period ends fail at once, retryably.

A drain lets in-flight requests finish within ``grace_period_s``; one that
runs past it must not hang its caller (nor the stop): the server cuts it, and
the caller gets UNAVAILABLE, which clients and the orchestrator's router retry
elsewhere. In this process: the orchestrator and one inference stage on the
python ``slow`` model, grace 0.5 s, requests of 2 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.tensors import encode_inputs
from tests.conftest import build_repository
from tests.in_process import running

GRACE_S = 0.5
SLOW_MS = 2000
CUT = {grpc.StatusCode.UNAVAILABLE}
"""What a request cut at the end of the grace gets (CANCELLED would not be retried)."""


def _slow() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="slow")
    encode_inputs(request, {"MS": np.array([SLOW_MS], dtype=np.int32)})
    return request


async def _unary(stub: pb_grpc.GRPCInferenceServiceStub) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    try:
        await stub.ModelInfer(_slow(), timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), time.monotonic() - started
    return grpc.StatusCode.OK, time.monotonic() - started


async def _streamed(stub: pb_grpc.GRPCInferenceServiceStub) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield _slow()
        await asyncio.sleep(30)  # keep the stream open, as a client would

    try:
        async for reply in stub.ModelStreamInfer(requests(), timeout=30):
            if reply.error_message:
                return grpc.StatusCode.UNKNOWN, time.monotonic() - started
            return grpc.StatusCode.OK, time.monotonic() - started
    except grpc.aio.AioRpcError as exc:
        return exc.code(), time.monotonic() - started
    return grpc.StatusCode.OK, time.monotonic() - started


async def _stop_with_requests_running(
    server: object, calls: list[asyncio.Task[tuple[grpc.StatusCode, float]]]
) -> tuple[list[tuple[grpc.StatusCode, float]], float]:
    await asyncio.sleep(0.3)  # every call reached the model
    started = time.monotonic()
    stop = asyncio.create_task(server.stop())  # type: ignore[attr-defined]
    results = await asyncio.gather(*calls)
    await asyncio.wait_for(stop, 15)
    return list(results), time.monotonic() - started


def test_requests_running_at_the_end_of_the_grace_get_unavailable_at_once(tmp_path: Path) -> None:
    repository = build_repository(tmp_path / "repo", ["slow"], [])
    config = repository / "slow" / "config.pbtxt"  # one instance: quicker to start and stop
    config.write_text(config.read_text().replace("count: 2", "count: 1"))

    async def scenario() -> None:
        async with running(repository, load=["slow"], grace_s=GRACE_S) as mesh:
            stage = mesh.stages[0]
            async with grpc.aio.insecure_channel(stage.address) as channel:
                direct = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                # The orchestrator stops: its caller is cut, the stage is not.
                through = asyncio.create_task(_unary(mesh.v2))
                beside = asyncio.create_task(_unary(direct))
                (cut, served), _ = await _stop_with_requests_running(
                    mesh.orchestrator, [through, beside]
                )
                assert cut[0] in CUT and cut[1] < GRACE_S + 1.5, cut
                assert served[0] == grpc.StatusCode.OK, served
                # The stage stops: a unary call and a stream on it are cut.
                calls = [
                    asyncio.create_task(_unary(direct)),
                    asyncio.create_task(_streamed(direct)),
                ]
                results, stopped_in = await _stop_with_requests_running(stage, calls)
                for code, took in results:
                    assert code in CUT and took < GRACE_S + 1.5, results
                assert stopped_in < GRACE_S + SLOW_MS / 1000 + 2, stopped_in

    asyncio.run(scenario())
