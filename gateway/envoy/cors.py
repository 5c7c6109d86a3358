"""CORS at the edge: which browser origins may call the mesh, answered by Envoy.

With origins configured, Envoy's CORS filter runs first on the listener: a
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed
origin is answered by Envoy itself, before authentication (a browser sends no
token with it), and every answer to such an origin, errors included, carries
``Access-Control-Allow-Origin`` so the page can read it. Other origins get no
CORS headers, so browsers keep the answer from them. With none configured
the filter is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CORS = "type.googleapis.com/envoy.extensions.filters.http.cors.v3"
FILTER = "envoy.filters.http.cors"

ALLOW_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
ALLOW_HEADERS = ", ".join(
    [
        "authorization",
        "content-type",
        "traceparent",
        "tracestate",
        "x-request-id",
        # grpc-web from a browser
        "x-grpc-web",
        "x-user-agent",
        "grpc-timeout",
    ]
)
EXPOSE_HEADERS = "grpc-status, grpc-message, x-request-id, retry-after"
MAX_AGE_S = 600


def cors_filters(origins: Sequence[str]) -> list[dict[str, Any]]:
    """The CORS filter, to run first (none without origins)."""
    if not origins:
        return []
    return [{"name": FILTER, "typed_config": {"@type": f"{_CORS}.Cors"}}]


def cors_policy(origins: Sequence[str]) -> dict[str, Any]:
    """The virtual host's ``typed_per_filter_config`` entry for ``origins`` ({} without)."""
    if not origins:
        return {}
    matchers = [
        {"safe_regex": {"regex": ".*"}} if origin == "*" else {"exact": origin}
        for origin in origins
    ]
    policy = {
        "@type": f"{_CORS}.CorsPolicy",
        "allow_origin_string_match": matchers,
        "allow_methods": ALLOW_METHODS,
        "allow_headers": ALLOW_HEADERS,
        "expose_headers": EXPOSE_HEADERS,
        "max_age": str(MAX_AGE_S),
    }
    return {"typed_per_filter_config": {FILTER: policy}}
