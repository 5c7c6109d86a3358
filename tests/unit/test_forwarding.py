"""Reading a ForwardRequest pack at the stage: its requests and the ids it withdraws."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from inference import grpc_service_pb2 as pb
from meshserve.v1 import forwarding_pb2
from shared.errors import InvalidArgument
from shared.forwarding import NOT_A_REQUEST, read_pack
from shared.wireformat import WireError, repeated

BROKEN_INPUT = b"\x2a\x02\xff\xff"
"""Field 5 (``inputs``) holding a varint cut short: the request does not decode."""


def _request(name: str, request_id: str) -> bytes:
    return pb.ModelInferRequest(
        model_name=name, model_version="1", id=request_id
    ).SerializeToString()


def test_a_pack_that_decodes_gives_its_requests_and_withdrawn_ids_in_order() -> None:
    data = repeated(1, [_request("a", "r1"), _request("b", "r2")]) + repeated(
        2, [b"r0", "é".encode()]
    )
    pack = read_pack(data)
    assert [(r.model_name, r.id) for r in pack.requests] == [("a", "r1"), ("b", "r2")]
    assert pack.withdrawn == ["r0", "é"]
    assert not pack.refused


def test_a_request_that_does_not_decode_is_refused_alone_and_withdrawals_still_count() -> None:
    """The slow path walks the fields itself: the ids withdrawn in the same message
    must not be lost because a neighbouring request was malformed."""
    broken = _request("c", "bad") + BROKEN_INPUT
    data = (
        repeated(1, [_request("a", "r1"), broken])
        + repeated(2, [b"r0"])
        + repeated(1, [_request("b", "r2")])
    )
    with pytest.raises(DecodeError):
        forwarding_pb2.ForwardRequest.FromString(data)
    pack = read_pack(data)
    assert [(r.model_name, r.id) for r in pack.requests] == [("a", "r1"), ("c", "bad"), ("b", "r2")]
    assert pack.withdrawn == ["r0"]
    assert list(pack.refused) == ["bad"]
    assert isinstance(pack.refused["bad"], InvalidArgument)
    assert str(pack.refused["bad"]) == NOT_A_REQUEST


def test_a_pack_with_a_field_it_does_not_know_is_a_wire_error_on_the_slow_path() -> None:
    data = repeated(1, [_request("c", "bad") + BROKEN_INPUT]) + repeated(3, [b"?"])
    with pytest.raises(WireError, match="unexpected field 3"):
        read_pack(data)
