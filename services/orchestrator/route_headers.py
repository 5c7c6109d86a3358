"""The routing headers of the gRPC front doors.

A caller may give the sticky key and the override as metadata
(``x-meshserve-route-key``, ``x-meshserve-route-target``; Envoy passes HTTP
headers through as metadata) instead of request parameters, and learns which
target served from the response header ``x-meshserve-route-target``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from inference import grpc_service_pb2 as pb
from services.orchestrator.routes import KEY_PARAMETER, TARGET_PARAMETER

KEY_HEADER = "x-meshserve-route-key"
TARGET_HEADER = "x-meshserve-route-target"
_HEADERS = {KEY_HEADER: KEY_PARAMETER, TARGET_HEADER: TARGET_PARAMETER}


class Invocation(Protocol):
    """What the header helpers need of a servicer context."""

    def invocation_metadata(self) -> Iterable[tuple[str, Any]] | None:
        """The caller's metadata."""
        ...

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        """Send response headers."""
        ...


def take_route_headers(context: Invocation, request: pb.ModelInferRequest) -> None:
    """Copy the routing headers into the request's parameters (a parameter the
    request already has wins)."""
    for key, value in context.invocation_metadata() or ():
        parameter = _HEADERS.get(key.lower())
        if parameter and parameter not in request.parameters and isinstance(value, str):
            request.parameters[parameter].string_param = value


async def announce_target(context: Invocation, response: pb.ModelInferResponse) -> None:
    """Send the served target as a response header, when a route served."""
    if TARGET_PARAMETER in response.parameters:
        served = response.parameters[TARGET_PARAMETER].string_param
        await context.send_initial_metadata(((TARGET_HEADER, served),))
