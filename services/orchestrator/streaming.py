"""Streams through the orchestrator: decoupled models and streaming ensembles.

A decoupled model (an LLM) answers one request with many responses over
ModelStreamInfer. Calling one directly is relayed response by response; in an
ensemble, the steps after the decoupled step run once per streamed response.
Closing a relay (the caller went away, or the ensemble saw FINISH_REASON)
cancels the stage call, which aborts the generation inside the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, WireTensor
from services.orchestrator.router import StageRouter
from shared.errors import InvalidArgument, MeshError, error_for_status

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
    router: StageRouter, request: pb.ModelInferRequest, deadline_s: float | None
) -> AsyncIterator[pb.ModelInferResponse]:
    """Forward one request to a decoupled model; yield its responses until final."""
    endpoint_call: list[Any] = []

    async def open_stream(stub: Any) -> Any:
        call = stub.ModelStreamInfer(iter([request]), timeout=deadline_s)
        endpoint_call.append(call)
        return call

    # Only opening the stream may be retried: once tokens flow, a retry would
    # repeat them.
    call = await router.call(request.model_name, "ModelStreamInfer", open_stream)
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
