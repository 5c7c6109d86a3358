"""The codec between KServe v2 tensors and numpy arrays.

Inputs may arrive in ``raw_input_contents`` (what tritonclient sends) or in
typed ``contents``; outputs always go out in ``raw_output_contents``, because
tritonclient reads only the raw form. Every length is checked against shape x
datatype, and every error names the tensor.

BYTES tensors are flat sequences of elements, each a 4-byte little-endian
length followed by that many bytes; in numpy they are object arrays of
``bytes``. BF16 maps to ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import struct
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import model_config_pb2 as mc
from shared.errors import InvalidArgument

# v2 datatype name -> numpy dtype (little-endian, as on the wire).
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(object),
}

# Which InferTensorContents field carries each datatype (FP16/BF16 have none).
_TYPED_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# Model config TYPE_* names <-> v2 datatype names.
CONFIG_TO_V2 = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}


def config_datatype(data_type: int) -> str:
    """Model-config TYPE_* enum value -> v2 datatype name."""
    return CONFIG_TO_V2[mc.DataType.Name(data_type)]


_V2_NAMES: dict[np.dtype[Any], str] = {dtype: name for name, dtype in DATATYPES.items()}
"""numpy dtype -> v2 name: a dict hit per tensor instead of a scan comparing dtypes."""


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype name of a numpy array."""
    name = _V2_NAMES.get(array.dtype)
    if name is not None:
        return name
    if array.dtype.kind in ("S", "U"):
        return "BYTES"
    for name, dtype in DATATYPES.items():  # an equal dtype that does not hash alike
        if name != "BYTES" and array.dtype == dtype:
            return name
    raise InvalidArgument(f"numpy dtype {array.dtype} has no v2 datatype")


def element_count(what: str, shape: Sequence[int]) -> int:
    """Elements in ``shape`` (exact: Python ints do not overflow); ``what`` names the
    tensor in the error a negative dimension gets."""
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"{what}: shape {list(shape)} has a negative dimension")
        count *= dim
    return count


