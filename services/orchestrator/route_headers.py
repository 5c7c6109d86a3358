"""The routing headers of the gRPC front doors.

A caller may give the sticky key and the override as metadata
(``x-meshserve-route-key``, ``x-meshserve-route-target``; Envoy passes HTTP
headers through as metadata) instead of request parameters, and learns which
target served from the response header ``x-meshserve-route-target``.

Two more headers say how the request is served, for the meshserve.v1 RPCs
that have no parameters (Chat, Embed...): ``x-meshserve-priority`` (the v2
``priority`` parameter: 1 is the highest level, as the batchers and a vLLM
engine with priority scheduling read it; the batch workers send their lower
level) and ``x-meshserve-final-only: true`` (the ``final_only`` parameter:
a decoupled model such as an LLM answers with its final response only, so a
caller that wants the whole text does not pay for a stream of tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from inference import grpc_service_pb2 as pb
from services.orchestrator.routes import KEY_PARAMETER, TARGET_PARAMETER
from shared.errors import InvalidArgument

KEY_HEADER = "x-meshserve-route-key"
TARGET_HEADER = "x-meshserve-route-target"
_HEADERS = {KEY_HEADER: KEY_PARAMETER, TARGET_HEADER: TARGET_PARAMETER}
PRIORITY_HEADER = "x-meshserve-priority"
FINAL_ONLY_HEADER = "x-meshserve-final-only"
FINAL_ONLY_PARAMETER = "final_only"
"""True: a decoupled model answers with its final response only (no token stream)."""


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
        name = key.lower()
        parameter = _HEADERS.get(name)
        if parameter and parameter not in request.parameters and isinstance(value, str):
            request.parameters[parameter].string_param = value
        elif name == PRIORITY_HEADER and "priority" not in request.parameters:
            request.parameters["priority"].int64_param = _level(value)
        elif name == FINAL_ONLY_HEADER and FINAL_ONLY_PARAMETER not in request.parameters:
            request.parameters[FINAL_ONLY_PARAMETER].bool_param = _flag(value)


def _level(value: Any) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) > 1_000_000:
        raise InvalidArgument(
            f"header {PRIORITY_HEADER}: expected a priority level (0: the model's default,"
            f" 1 the highest), got {text!r}"
        )
    return int(text)


def _flag(value: Any) -> bool:
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise InvalidArgument(f"header {FINAL_ONLY_HEADER}: expected true or false, got {text!r}")
    return text == "true"


async def announce_target(context: Invocation, response: pb.ModelInferResponse) -> None:
    """Send the served target as a response header, when a route served."""
    if TARGET_PARAMETER in response.parameters:
        served = response.parameters[TARGET_PARAMETER].string_param
        await context.send_initial_metadata(((TARGET_HEADER, served),))
