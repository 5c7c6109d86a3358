"""KServe v2 REST inference <-> ModelInferRequest / ModelInferResponse.

A request body is a JSON header, optionally followed by raw tensor bytes (the
binary tensor data extension): the ``Inference-Header-Content-Length`` header
says where the JSON ends, and each binary input says its size in
``parameters.binary_data_size``, in input order. JSON inputs carry ``data``
(nested or flat, row-major); BYTES elements are UTF-8 strings.

Every input goes to the orchestrator in ``raw_input_contents`` (the proto
wants all inputs raw or none, and raw is what every hop reads), so JSON data
is encoded once, here (``json_tensors``). Outputs come back raw and leave
as JSON ``data`` or as binary chunks after the JSON, per output
(``parameters.binary_data``) or for all (``parameters.binary_data_output``);
the adapter consumes these parameters and forwards all others unchanged. An
input or output that names a shared-memory region has no data here: the core
reads and writes the region (shared/shared_memory.py).

Nothing here knows aiohttp: functions take and return bytes and protos.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.json_tensors import json_to_raw, raw_to_data
from inference import grpc_service_pb2 as pb
from shared.errors import InvalidArgument
from shared.shared_memory import REGION
from shared.tensors import decode_raw, decode_typed, encode_raw
from shared.trace_ids import current_trace_id

HEADER_LENGTH = "Inference-Header-Content-Length"
"""Request and response header: bytes of JSON before the binary tensor data."""

_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1


class PayloadTooLarge(InvalidArgument):
    """The request body (or what it inflates to) is over ``max_body_bytes``."""

    http_status = 413


class UnsupportedEncoding(InvalidArgument):
    """A ``Content-Encoding`` other than identity, gzip or deflate."""

    http_status = 415


# --- The request body --------------------------------------------------------


def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body with its ``Content-Encoding`` undone, never inflating past ``limit``."""
    coding = (encoding or "identity").strip().lower()
    if coding == "identity":
        return body
    if coding not in ("gzip", "deflate"):
        raise UnsupportedEncoding(
            f"Content-Encoding '{encoding}' is not supported; use identity, gzip or deflate"
        )
    # gzip has its own framing; "deflate" in HTTP means the zlib format.
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if coding == "gzip" else zlib.MAX_WBITS)
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgument(f"request body is not valid {coding} data: {exc}") from exc
    if len(inflated) > limit:
        raise PayloadTooLarge(f"request body inflates to more than {limit} bytes (max_body_bytes)")
    if not inflater.eof:
        raise InvalidArgument(f"request body is truncated {coding} data")
    return inflated


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data after it."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidArgument(
            f"{HEADER_LENGTH} must be a byte count, got {header_length!r}"
        ) from None
    if not 0 <= length <= len(body):
        raise InvalidArgument(
            f"{HEADER_LENGTH} is {length}, but the request body has {len(body)} bytes"
        )
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: Any = None


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # KServe's clients repeat the URL's model (and may its version) in the body,
    # as KServe's servers accept; they must agree with the URL (_check_target).
    model_name: str | None = None
    model_version: str | None = None
    id: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[_Input]
    outputs: list[_Output] = Field(default_factory=list)


