"""Every kind of gRPC call carries the caller's trace to the server.

A real grpc.aio server and channel on 127.0.0.1 with the mesh's interceptors;
spans go to an in-memory exporter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.interceptors import ServerInterceptor, client_interceptors


class Echo(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))


def _call_in_span(kind: str) -> tuple[list[ReadableSpan], int]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def main() -> int:
        server = grpc.aio.server(interceptors=[ServerInterceptor(tracer)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=client_interceptors(tracer)
            ) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with tracer.start_as_current_span("caller") as caller:
                    if kind == "unary":
                        await stub.ServerLive(pb.ServerLiveRequest())
                    else:
                        call = stub.ModelStreamInfer(iter([pb.ModelInferRequest(id="a")]))
                        assert [m.infer_response.id async for m in call] == ["a"]
                    trace_id: int = caller.get_span_context().trace_id
                    return trace_id
        finally:
            await server.stop(None)

    trace_id = asyncio.run(main())
    return list(exporter.get_finished_spans()), trace_id


@pytest.mark.parametrize("kind", ["unary", "bidirectional stream"])
def test_server_span_continues_the_callers_trace(kind: str) -> None:
    spans, trace_id = _call_in_span(kind)
    by_kind = {span.kind.name: span for span in spans if span.name != "caller"}
    assert set(by_kind) == {"CLIENT", "SERVER"}, [s.name for s in spans]
    client, server = by_kind["CLIENT"], by_kind["SERVER"]
    assert client.context.trace_id == server.context.trace_id == trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
