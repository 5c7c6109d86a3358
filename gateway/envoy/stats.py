"""Envoy's own statistics for Prometheus, on a listener of their own.

Envoy's admin interface stays on its Unix socket (it can also drain, quit and
change log levels: never on TCP). A plain HTTP listener on the metrics port
passes exactly two read-only paths to it, through a static cluster whose one
endpoint is that socket:

    GET /metrics            -> admin /stats/prometheus  (the path every target uses)
    GET /stats/prometheus   -> admin /stats/prometheus
    anything else           -> 404

No tracing and no access log here: a scrape every few seconds is not a request
anyone wants to find.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CLUSTER = "envoy_admin"
STATS_PATH = "/stats/prometheus"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def admin_cluster(admin_socket: Path) -> dict[str, Any]:
    """A cluster whose one endpoint is the admin interface's Unix socket."""
    return {
        "name": CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(admin_socket)}}}}]}
            ],
        },
    }


def stats_listener(address: dict[str, Any]) -> dict[str, Any]:
    """The listener on ``address`` that answers only the Prometheus exposition."""
    routes = [
        {
            "match": {"path": path, "headers": [_get()]},
            "route": {"cluster": CLUSTER, "prefix_rewrite": STATS_PATH, "timeout": "5s"},
        }
        for path in ("/metrics", STATS_PATH)
    ]
    routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 404}})
    manager = {
        "@type": f"{_HCM}.HttpConnectionManager",
        "stat_prefix": "metrics",
        "route_config": {
            "name": "metrics",
            "virtual_hosts": [{"name": "metrics", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": "metrics",
        "address": address,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _get() -> dict[str, Any]:
    """Only reads: the admin interface takes POSTs that change Envoy."""
    return {"name": ":method", "string_match": {"exact": "GET"}}
