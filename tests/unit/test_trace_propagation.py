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
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from shared.config import MAX_MESSAGE_BYTES
from shared.errors import InvalidArgument
from shared.forwarding import PACKED_METHOD, Answer, add_forwarding
from shared.interceptors import DrainGate, ErrorInterceptor
from shared.servicer import FORWARD_HEADER, BaseServicer
from shared.trace_interceptors import TracingInterceptor, client_interceptors
from shared.tracing import (
    current_carrier,
    extract_context,
    inject_metadata,
    inject_parameters,
    make_tracer_provider,
    tracer_for,
)
from shared.wireformat import repeated, repeated_field, string_parameters, with_id

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


class Echo(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))


def _recording_tracer() -> tuple[InMemorySpanExporter, trace.Tracer]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("test")


async def _serve(
    servicer: Any, tracer: trace.Tracer, forwarding: Answer | None = None
) -> tuple[grpc.aio.Server, int]:
    """A started server with the mesh's server interceptor (and ForwardingService
    answered by ``forwarding``); and its port."""
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), TracingInterceptor(tracer), DrainGate()]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    if forwarding is not None:
        add_forwarding(forwarding, server, MAX_MESSAGE_BYTES)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _call_in_span(kind: str) -> tuple[list[ReadableSpan], int]:
    exporter, tracer = _recording_tracer()

    async def main() -> int:
        server, port = await _serve(Echo(), tracer)
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


def test_a_service_without_an_exporter_passes_the_trace_on() -> None:
    """caller (traced) -> relay (no OTLP endpoint: no spans) -> echo (traced):
    echo's server span continues the caller's trace, parented to the caller."""
    assert make_tracer_provider("relay", None) is None
    untraced = tracer_for(None, "relay")
    exporter, tracer = _recording_tracer()

    async def main() -> int:
        echo, echo_port = await _serve(Echo(), tracer)
        onward = grpc.aio.insecure_channel(
            f"127.0.0.1:{echo_port}", interceptors=client_interceptors(untraced)
        )

        class Relay(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
            async def ServerLive(self, request: Any, context: Any) -> Any:
                stub = pb_grpc.GRPCInferenceServiceStub(onward)
                return await stub.ServerLive(request)

        relay, relay_port = await _serve(Relay(), untraced)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with tracer.start_as_current_span("caller") as caller:
                    metadata = inject_metadata(None)
                    assert (await stub.ServerLive(pb.ServerLiveRequest(), metadata=metadata)).live
                    return caller.get_span_context().span_id
        finally:
            await onward.close()
            await relay.stop(None)
            await echo.stop(None)

    caller_span_id = asyncio.run(main())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"caller", "inference.GRPCInferenceService/ServerLive"}
    server = spans["inference.GRPCInferenceService/ServerLive"]
    assert server.context.trace_id == spans["caller"].context.trace_id
    assert server.parent is not None and server.parent.span_id == caller_span_id


def test_a_stream_opened_ahead_joins_its_first_requests_trace() -> None:
    """A stream opened outside any trace (as the orchestrator's spares are) gets
    its server span from its first request's parameters, which the servicer then
    no longer sees; the opening itself starts no client span."""
    exporter, tracer = _recording_tracer()
    seen: list[list[str]] = []

    class Recorder(Echo):
        async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncIterator[Any]:
            async for request in requests:
                seen.append(sorted(request.parameters))
                yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse())

    async def main() -> int:
        server, port = await _serve(Recorder(), tracer)
        outgoing: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            while (request := await outgoing.get()) is not None:
                yield request

        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=client_interceptors(tracer)
            ) as channel:
                call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
                await asyncio.sleep(0.1)  # open and idle, as a spare waits
                with tracer.start_as_current_span("caller") as caller:
                    request = pb.ModelInferRequest(id="a")
                    request.parameters["priority"].int64_param = 1
                    inject_parameters(request.parameters)
                    outgoing.put_nowait(request)
                    await call.read()
                outgoing.put_nowait(None)
                assert await call.read() is grpc.aio.EOF
                return caller.get_span_context().span_id
        finally:
            await server.stop(None)

    caller_span_id = asyncio.run(main())
    assert seen == [["priority"]]
    spans = exporter.get_finished_spans()
    assert sorted(s.kind.name for s in spans) == ["INTERNAL", "SERVER"], [s.name for s in spans]
    (server,) = [s for s in spans if s.kind.name == "SERVER"]
    assert server.parent is not None and server.parent.span_id == caller_span_id


