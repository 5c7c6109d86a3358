"""An ensemble step's request and answer in wire form, tensors never copied twice.

A step's tensors pass through the orchestrator untouched: the stage's answer
holds them, the next step's request carries them on. Building a step request
as a protobuf message and serialising it, then parsing the stage's answer back
into one, copies each tensor four times more than the hop needs (a MobileNet
input is 600 KB). Here:

- ``request_bytes`` serialises only the small part of the request (names,
  shapes, parameters) with protobuf and appends each tensor as a
  ``raw_input_contents`` field, all joined in one copy: protobuf concatenates
  repeated fields of concatenated messages, in order;
- ``answer_tensors`` walks the answer's top-level fields and keeps each
  ``raw_output_contents`` as a view into the bytes that arrived.

No gRPC here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from inference import grpc_service_pb2 as pb
from services.orchestrator.ensemble import Step, WireTensor
from shared.errors import MeshError
from shared.shared_memory import BYTE_SIZE, HANDOFF
from shared.wireformat import encode_varint, length_delimited

_LENGTH_DELIMITED = 2
_RAW_INPUT = 7
"""ModelInferRequest.raw_input_contents."""
_OUTPUTS, _RAW_OUTPUT = 5, 6
"""ModelInferResponse.outputs and .raw_output_contents."""
_RAW_INPUT_TAG = bytes([_RAW_INPUT << 3 | _LENGTH_DELIMITED])


class Buffers(Protocol):
    """Where an answer's outputs in handoff buffers are read (handoff.HandoffScope)."""

    def view(self, model: str, key: str, size: int) -> memoryview:
        """The ``size`` bytes the stage wrote into buffer ``key``."""
        ...


def request_bytes(
    step: Step,
    inputs: Mapping[str, WireTensor],
    outputs: Sequence[str],
    request_id: str,
    parameters: Mapping[str, pb.InferParameter] | None = None,
    placed: Mapping[str, tuple[str, int]] | None = None,
) -> bytes:
    """The serialised ModelInferRequest of one step (raw inputs, in input order; an
    input in a handoff buffer names it instead, and ``placed`` gives outputs' buffers
    as key and size)."""
    head = pb.ModelInferRequest(model_name=step.model, model_version=step.version, id=request_id)
    for name, tensor in inputs.items():
        entry = head.inputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        if tensor.handoff:
            _name_buffer(entry.parameters, tensor.handoff, len(tensor.raw))
    for name in outputs:
        wanted = head.outputs.add(name=name)
        if placed and name in placed:
            _name_buffer(wanted.parameters, *placed[name])
    for key, value in (parameters or {}).items():
        head.parameters[key].CopyFrom(value)
    parts: list[bytes | memoryview] = [head.SerializeToString()]
    for tensor in inputs.values():
        if not tensor.handoff:
            parts += (_RAW_INPUT_TAG, encode_varint(len(tensor.raw)), tensor.raw)
    return b"".join(parts)


def _name_buffer(parameters: Any, key: str, size: int) -> None:
    parameters[HANDOFF].string_param = key
    parameters[BYTE_SIZE].int64_param = size


def answer_tensors(
    model: str, answer: bytes, buffers: Buffers | None = None
) -> dict[str, WireTensor]:
    """A serialised ModelInferResponse's outputs; raw data stays in ``answer``
    (memoryviews), or in the handoff buffer an output names (``buffers``' view). An
    answer that is not one is the stage's fault: INTERNAL, naming ``model`` (the
    ensemble names the step)."""
    data = memoryview(answer)
    heads: list[pb.ModelInferResponse.InferOutputTensor] = []
    raws: list[memoryview] = []
    try:
        for number, start, end in length_delimited(data):
            if number == _OUTPUTS:
                heads.append(_output_head(bytes(data[start:end])))
            elif number == _RAW_OUTPUT:
                raws.append(data[start:end])
    except (ValueError, IndexError, DecodeError) as exc:
        raise MeshError(f"model '{model}': the stage's answer does not parse: {exc}") from None
    if len(heads) != len(raws):
        raise MeshError(
            f"model '{model}': the stage answered {len(heads)} outputs with "
            f"{len(raws)} raw_output_contents (outputs must travel raw)"
        )
    tensors: dict[str, WireTensor] = {}
    for head, carried in zip(heads, raws, strict=True):
        key = head.parameters[HANDOFF].string_param if HANDOFF in head.parameters else ""
        raw: bytes | memoryview = carried
        if key:
            if buffers is None:
                raise MeshError(f"model '{model}': the stage answered with a buffer not asked for")
            raw = buffers.view(model, key, head.parameters[BYTE_SIZE].int64_param)
        tensors[head.name] = WireTensor(head.datatype, tuple(head.shape), raw, key)
    return tensors


def _output_head(data: bytes) -> pb.ModelInferResponse.InferOutputTensor:
    head: pb.ModelInferResponse.InferOutputTensor = (
        pb.ModelInferResponse.InferOutputTensor.FromString(data)
    )
    return head
