"""Streams through the orchestrator: decoupled models and streaming ensembles.

A decoupled model (an LLM) answers one request with many responses over
ModelStreamInfer. Calling one directly is relayed response by response; in an
ensemble, the steps after the decoupled step run once per streamed response.
Closing a relay (the caller went away, or the ensemble saw FINISH_REASON)
cancels the stage call, which aborts the generation inside the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, WireTensor
from services.orchestrator.router import StageRouter
from shared.errors import InvalidArgument, MeshError, Unavailable, error_for_status

FINAL_PARAMETER = "triton_final_response"
STATUS_PARAMETER = "meshserve_status_code"


def is_final(response: pb.ModelInferResponse) -> bool:
    """True on the last response of a decoupled request."""
    param = response.parameters.get(FINAL_PARAMETER)
    return param is not None and param.bool_param


def stream_error(message: pb.ModelStreamInferResponse) -> MeshError:
    """A stage's in-stream error, with its status code when the stage sent one."""
    code_param = message.infer_response.parameters.get(STATUS_PARAMETER)
    if code_param is not None:
        for code in grpc.StatusCode:
            if code.value[0] == code_param.int64_param:
                return error_for_status(code, message.error_message)
    return InvalidArgument(message.error_message)


async def relay(
    router: StageRouter,
    request: pb.ModelInferRequest,
    deadline_s: float | None,
    opened: Callable[[], None] | None = None,
) -> AsyncIterator[pb.ModelInferResponse]:
    """Forward one request to a decoupled model; yield its responses until final.

    ``opened`` runs once the stream exists (its request already queued to go).
    """
    endpoint_call: list[Any] = []

    async def open_stream(stub: Any) -> Any:
        call = stub.ModelStreamInfer(iter([request]), timeout=deadline_s)
        endpoint_call.append(call)
        return call

    # Only opening the stream may be retried: once tokens flow, a retry would
    # repeat them.
    call = await router.call(request.model_name, "ModelStreamInfer", open_stream)
    if opened is not None:
        opened()
    try:
        async for message in call:
            if message.error_message:
                raise stream_error(message)
            yield message.infer_response
            if is_final(message.infer_response):
                return
    except grpc.aio.AioRpcError as exc:
        raise error_for_status(exc.code(), exc.details() or "stream failed") from exc
    finally:
        call.cancel()


def step_request(
    step: Step, inputs: dict[str, WireTensor], outputs: list[str], request_id: str
) -> pb.ModelInferRequest:
    """The ModelInferRequest for one ensemble step."""
    sub = pb.ModelInferRequest(model_name=step.model, model_version=step.version, id=request_id)
    for name, tensor in inputs.items():
        sub.inputs.add(name=name, datatype=tensor.datatype, shape=list(tensor.shape))
        sub.raw_input_contents.append(tensor.raw)
    for name in outputs:
        sub.outputs.add(name=name)
    return sub


def wire_outputs(response: pb.ModelInferResponse) -> dict[str, WireTensor]:
    """A response's outputs in wire form."""
    return {
        t.name: WireTensor(t.datatype, tuple(t.shape), raw)
        for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


class StepStreams:
    """Open ModelStreamInfer streams that carry one generation's repeated steps.

    A streaming ensemble runs the steps after its decoupled step once per
    generated response (the detokenizer once per token). A new RPC each time
    costs a stage server much more than one more message on an open stream
    (measured on the detokenizer: 2.4 vs 1.7 ms CPU), so each step gets one
    stream for the whole generation. A step runs once at a time within one
    generation, so a stream has at most one request in flight and its next
    message is that request's answer. Steps are stateless: a stream that breaks
    with UNAVAILABLE (its replica went away) is reopened, on the replica the
    router picks then, and the request sent again, once.
    """

    def __init__(self, router: StageRouter, deadline_s: float | None) -> None:
        self._router = router
        self._deadline_s = deadline_s
        self._streams: dict[int, _StepStream] = {}
        self._opening: dict[int, asyncio.Task[_StepStream]] = {}

    async def infer(self, step: int, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """Send ``request`` on step ``step``'s stream (opened on first use); its answer."""
        for attempt in range(2):
            stream = self._streams.get(step)
            if stream is None:
                opening = self._opening.pop(step, None)
                if opening is not None:
                    stream = await opening
                else:
                    stream = await _StepStream.open(
                        self._router, request.model_name, self._deadline_s
                    )
                self._streams[step] = stream
            try:
                return await stream.ask(request)
            except grpc.aio.AioRpcError as exc:
                del self._streams[step]
                stream.close()
                if attempt or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise error_for_status(exc.code(), exc.details() or "stream failed") from exc
        raise AssertionError("unreachable")

    def open_soon(self, steps: Iterable[Step]) -> None:
        """Start opening the streams of ``steps`` (in the current trace context): a
        stage sets a stream up while the generation starts, instead of when the
        first token is waiting for it. Called once the generation's own request
        is on its way, so that request is not queued behind these."""
        for step in steps:
            if step.index not in self._streams and step.index not in self._opening:
                self._opening[step.index] = asyncio.create_task(
                    _StepStream.open(self._router, step.model, self._deadline_s)
                )

    def close(self) -> None:
        """End every stream (the stages see their callers leave)."""
        for opening in self._opening.values():
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                opening.result().close()
            else:
                opening.cancel()
        self._opening.clear()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()


class _StepStream:
    """One ModelStreamInfer whose requests are written one at a time."""

    def __init__(self, call: Any, outgoing: asyncio.Queue[pb.ModelInferRequest | None]) -> None:
        self._call = call
        self._outgoing = outgoing

    @classmethod
    async def open(cls, router: StageRouter, model: str, deadline_s: float | None) -> _StepStream:
        outgoing: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            while (request := await outgoing.get()) is not None:
                yield request

        async def open_stream(stub: Any) -> Any:
            return stub.ModelStreamInfer(requests(), timeout=deadline_s)

        return cls(await router.call(model, "ModelStreamInfer", open_stream), outgoing)

    async def ask(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        self._outgoing.put_nowait(request)
        message = await self._call.read()
        if message is grpc.aio.EOF:
            raise Unavailable(f"model '{request.model_name}': the stage ended the stream")
        if message.error_message:
            raise stream_error(message)
        response: pb.ModelInferResponse = message.infer_response
        return response

    def close(self) -> None:
        # End the request stream; the stage then ends the call with OK. (A cancel
        # would interrupt the call's request writer mid-await, which gRPC logs
        # with a formatted traceback: ~0.3 ms per stream for nothing.)
        self._outgoing.put_nowait(None)
