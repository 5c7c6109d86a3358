"""A route's headers on the v2 REST infer route, as the gRPC front doors take them.

``x-meshserve-route-key`` (sticky assignment) and ``x-meshserve-route-target``
(override) become the request parameters the orchestrator reads (a parameter
the body already sets wins); the target that served, a response parameter,
comes back as the ``x-meshserve-route-target`` response header too.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from inference import grpc_service_pb2 as pb

HEADERS = {"x-meshserve-route-key": "route_key", "x-meshserve-route-target": "route_target"}
SERVED = "route_target"


def take(headers: Mapping[str, str], request: pb.ModelInferRequest) -> None:
    """Copy the routing headers into the request's parameters."""
    for header, parameter in HEADERS.items():
        value = headers.get(header)
        if value is not None and parameter not in request.parameters:
            request.parameters[parameter].string_param = value


def announce(answer: pb.ModelInferResponse, headers: MutableMapping[str, str]) -> None:
    """Name the serving target in the response headers, when a route served."""
    if SERVED in answer.parameters:
        headers["x-meshserve-route-target"] = answer.parameters[SERVED].string_param
