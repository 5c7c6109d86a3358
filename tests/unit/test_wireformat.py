"""Reading a serialised ModelInferRequest's routing fields without decoding it."""

from __future__ import annotations

import random

import pytest

from inference import grpc_service_pb2 as pb
from shared.wireformat import WireError, infer_header, string_parameters, with_id


def _text(rng: random.Random) -> str:
    # Multi-byte characters too: lengths on the wire count bytes, not characters.
    return "".join(rng.choice("ab_-.é漢\U0001f600") for _ in range(rng.randrange(0, 200)))


@pytest.mark.parametrize("seed", range(40))
def test_the_header_read_from_the_wire_is_what_protobuf_decodes(seed: int) -> None:
    rng = random.Random(seed)
    name, version, request_id, key = (_text(rng) for _ in range(4))
    raw = rng.randbytes(rng.randrange(0, 300))
    request = pb.ModelInferRequest(model_name=name, model_version=version, id=request_id)
    request.parameters[key].string_param = name
    request.inputs.add(name="INPUT", datatype="FP32", shape=[1, len(raw)])
    request.raw_input_contents.append(raw)
    data = request.SerializeToString()
    header = infer_header(data)
    assert (header.model_name, header.model_version, header.id) == (name, version, request_id)


def test_a_field_given_twice_reads_as_its_last_value_as_protobuf_merges_it() -> None:
    first = pb.ModelInferRequest(model_name="a").SerializeToString()
    second = pb.ModelInferRequest(model_name="b", id="7").SerializeToString()
    assert infer_header(first + second).model_name == "b"
    assert pb.ModelInferRequest.FromString(first + second).model_name == "b"


def test_setting_the_id_on_the_wire_changes_only_the_id() -> None:
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="tag")
    response.raw_output_contents.append(b"\x00" * 40)
    amended = pb.ModelInferResponse.FromString(with_id(response.SerializeToString(), "caller"))
    assert amended.id == "caller"
    assert amended.raw_output_contents[0] == b"\x00" * 40
    assert pb.ModelInferResponse.FromString(with_id(amended.SerializeToString(), "")).id == ""


def test_parameters_set_on_the_wire_read_as_protobuf_sets_them() -> None:
    request = pb.ModelInferRequest(model_name="m", id="1")
    request.parameters["traceparent"].string_param = "old"
    request.parameters["priority"].int64_param = 2
    request.raw_input_contents.append(b"\x01" * 300)
    carried = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "k=é"}
    amended = pb.ModelInferRequest.FromString(
        request.SerializeToString() + string_parameters(carried)
    )
    assert {k: v.string_param for k, v in amended.parameters.items() if k != "priority"} == carried
    assert amended.parameters["priority"].int64_param == 2
    assert amended.raw_input_contents[0] == b"\x01" * 300


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05ab",  # model_name claims 5 bytes, 2 follow
        b"\x0a",  # a tag and no length
        b"\x0b",  # wire type 3 (a group): not in v2 messages
        b"\x00\x01",  # field number 0
        b"\x0a\x02\xff\xfe",  # a model name that is not UTF-8
        b"\x8a" + b"\xff" * 10,  # a varint longer than 64 bits
    ],
)
def test_malformed_bytes_are_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        infer_header(data)
