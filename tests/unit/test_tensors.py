"""The v2 <-> numpy codec: every datatype round-trips; bad lengths name the tensor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from inference import grpc_service_pb2 as pb
from shared.errors import InvalidArgument
from shared.tensors import (
    DATATYPES,
    datatype_of,
    decode_inputs,
    decode_outputs,
    encode_inputs,
    encode_outputs,
)

SAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], dtype=np.uint8),
    "UINT16": np.array([[0, 7, 65535]], dtype=np.uint16),
    "UINT32": np.array([[0, 7, 2**32 - 1]], dtype=np.uint32),
    "UINT64": np.array([[0, 7, 2**64 - 1]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
    "INT16": np.array([[-32768, 0, 32767]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], dtype=np.int64),
    "FP16": np.array([[-1.5, 0.0, 65504.0]], dtype=np.float16),
    "FP32": np.array([[-1.25, 0.0, 3.4e38]], dtype=np.float32),
    "FP64": np.array([[-1.25, 0.0, 1e300]], dtype=np.float64),
    "BF16": np.array([[-1.5, 0.0, 3.0e38]], dtype=ml_dtypes.bfloat16),
    "BYTES": np.array([[b"", b"caf\xc3\xa9", b"\x00\x01\x02"]], dtype=object),
}


def test_every_datatype_is_covered() -> None:
    assert set(SAMPLES) == set(DATATYPES)


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_raw_round_trip(datatype: str) -> None:
    array = SAMPLES[datatype]
    request = pb.ModelInferRequest(model_name="m")
    encode_inputs(request, {"x": array})
    assert request.inputs[0].datatype == datatype
    assert list(request.inputs[0].shape) == [1, 3]
    decoded = decode_inputs(request)["x"]
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    assert decoded.tolist() == array.tolist()


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_outputs_are_always_raw(datatype: str) -> None:
    response = pb.ModelInferResponse()
    encode_outputs(response, {"y": SAMPLES[datatype]})
    assert len(response.raw_output_contents) == 1
    assert not response.outputs[0].HasField("contents")
    assert decode_outputs(response)["y"].tolist() == SAMPLES[datatype].tolist()


def test_bytes_wire_format_is_length_prefixed_little_endian() -> None:
    request = pb.ModelInferRequest()
    encode_inputs(request, {"s": np.array([b"ab", b"xyz"], dtype=object)})
    assert request.raw_input_contents[0] == b"\x02\x00\x00\x00ab\x03\x00\x00\x00xyz"


def test_typed_contents_decode() -> None:
    request = pb.ModelInferRequest()
    tensor = request.inputs.add(name="ids", datatype="INT64", shape=[2, 2])
    tensor.contents.int64_contents.extend([1, 2, 3, 4])
    text = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"hello")
    flags = request.inputs.add(name="flags", datatype="BOOL", shape=[2])
    flags.contents.bool_contents.extend([True, False])
    decoded = decode_inputs(request)
    assert decoded["ids"].tolist() == [[1, 2], [3, 4]]
    assert decoded["ids"].dtype == np.int64
    assert decoded["text"].tolist() == [b"hello"]
    assert decoded["flags"].tolist() == [True, False]


def _raw_request(datatype: str, shape: list[int], raw: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="pixels", datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "fragment"),
    [
        ("FP32", [2, 3], b"\x00" * 20, "24"),
        ("INT64", [4], b"\x00" * 31, "32"),
        ("BYTES", [2], b"\x01\x00\x00\x00a", "expected 2 BYTES elements"),
        ("BYTES", [1], b"\x09\x00\x00\x00abc", "claims 9 bytes"),
        ("BYTES", [1], b"\x01\x00", "truncated"),
        ("FP33", [1], b"\x00" * 4, "unknown datatype"),
        ("FP32", [-1], b"", "negative"),
    ],
)
def test_bad_raw_data_names_the_tensor(
    datatype: str, shape: list[int], raw: bytes, fragment: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        decode_inputs(_raw_request(datatype, shape, raw))
    assert "'pixels'" in caught.value.message
    assert fragment in caught.value.message


def test_typed_count_mismatch_names_the_tensor() -> None:
    request = pb.ModelInferRequest()
    tensor = request.inputs.add(name="scores", datatype="FP32", shape=[3])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidArgument, match="'scores'.*needs 3 elements"):
        decode_inputs(request)


def test_fp16_in_typed_contents_is_refused() -> None:
    request = pb.ModelInferRequest()
    request.inputs.add(name="half", datatype="FP16", shape=[1])
    with pytest.raises(InvalidArgument, match="'half'.*raw_input_contents"):
        decode_inputs(request)


def test_mixed_raw_and_typed_inputs_are_refused() -> None:
    request = _raw_request("FP32", [1], b"\x00" * 4)
    request.inputs.add(name="second", datatype="FP32", shape=[1])
    with pytest.raises(InvalidArgument, match="raw_input_contents has 1 entries for 2 inputs"):
        decode_inputs(request)


def test_duplicate_input_names_are_refused() -> None:
    request = _raw_request("FP32", [1], b"\x00" * 4)
    request.inputs.add(name="pixels", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\x00" * 4)
    with pytest.raises(InvalidArgument, match="'pixels' appears more than once"):
        decode_inputs(request)


def test_datatype_of_strings() -> None:
    assert datatype_of(np.array(["a"])) == "BYTES"
    assert datatype_of(np.array([b"a"])) == "BYTES"
