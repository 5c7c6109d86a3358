"""The server interceptors, each on a real grpc.aio server in this process.

Errors: a MeshError reaches the caller as its status and message; any other
exception as INTERNAL with a generic message, its traceback in the log.
Drain gate: once closed, new RPCs are refused while in-flight ones finish and
health still answers; a stream opened ahead counts only from its first request.
Tracing: one server span per RPC in the caller's trace, failures recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.config import ServiceConfig
from shared.errors import GENERIC_INTERNAL_MESSAGE, NotFound
from shared.interceptors import DrainGate, ErrorInterceptor
from shared.server import MeshServer, ServiceParts
from shared.trace_interceptors import TracingInterceptor
from shared.tracing import inject_metadata


class Stage(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """ModelInfer fails as its model name says, or waits for ``release`` ("slow")."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        if request.model_name == "missing":
            raise NotFound("unknown model 'missing'")
        if request.model_name == "buggy":
            raise ZeroDivisionError("a secret the caller must not see")
        if request.model_name == "slow":
            self.started.set()
            await self.release.wait()
        return pb.ModelInferResponse(model_name=request.model_name)

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            if request.model_name == "missing":
                raise NotFound("unknown model 'missing'")
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))


Scenario = Callable[[pb_grpc.GRPCInferenceServiceStub, grpc.aio.Channel, Stage], Awaitable[None]]


def _run(interceptors: list[Any], scenario: Scenario) -> None:
    """Serve a Stage and grpc health behind ``interceptors``; run ``scenario`` against it."""

    async def main() -> None:
        stage = Stage()
        server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(stage, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(pb_grpc.GRPCInferenceServiceStub(channel), channel, stage)
        finally:
            stage.release.set()
            await server.stop(None)

    asyncio.run(main())


async def _status(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_mesh_error_reaches_the_caller_as_its_status_and_message() -> None:
    async def scenario(stub: Any, _: Any, __: Stage) -> None:
        unary = await _status(stub.ModelInfer(pb.ModelInferRequest(model_name="missing")))
        stream = stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="missing")]))
        streamed = await _status(stream.read())
        assert unary == streamed == (grpc.StatusCode.NOT_FOUND, "unknown model 'missing'")

    _run([ErrorInterceptor()], scenario)


def test_any_other_error_is_internal_generic_with_its_traceback_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario(stub: Any, _: Any, __: Stage) -> None:
        answer = await _status(stub.ModelInfer(pb.ModelInferRequest(model_name="buggy")))
        assert answer == (grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE)
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live  # the server carries on

    with caplog.at_level(logging.ERROR, logger="shared.interceptors"):
        _run([ErrorInterceptor()], scenario)
    (record,) = caplog.records
    assert "ModelInfer" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError


def test_a_closed_gate_refuses_new_rpcs_lets_in_flight_ones_finish_and_passes_health() -> None:
    gate = DrainGate()

    async def scenario(stub: Any, channel: grpc.aio.Channel, stage: Stage) -> None:
        slow = asyncio.ensure_future(stub.ModelInfer(pb.ModelInferRequest(model_name="slow")))
        await stage.started.wait()
        assert gate.in_flight == 1
        gate.close()
        idle = asyncio.ensure_future(gate.idle())

        refused = await _status(stub.ServerLive(pb.ServerLiveRequest()))
        assert refused[0] == grpc.StatusCode.UNAVAILABLE
        probe = health_pb2_grpc.HealthStub(channel)
        checked = await probe.Check(health_pb2.HealthCheckRequest(service=""))
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.05)
        assert not idle.done()  # the slow call still holds the drain

        stage.release.set()
        assert (await slow).model_name == "slow"
        await asyncio.wait_for(idle, 1)
        assert gate.in_flight == 0

    _run([ErrorInterceptor(), gate], scenario)


def test_a_stream_counts_in_flight_from_its_first_request() -> None:
    gate = DrainGate()

    async def scenario(stub: Any, _: Any, __: Stage) -> None:
        outgoing: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            while (request := await outgoing.get()) is not None:
                yield request

        call = stub.ModelStreamInfer(requests())
        await asyncio.sleep(0.1)  # open on the server, no request yet
        assert gate.in_flight == 0
        outgoing.put_nowait(pb.ModelInferRequest(id="a"))
        assert (await call.read()).infer_response.id == "a"
        assert gate.in_flight == 1
        outgoing.put_nowait(None)
        assert await call.read() is grpc.aio.EOF
        await asyncio.wait_for(gate.idle(), 1)

    _run([ErrorInterceptor(), gate], scenario)


def test_each_rpc_gets_a_server_span_in_the_callers_trace_with_its_failure() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    trace_ids: list[int] = []

    async def scenario(stub: Any, _: Any, __: Stage) -> None:
        with tracer.start_as_current_span("caller") as caller:
            trace_ids.append(caller.get_span_context().trace_id)
            metadata = inject_metadata(None)
            await stub.ServerLive(pb.ServerLiveRequest(), metadata=metadata)
            request = pb.ModelInferRequest(model_name="missing")
            await _status(stub.ModelInfer(request, metadata=metadata))

    _run([ErrorInterceptor(), TracingInterceptor(tracer)], scenario)
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "caller"}
    assert set(spans) == {
        "inference.GRPCInferenceService/ServerLive",
        "inference.GRPCInferenceService/ModelInfer",
    }
    assert {s.context.trace_id for s in spans.values()} == set(trace_ids)
    failed = spans["inference.GRPCInferenceService/ModelInfer"]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.status.description == "unknown model 'missing'"
    assert failed.attributes is not None
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_stop_waits_for_the_rpc_in_flight_not_for_the_grace_period() -> None:
    """MeshServer.stop: NOT_SERVING, new calls refused, the slow call answered,
    then it returns at once, though a health Watch stream is still open."""

    async def main() -> None:
        stage = Stage()
        parts = ServiceParts(
            servicers=[(pb_grpc.add_GRPCInferenceServiceServicer_to_server, stage)],
            service_names=["inference.GRPCInferenceService"],
        )
        server = MeshServer(ServiceConfig(grace_period_s=20), parts)
        await server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            slow = asyncio.ensure_future(stub.ModelInfer(pb.ModelInferRequest(model_name="slow")))
            await stage.started.wait()

            stopping = asyncio.ensure_future(server.stop())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            refused = await _status(stub.ServerLive(pb.ServerLiveRequest()))
            assert refused[0] == grpc.StatusCode.UNAVAILABLE
            assert not stopping.done()

            loop = asyncio.get_running_loop()
            released = loop.time()
            stage.release.set()
            assert (await slow).model_name == "slow"
            await asyncio.wait_for(stopping, 5)
            assert loop.time() - released < 2

    asyncio.run(main())