def _where(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as ``inputs[0].shape``; the root is ``body``."""
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    return path[1:] if path else "body"


_REQUEST_KEYS = frozenset(_Request.model_fields)
_INPUT_KEYS = frozenset(_Input.model_fields)
_OUTPUT_KEYS = frozenset(_Output.model_fields)


def _plain_tensor(item: Any, keys: frozenset[str]) -> bool:
    return (
        type(item) is dict
        and item.keys() <= keys
        and type(item.get("name")) is str
        and item["name"] != ""
        and type(item.get("parameters", {})) is dict
    )


def _plain_input(item: Any) -> bool:
    if not _plain_tensor(item, _INPUT_KEYS) or type(item.get("datatype")) is not str:
        return False
    shape = item.get("shape")
    return type(shape) is list and all(type(dim) is int for dim in shape)


@dataclass(frozen=True, slots=True)
class _Tensor:
    """An input or requested output of a parsed request (the validator's fields)."""

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any]
    data: Any


@dataclass(frozen=True, slots=True)
class _Document:
    """A parsed request body (the validator's fields)."""

    model_name: str | None
    model_version: str | None
    id: str
    parameters: dict[str, Any]
    inputs: list[_Tensor]
    outputs: list[_Tensor]


def _tensor(item: dict[str, Any]) -> _Tensor:
    return _Tensor(
        item["name"],
        item.get("shape", []),
        item.get("datatype", ""),
        item.get("parameters", {}),
        item.get("data"),
    )


def _plain(document: Any) -> _Document | None:
    """The request as the validator would give it, when it is plainly well formed
    (the common case, at a fraction of the validator's cost); None otherwise, and
    the validator then names what is wrong."""
    if type(document) is not dict or not document.keys() <= _REQUEST_KEYS:
        return None
    inputs, outputs = document.get("inputs"), document.get("outputs", [])
    if (
        type(inputs) is not list
        or type(outputs) is not list
        or type(document.get("model_name")) not in (str, type(None))
        or type(document.get("model_version")) not in (str, type(None))
        or type(document.get("id", "")) is not str
        or type(document.get("parameters", {})) is not dict
        or not all(_plain_input(item) for item in inputs)
        or not all(_plain_tensor(item, _OUTPUT_KEYS) for item in outputs)
    ):
        return None
    return _Document(
        document.get("model_name"),
        document.get("model_version"),
        document.get("id", ""),
        document.get("parameters", {}),
        [_tensor(item) for item in inputs],
        [_tensor(item) for item in outputs],
    )


def _validated(request: _Request) -> _Document:
    return _Document(
        request.model_name,
        request.model_version,
        request.id,
        request.parameters,
        [_Tensor(t.name, t.shape, t.datatype, t.parameters, t.data) for t in request.inputs],
        [_Tensor(t.name, [], "", t.parameters, None) for t in request.outputs],
    )


def _parse_header(header: bytes) -> _Document:
    try:
        plain = _plain(orjson.loads(header))
    except orjson.JSONDecodeError:
        plain = None  # the validator says where
    if plain is not None:
        return plain
    try:
        return _validated(_Request.model_validate_json(header))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            raise InvalidArgument(f"malformed JSON in the request: {errors[0]['msg']}") from None
        problems = "; ".join(f"{_where(err['loc'])}: {err['msg']}" for err in errors[:5])
        raise InvalidArgument(f"invalid inference request: {problems}") from None


# --- Parameters ----------------------------------------------------------------


def _set_parameters(target: Any, parameters: Mapping[str, Any], what: str) -> None:
    """Store JSON parameters in a proto InferParameter map."""
    for key, value in parameters.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
            param.int64_param = value
        elif isinstance(value, int) and 0 <= value <= _UINT64_MAX:
            param.uint64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise InvalidArgument(
                f"{what}: parameter '{key}' must be a boolean, a 64-bit integer, a number "
                f"or a string, got {type(value).__name__} {value!r:.40}"
            )


def _pop_bool(parameters: dict[str, Any], key: str, what: str) -> bool | None:
    value = parameters.pop(key, None)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{what}: parameter '{key}' must be true or false, got {value!r}")
    return value


# --- Inference -------------------------------------------------------------------


@dataclass(frozen=True)
class InferCall:
    """A ModelInferRequest, and how the caller wants each output back."""

    request: pb.ModelInferRequest
    binary_default: bool = False
    """``parameters.binary_data_output`` of the request."""
    binary_outputs: Mapping[str, bool] = field(default_factory=dict)
    """``parameters.binary_data`` of each requested output that set it."""
    placed: frozenset[str] = frozenset()
    """The requested outputs written to a shared-memory region: no data in the answer."""

    def binary(self, output: str) -> bool:
        """Whether ``output`` goes back as binary data after the JSON."""
        return self.binary_outputs.get(output, self.binary_default)


def _add_inputs(request: pb.ModelInferRequest, inputs: list[_Tensor], binary: memoryview) -> None:
    offset = 0
    for tensor in inputs:
        what = f"input '{tensor.name}'"
        parameters = dict(tensor.parameters)
        size = parameters.pop("binary_data_size", None)
        if REGION in parameters:
            # Read from the region by the core (shared/shared_memory.py): no raw entry here.
            if tensor.data is not None or size is not None:
                raise InvalidArgument(f"{what}: has data as well as a shared-memory region")
            message = request.inputs.add(
                name=tensor.name, datatype=tensor.datatype, shape=tensor.shape
            )
            _set_parameters(message.parameters, parameters, what)
            continue
        if size is None:
            raw = json_to_raw(tensor.name, tensor.datatype, tensor.shape, tensor.data)
        else:
            if tensor.data is not None:
                raise InvalidArgument(f"{what}: has both 'data' and 'binary_data_size'")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidArgument(f"{what}: binary_data_size must be a byte count")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"{what}: binary_data_size {size} runs past the end of the request body "
                    f"({len(binary) - offset} bytes left after the JSON header)"
                )
            raw = bytes(binary[offset : offset + size])
            offset += size
            decode_raw(tensor.name, tensor.datatype, tensor.shape, raw)  # checks the size
        message = request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        _set_parameters(message.parameters, parameters, what)
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary tensor data follow the JSON header "
            "that no input claims with binary_data_size"
        )


