"""A v2 stream's messages as the mesh writes and reads them.

On ModelStreamInfer (Triton's decoupled models, and the streams the
orchestrator forwards unary requests on) a request's failure travels in band:
a message with ``error_message`` set, which Triton's protocol gives no status
code, so the mesh adds its own (``STATUS_CODE``) and a relay can raise the
same error again. A decoupled request's last answer carries
``triton_final_response``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from inference import grpc_service_pb2 as pb
from shared.errors import (
    GENERIC_INTERNAL_MESSAGE,
    InvalidArgument,
    MeshError,
    Overloaded,
    error_for_status,
)
from shared.forwarding import packed_size

log = logging.getLogger(__name__)

FINAL_RESPONSE = "triton_final_response"
"""Response parameter: true on the last response to a request (Triton's name)."""
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
"""Request parameter: also send a final response that carries no outputs."""
STATUS_CODE = "meshserve_status_code"
"""Parameter of an in-stream error response: the gRPC status code, as an integer."""


def stream_error(request: pb.ModelInferRequest, error: MeshError) -> pb.ModelStreamInferResponse:
    """A failed request of a stream: Triton's error_message, plus our status code.

    The ``meshserve_status_code`` parameter keeps the gRPC code (a stream's
    error_message alone has none), so a relay can re-raise the same error.
    """
    answer = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    answer.parameters[FINAL_RESPONSE].bool_param = True
    answer.parameters[STATUS_CODE].int64_param = error.code.value[0]
    return pb.ModelStreamInferResponse(error_message=error.message, infer_response=answer)


def fitting(answer: pb.ModelStreamInferResponse, limit: int) -> pb.ModelStreamInferResponse:
    """``answer``, or its request's error when the answer alone would make a message
    over ``limit`` bytes, as a unary call's answer that size fails RESOURCE_EXHAUSTED."""
    size = answer.ByteSize()
    if packed_size(size) <= limit:
        return answer
    head = answer.infer_response
    request = pb.ModelInferRequest(
        model_name=head.model_name, model_version=head.model_version, id=head.id
    )
    too_large = f"model '{head.model_name}': answer larger than max ({size} vs. {limit} bytes)"
    return stream_error(request, Overloaded(too_large))


def is_final(response: pb.ModelInferResponse) -> bool:
    """True on the last response of a decoupled request (``triton_final_response``)."""
    param = response.parameters.get(FINAL_RESPONSE)
    return param is not None and param.bool_param


def stream_failure(message: pb.ModelStreamInferResponse) -> MeshError:
    """The error a stream's ``error_message`` carries, under the status code that
    ``stream_error`` put beside it (INVALID_ARGUMENT from a server that sent none)."""
    code_param = message.infer_response.parameters.get(STATUS_CODE)
    if code_param is not None:
        for code in grpc.StatusCode:
            if code.value[0] == code_param.int64_param:
                return error_for_status(code, message.error_message)
    return InvalidArgument(message.error_message)


async def until_final(
    messages: AsyncIterator[pb.ModelStreamInferResponse],
) -> AsyncIterator[pb.ModelInferResponse]:
    """One decoupled request's responses from its stream's messages, up to the final
    one; a message with an ``error_message`` raises its MeshError (``stream_failure``)."""
    async for message in messages:
        if message.error_message:
            raise stream_failure(message)
        yield message.infer_response
        if is_final(message.infer_response):
            return


def stream_failed(
    request: pb.ModelInferRequest, exc: Exception, what: str
) -> pb.ModelStreamInferResponse:
    """A failed request's stream message: a MeshError is the caller's answer;
    anything else, as the interceptor does for unary calls: log it, tell the
    caller little."""
    if not isinstance(exc, MeshError):
        log.exception("unexpected error in a %s request", what)
        exc = MeshError(GENERIC_INTERNAL_MESSAGE)
    return stream_error(request, exc)
