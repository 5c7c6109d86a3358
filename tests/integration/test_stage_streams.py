"""The orchestrator's streams to a stage: opened ahead, relayed to their end.

A real grpc.aio stage on 127.0.0.1 with the mesh's server interceptor stands in
for a decoupled model's stage; the orchestrator's router and relay talk to it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from services.orchestrator.endpoint import REFILL_DELAY_S, StageAddress
from services.orchestrator.router import StageRouter
from services.orchestrator.streaming import relay
from shared.interceptors import DrainGate, ErrorInterceptor
from shared.trace_interceptors import TracingInterceptor


class CountingStage(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """A decoupled model 'gen' that answers each request with two responses and no
    final flag (a Triton stage does so unless asked for an empty final response);
    records when each stream opened and when its first request came."""

    def __init__(self) -> None:
        self.streams: list[tuple[float, float | None]] = []

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(name="gen", state="READY")]
        )

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        index = len(self.streams)
        self.streams.append((time.monotonic(), None))
        async for request in requests:
            if self.streams[index][1] is None:
                self.streams[index] = (self.streams[index][0], time.monotonic())
            for part in ("a", "b"):
                yield pb.ModelStreamInferResponse(
                    infer_response=pb.ModelInferResponse(model_name="gen", id=request.id + part)
                )


async def _with_stage(scenario: Any) -> None:
    stage = CountingStage()
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), TracingInterceptor(trace.NoOpTracer()), DrainGate()]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(stage, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    router = StageRouter(
        [StageAddress("stage", f"127.0.0.1:{port}")],
        channels_per_endpoint=1,
        max_message_bytes=1 << 20,
        tracer=trace.NoOpTracer(),
        refresh_interval_s=60,
        spare_streams=2,
    )
    await router.start()
    try:
        await scenario(stage, router)
    finally:
        await router.stop()
        await server.stop(None)


async def _ids(router: StageRouter, request_id: str) -> list[str]:
    request = pb.ModelInferRequest(model_name="gen", id=request_id)
    return [response.id async for response in relay(router, request)]


def test_a_relay_ends_with_the_stages_stream_even_without_a_final_flag() -> None:
    async def scenario(stage: CountingStage, router: StageRouter) -> None:
        assert await asyncio.wait_for(_ids(router, "r"), 10) == ["ra", "rb"]

    asyncio.run(_with_stage(scenario))


def test_after_the_first_stream_requests_go_out_on_streams_opened_ahead() -> None:
    async def scenario(stage: CountingStage, router: StageRouter) -> None:
        assert await _ids(router, "first") == ["firsta", "firstb"]
        await asyncio.sleep(REFILL_DELAY_S + 0.3)  # the replica's spares are opened
        asked = time.monotonic()
        assert await _ids(router, "second") == ["seconda", "secondb"]
        used = [(opened, first) for opened, first in stage.streams if first is not None]
        assert len(used) == 2 and len(stage.streams) >= 3  # two used, spares waiting
        opened, first = used[1]
        assert opened < asked <= first  # set up before the request existed
        (endpoint,) = router.endpoints
        assert endpoint.in_flight == 0

    asyncio.run(_with_stage(scenario))