def deserialize_bytes(name: str, raw: bytes | memoryview, count: int) -> np.ndarray:
    """Length-prefixed BYTES elements -> object array; checks count and length."""
    items: list[bytes] = []
    offset = 0
    view = memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidArgument(
                f"tensor '{name}': truncated BYTES length prefix at byte {offset}"
            )
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidArgument(
                f"tensor '{name}': BYTES element {len(items)} claims {length} bytes, "
                f"only {len(raw) - offset} remain"
            )
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidArgument(
            f"tensor '{name}': expected {count} BYTES elements for its shape, got {len(items)}"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def serialize_bytes(array: np.ndarray) -> bytes:
    """Object/str/bytes array -> length-prefixed BYTES elements."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_raw(
    name: str, datatype: str, shape: Sequence[int], raw: bytes | memoryview
) -> np.ndarray:
    """A raw little-endian buffer -> array, checking its byte length."""
    dtype = _dtype(name, datatype)
    count = element_count(f"tensor '{name}'", shape)
    if datatype == "BYTES":
        return deserialize_bytes(name, raw, count).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"tensor '{name}': {len(raw)} bytes of raw data, but shape {list(shape)} of "
            f"{datatype} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def decode_typed(
    name: str, datatype: str, shape: Sequence[int], contents: pb.InferTensorContents
) -> np.ndarray:
    """Typed ``contents`` -> array, checking the element count."""
    dtype = _dtype(name, datatype)
    field = _TYPED_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(
            f"tensor '{name}': {datatype} cannot travel in typed contents; use raw_input_contents"
        )
    values = getattr(contents, field)
    count = element_count(f"tensor '{name}'", shape)
    if len(values) != count:
        raise InvalidArgument(
            f"tensor '{name}': shape {list(shape)} needs {count} elements, "
            f"{field} has {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    return np.asarray(values, dtype=dtype).reshape(shape)


def _dtype(name: str, datatype: str) -> np.dtype[Any]:
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise InvalidArgument(
            f"tensor '{name}': unknown datatype '{datatype}' "
            f"(expected one of {', '.join(DATATYPES)})"
        )
    return dtype


def refuse_mixed_contents(
    request: pb.ModelInferRequest, raw: Sequence[bytes | memoryview] | None = None
) -> None:
    """InvalidArgument for an input with typed ``contents`` in a request that also
    carries raw contents (``raw``, else its ``raw_input_contents``), in Triton's
    words (its clients match on them)."""
    if not (request.raw_input_contents if raw is None else raw):
        return
    for tensor in request.inputs:
        if tensor.HasField("contents"):
            raise InvalidArgument(
                "contents field must not be specified when using raw_input_contents for "
                f"'{tensor.name:.200}' for model '{request.model_name:.200}'"
            )


def decode_inputs(
    request: pb.ModelInferRequest, raws: Sequence[bytes | memoryview] | None = None
) -> dict[str, np.ndarray]:
    """All input tensors of a request, by name; ``raws``: their raw contents where
    they come from beside the message (shared memory) rather than in it."""
    raw = request.raw_input_contents if raws is None else raws
    # Before the count check: Triton names the mixed input even when the counts differ.
    refuse_mixed_contents(request, raw)
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "send all inputs raw or none"
        )
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        if not tensor.name:
            raise InvalidArgument(f"input {index} has no name")
        if tensor.name in arrays:
            raise InvalidArgument(f"input '{tensor.name}' appears more than once")
        arrays[tensor.name] = _decode_one(tensor, raw[index] if raw else None)
    return arrays


def _decode_one(tensor: Any, raw: bytes | memoryview | None) -> np.ndarray:
    """One input or output tensor, from its raw bytes or else its typed contents."""
    shape = list(tensor.shape)
    if raw is not None:
        return decode_raw(tensor.name, tensor.datatype, shape, raw)
    return decode_typed(tensor.name, tensor.datatype, shape, tensor.contents)


def encode_raw(array: np.ndarray) -> bytes:
    """An array as raw little-endian bytes (length-prefixed for BYTES)."""
    if datatype_of(array) == "BYTES":
        return serialize_bytes(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).tobytes()


def encode_outputs(
    response: pb.ModelInferResponse,
    outputs: Mapping[str, np.ndarray],
    order: Iterable[str] | None = None,
    elsewhere: Container[str] = (),
) -> None:
    """Append ``outputs`` (in ``order`` if given) as raw output tensors; those named
    in ``elsewhere`` (already written to shared memory) with empty raw contents."""
    for name in order if order is not None else outputs:
        array = outputs[name]
        tensor = response.outputs.add(name=name, datatype=datatype_of(array))
        tensor.shape.extend(int(dim) for dim in array.shape)
        response.raw_output_contents.append(b"" if name in elsewhere else encode_raw(array))


def encode_inputs(request: pb.ModelInferRequest, inputs: Mapping[str, np.ndarray]) -> None:
    """Append ``inputs`` as raw input tensors (the client side of the codec)."""
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype=datatype_of(array))
        tensor.shape.extend(int(dim) for dim in array.shape)
        request.raw_input_contents.append(encode_raw(array))


def decode_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """All output tensors of a response, by name (raw or typed)."""
    raw = response.raw_output_contents
    return {
        tensor.name: _decode_one(tensor, raw[index] if raw else None)
        for index, tensor in enumerate(response.outputs)
    }


def parameter_value(param: pb.InferParameter) -> Any:
    """The Python value of an InferParameter (whichever field is set)."""
    which = param.WhichOneof("parameter_choice")
    return getattr(param, which) if which else None


def parameters_to_dict(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A protobuf parameter map as a plain dict."""
    return {key: parameter_value(value) for key, value in params.items()}


def set_parameter(target: Any, key: str, value: Any) -> None:
    """Store ``value`` in a protobuf InferParameter map under ``key``."""
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)
