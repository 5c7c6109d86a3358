"""A forwarding stream to a server that does not forward: ModelInfer instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from inference import grpc_service_pb2 as pb
from services.orchestrator import forward_stream
from services.orchestrator.forward_stream import ForwardStream, NotForwarding

SERVICE = "inference.GRPCInferenceService"


async def _serve(
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]],
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _infer(request: bytes, context: Any) -> bytes:
    return pb.ModelInferResponse(model_name="m", id="x").SerializeToString()


async def _stream_without_the_header(
    requests: AsyncIterator[bytes], context: Any
) -> AsyncIterator[bytes]:
    async for request in requests:  # a v2 stream as any server answers it
        answer = pb.ModelInferResponse.FromString(request)
        yield pb.ModelStreamInferResponse(infer_response=answer).SerializeToString()


@pytest.mark.parametrize("streams", [False, True], ids=["no-streams", "streams-unannounced"])
def test_a_server_that_does_not_say_it_forwards_gets_nothing_on_the_stream(
    streams: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is written on the stream (the server might answer it another way),
    also where the server would send its headers only with a first answer; the
    caller learns to send ModelInfer instead."""
    monkeypatch.setattr(forward_stream, "ACCEPT_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        handlers = {"ModelInfer": grpc.unary_unary_rpc_method_handler(_infer)}
        if streams:
            handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
                _stream_without_the_header
            )
        server, port = await _serve(handlers)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = ForwardStream(channel)
                request = pb.ModelInferRequest(model_name="m").SerializeToString()
                with pytest.raises(NotForwarding):
                    await asyncio.wait_for(stream.infer(request, "caller"), 10)
                stream.cancel()
        finally:
            await server.stop(0)

    asyncio.run(scenario())
