"""The request headers a batch worker (or any caller) sets on meshserve.v1 calls:
``x-meshserve-priority`` and ``x-meshserve-final-only`` become the v2 request's
``priority`` and ``final_only`` parameters; a bad value is an INVALID_ARGUMENT
naming the header, and a parameter the request already has wins."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from inference import grpc_service_pb2 as pb
from services.orchestrator.route_headers import take_route_headers
from shared.errors import InvalidArgument


class Caller:
    """What take_route_headers reads of a servicer context: the caller's metadata."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> Iterable[tuple[str, Any]]:
        return self.metadata

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        raise AssertionError("not called here")


def test_priority_and_final_only_become_parameters() -> None:
    request = pb.ModelInferRequest(model_name="llm")
    take_route_headers(
        Caller(("x-meshserve-priority", "2"), ("X-Meshserve-Final-Only", "true")), request
    )
    assert request.parameters["priority"].int64_param == 2
    assert request.parameters["final_only"].bool_param is True


def test_a_parameter_the_request_has_wins() -> None:
    request = pb.ModelInferRequest(model_name="llm")
    request.parameters["priority"].int64_param = 1
    take_route_headers(Caller(("x-meshserve-priority", "2")), request)
    assert request.parameters["priority"].int64_param == 1


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-meshserve-priority", "-1"),
        ("x-meshserve-priority", "low"),
        ("x-meshserve-final-only", "yes"),
    ],
)
def test_a_bad_value_names_the_header(header: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match=header):
        take_route_headers(Caller((header, value)), pb.ModelInferRequest(model_name="llm"))
