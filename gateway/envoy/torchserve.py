"""TorchServe's two ports at the edge: its inference paths on the mesh's listener,
its management API on a listener of its own.

    edge listener:        /predictions/..., /explanations/..., /ping -> HTTP adapter
    management listener:  /models...                                -> HTTP adapter
                          anything else                             -> 404

The management listener carries the same filters as the edge (authentication,
the admin role for management calls, rate limits), so it is guarded like every
other management call; TorchServe's own default is 127.0.0.1:8081.
"""

from __future__ import annotations

import copy
from typing import Any

MANAGEMENT_PREFIX = "/models"
"""TorchServe's management paths (access.py counts them as management calls)."""

_NO_TRANSCODER = {
    "envoy.filters.http.grpc_json_transcoder": {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
        "disabled": True,
    }
}


def _adapter(name: str, match: dict[str, Any], timeout: str) -> dict[str, Any]:
    return {
        "name": name,
        "match": match,
        "route": {"cluster": "http_adapter", "timeout": timeout},
        "typed_per_filter_config": _NO_TRANSCODER,
    }


def inference_routes(timeout: str) -> list[dict[str, Any]]:
    """The edge listener's routes for TorchServe's inference API."""
    return [
        _adapter(
            "torchserve_predictions",
            {"safe_regex": {"regex": "/(predictions|explanations)/[^/]+(/[^/]+)?"}},
            timeout,
        ),
        _adapter("torchserve_ping", {"path": "/ping"}, timeout),
    ]


def management_listener(
    edge: dict[str, Any], address: dict[str, Any], timeout: str
) -> dict[str, Any]:
    """A copy of the edge listener on ``address`` that routes only the management API."""
    listener = copy.deepcopy(edge)
    listener["name"] = "torchserve_management"
    listener["address"] = address
    for chain in listener["filter_chains"]:
        for network_filter in chain["filters"]:
            config = network_filter["typed_config"]
            if "route_config" not in config:
                continue
            config["stat_prefix"] = "torchserve_management"
            config["route_config"] = {
                "name": "torchserve_management",
                "virtual_hosts": [
                    {
                        "name": "torchserve_management",
                        "domains": ["*"],
                        "routes": [
                            _adapter("torchserve_models", {"prefix": MANAGEMENT_PREFIX}, timeout),
                            {
                                "match": {"prefix": "/"},
                                "direct_response": {
                                    "status": 404,
                                    "body": {"inline_string": "no route for this path"},
                                },
                            },
                        ],
                    }
                ],
            }
    return listener