@pytest.mark.parametrize("packed", [False, True], ids=["one-per-message", "packed"])
def test_each_request_forwarded_on_a_stream_gets_its_own_server_span(packed: bool) -> None:
    """On a stream that forwards unary requests (as the orchestrator's are, opened
    outside any trace), each request's server span is its own, parented from the
    context its parameters carry (set on the wire), current while the stage answers
    it, and failed with its in-band error; a request that carries no trace or an
    unsampled one records nothing, and the stream itself has no span. The same
    when the requests come several to a message (ForwardingService)."""
    exporter, tracer = _recording_tracer()
    current: dict[str, int] = {}

    class Stage(BaseServicer):
        async def ModelInfer(self, request: Any, context: Any) -> Any:
            assert sorted(request.parameters) == ["priority"]  # the trace fields are gone
            current[request.id] = trace.get_current_span().get_span_context().span_id
            await asyncio.sleep(0.01 if request.id == "~0" else 0)  # answered out of order
            if request.model_name == "bad":
                raise InvalidArgument("input 'X' is missing")
            return pb.ModelInferResponse(id=request.id)

    async def main() -> dict[str, int]:
        stage = Stage()
        server, port = await _serve(stage, tracer, stage.answer_forwarded if packed else None)
        callers = {}
        written: list[bytes] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method = PACKED_METHOD if packed else STREAM_METHOD
                call = channel.stream_stream(method)(metadata=((FORWARD_HEADER, "unary"),))
                for index, model in enumerate(["m", "bad", "m", "m"]):
                    request = pb.ModelInferRequest(model_name=model)
                    request.parameters["priority"].int64_param = 1
                    data = with_id(request.SerializeToString(), f"~{index}")
                    flags = "00" if index == 3 else "01"
                    if index != 2:
                        with tracer.start_as_current_span(f"caller {index}") as caller:
                            callers[f"~{index}"] = caller.get_span_context().span_id
                            carried = current_carrier()
                        carried["traceparent"] = carried["traceparent"][:-2] + flags
                        data += string_parameters(carried)
                    written.append(data)
                    if not packed:
                        await call.write(data)
                if packed:
                    await call.write(repeated(1, written))
                await call.done_writing()
                messages = [m async for m in call]
                if packed:
                    messages = [a for m in messages for a in repeated_field(m, 1)]
                answers = [pb.ModelStreamInferResponse.FromString(m) for m in messages]
                assert sorted(a.infer_response.id for a in answers) == ["~0", "~1", "~2", "~3"]
        finally:
            await server.stop(None)
        return callers

    callers = asyncio.run(main())
    servers = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    assert len(servers) == 2, [s.name for s in exporter.get_finished_spans()]
    by_parent = {s.parent.span_id: s for s in servers if s.parent is not None}
    assert set(by_parent) == {callers["~0"], callers["~1"]}
    for tag in ("~0", "~1"):
        span = by_parent[callers[tag]]
        assert span.name == "inference.GRPCInferenceService/ModelInfer"
        assert span.context.span_id == current[tag]  # current while it was answered
    assert by_parent[callers["~0"]].status.is_ok
    failed = by_parent[callers["~1"]]
    assert failed.attributes is not None and failed.attributes["meshserve.model"] == "bad"
    assert not failed.status.is_ok and "input 'X'" in (failed.status.description or "")
    assert current["~2"] == 0  # no trace: no span current


@pytest.mark.parametrize(
    "carrier",
    [
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"},
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "vendor=x1,other=y",
        },
        {"traceparent": "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"},
        {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"},
        {"traceparent": "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        {"traceparent": "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"},
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"},
        {"traceparent": "00-0x_7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        {"tracestate": "vendor=x1"},
        {},
    ],
)
def test_the_context_read_from_a_header_is_the_propagators(carrier: dict[str, str]) -> None:
    ours = trace.get_current_span(extract_context(list(carrier.items())))
    theirs = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier))
    assert ours.get_span_context() == theirs.get_span_context()


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_trace_is_sampled_where_it_starts_and_kept_as_its_caller_chose(ratio: float) -> None:
    """New traces are recorded at ``trace_sample_ratio`` (decided by trace id, so every
    hop that decides agrees); a caller's sampled flag wins over the ratio."""
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider("svc", None, exporter, sample_ratio=ratio)
    assert provider is not None
    tracer = provider.get_tracer("test")
    recorded = sum(tracer.start_span("root").is_recording() for _ in range(400))
    assert recorded == pytest.approx(400 * ratio, abs=60)
    for flags in (0, 1):
        caller = trace.SpanContext(1, 2, is_remote=True, trace_flags=trace.TraceFlags(flags))
        parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
        assert tracer.start_span("child", context=parent).is_recording() == bool(flags)
    provider.shutdown()
