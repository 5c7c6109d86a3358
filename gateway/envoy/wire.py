"""The edge's route for ModelInfer to the orchestrator's wire door (shared/wire_door.py).

Callers still speak gRPC to Envoy. Behind it, a unary ModelInfer goes to the
orchestrator as an HTTP/1.1 request with the serialised message as its body,
which costs the orchestrator a tenth of a grpc.aio call to receive:

- ``grpc_http1_reverse_bridge`` (``withhold_grpc_frames``) strips the gRPC
  frame from the request and adds it back to the answer, and writes the
  trailers; on its own it can only map HTTP statuses to a few gRPC codes;
- ``header_mutation`` then sets the trailers' ``grpc-status`` and
  ``grpc-message`` from the door's ``x-grpc-status`` and ``x-grpc-message``
  headers (and ``traceparent`` from the door's), so every status and message
  reaches the caller as the gRPC port would have sent it (the two headers also
  reach it, as response headers).

grpc-web calls take the route too (the grpc_web filter turns them into gRPC
first). Both filters are off on every other route. Streams (ModelStreamInfer),
the other methods and a compressed message keep the gRPC route to the
orchestrator's gRPC port.
"""

from __future__ import annotations

from typing import Any

from shared.servicer import SERVICE_NAME
from shared.trace_ids import TRACEPARENT
from shared.wire_door import CONTENT_TYPE, MESSAGE_HEADER, STATUS_HEADER

CLUSTER = "orchestrator_wire"
PATH = f"/{SERVICE_NAME}/ModelInfer"
BRIDGE = "envoy.filters.http.grpc_http1_reverse_bridge"
STATUS_TRAILERS = "meshserve.wire_status"
_TYPES = "type.googleapis.com/envoy.extensions"
_BRIDGE_ON = {
    "@type": f"{_TYPES}.filters.http.grpc_http1_reverse_bridge.v3.FilterConfigPerRoute",
    "disabled": False,
}


def _trailer(name: str, header: str) -> dict[str, Any]:
    return {
        "append": {
            "header": {"key": name, "value": f"%RESP({header})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    }


_STATUS_MUTATIONS = {
    "response_trailers_mutations": [
        _trailer("grpc-status", STATUS_HEADER),
        _trailer("grpc-message", MESSAGE_HEADER),
        _trailer(TRACEPARENT, TRACEPARENT),
    ]
}


def wire_filters() -> list[dict[str, Any]]:
    """The two filters, off by default, for the place just before the router
    (the status mutation first: on the way out it runs after the bridge)."""
    return [
        {
            "name": STATUS_TRAILERS,
            "disabled": True,
            # Nothing of its own: the route's config (wire_route) holds the mutations.
            "typed_config": {"@type": f"{_TYPES}.filters.http.header_mutation.v3.HeaderMutation"},
        },
        {
            "name": BRIDGE,
            "disabled": True,
            "typed_config": {
                "@type": f"{_TYPES}.filters.http.grpc_http1_reverse_bridge.v3.FilterConfig",
                "content_type": CONTENT_TYPE,
                "withhold_grpc_frames": True,
            },
        },
    ]


def wire_route(grpc_route: dict[str, Any]) -> dict[str, Any]:
    """ModelInfer (a unary gRPC call) to the wire door, with the two filters on;
    otherwise as ``grpc_route`` sends gRPC (timeouts, per-route settings)."""
    # gRPC and grpc-web (which the grpc_web filter turns into gRPC before the
    # bridge); the bridge sets the content type it sends upstream and then routes
    # again: the route must match that one too.
    grpc = "application/grpc(-web(-text)?)?(\\+proto)?"
    content_type = {"safe_regex": {"regex": f"{grpc}|{CONTENT_TYPE}"}}
    # A compressed message keeps the gRPC port: the bridge drops the frame's
    # compressed flag with the frame.
    plain = {"name": "grpc-encoding", "present_match": True, "invert_match": True}
    match = {
        "path": PATH,
        "headers": [{"name": "content-type", "string_match": content_type}, plain],
    }
    return {
        **grpc_route,  # its name too: one rate-limit bucket for a caller's gRPC calls
        "match": match,
        "route": {**grpc_route["route"], "cluster": CLUSTER},
        "typed_per_filter_config": {
            **grpc_route.get("typed_per_filter_config", {}),
            # A filter off by default is on where a route configures it.
            STATUS_TRAILERS: {
                "@type": f"{_TYPES}.filters.http.header_mutation.v3.HeaderMutationPerRoute",
                "mutations": _STATUS_MUTATIONS,
            },
            BRIDGE: _BRIDGE_ON,
        },
    }