def _check_target(document: _Document, model: str, version: str) -> str:
    """The version to call: the URL's, or the body's where the URL names none.
    A body ``model_name`` / ``model_version`` that contradicts the URL is refused."""
    if document.model_name is not None and document.model_name != model:
        raise InvalidArgument(
            f"model_name '{document.model_name:.100}' in the request body contradicts the "
            f"model '{model:.100}' in the URL"
        )
    body_version = document.model_version or ""
    if version and body_version and body_version != version:
        raise InvalidArgument(
            f"model_version '{body_version:.40}' in the request body contradicts the "
            f"version '{version:.40}' in the URL"
        )
    return version or body_version


def parse_infer(model: str, version: str, body: bytes, header_length: str | None) -> InferCall:
    """A request body (JSON, or JSON + binary tensors) as an InferCall."""
    header, binary = split_body(body, header_length)
    document = _parse_header(header)
    version = _check_target(document, model, version)
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=document.id)
    parameters = dict(document.parameters)
    binary_default = _pop_bool(parameters, "binary_data_output", "request") or False
    _set_parameters(request.parameters, parameters, "request")
    _add_inputs(request, document.inputs, binary)
    choices: dict[str, bool] = {}
    for output in document.outputs:
        what = f"output '{output.name}'"
        output_parameters = dict(output.parameters)
        choice = _pop_bool(output_parameters, "binary_data", what)
        if choice is not None:
            choices[output.name] = choice
        message = request.outputs.add(name=output.name)
        _set_parameters(message.parameters, output_parameters, what)
    placed = frozenset(o.name for o in document.outputs if REGION in o.parameters)
    return InferCall(request, binary_default, choices, placed)


def _parameters_json(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, param in parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            result[key] = getattr(param, which)
    return result


def _as_list(value: Any) -> Any:
    """What orjson leaves to us: arrays it does not write itself (not C-contiguous)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def render_infer(call: InferCall, response: pb.ModelInferResponse) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it."""
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    # The request's own id when it gave one (KServe v2 echoes it), else its trace id.
    request_id = response.id or current_trace_id()
    if request_id:
        document["id"] = request_id
    if response.parameters:
        document["parameters"] = _parameters_json(response.parameters)
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    raws = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        shape = list(tensor.shape)
        raw = (
            raws[index]
            if raws
            else encode_raw(decode_typed(tensor.name, tensor.datatype, shape, tensor.contents))
        )
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": shape}
        parameters = _parameters_json(tensor.parameters)
        if tensor.name in call.placed:
            pass  # written to its shared-memory region
        elif call.binary(tensor.name):
            parameters["binary_data_size"] = len(raw)
            chunks.append(raw)
        else:
            entry["data"] = raw_to_data(tensor.name, tensor.datatype, shape, raw)
        if parameters:
            entry["parameters"] = parameters
        outputs.append(entry)
    document["outputs"] = outputs
    header = orjson.dumps(document, default=_as_list, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
