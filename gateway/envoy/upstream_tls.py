"""Envoy's side of the mesh's mutual TLS: its certificate toward the upstreams.

With ``mtls_*`` set, Envoy dials the orchestrator (gRPC, ALPN h2) and the HTTP
adapter (HTTP/1.1) over TLS, shows the mesh certificate, and accepts only
upstreams whose certificate the mesh CA signed and names the host dialled (or
``mtls_server_name``). The listener's own TLS (``tls_cert``) is separate:
clients of the edge need no mesh certificate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"

SECURED = {"orchestrator": "h2", "orchestrator_wire": "http/1.1", "http_adapter": "http/1.1"}
"""The mesh's own upstream clusters, with the protocol each speaks."""


@dataclass(frozen=True)
class UpstreamTls:
    """Files of the mesh identity Envoy shows to its upstreams."""

    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None


def _san_matcher(host: str) -> dict[str, Any]:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return {"san_type": "DNS", "matcher": {"exact": host}}
    return {"san_type": "IP_ADDRESS", "matcher": {"exact": host}}


def transport_socket(tls: UpstreamTls, target: str, alpn: str) -> dict[str, Any]:
    """The UpstreamTlsContext for one cluster dialling ``target`` (host:port)."""
    name = tls.server_name or target.rpartition(":")[0]
    context: dict[str, Any] = {
        "@type": f"{_TLS}.UpstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": [alpn],
            "tls_certificates": [
                {
                    "certificate_chain": {"filename": str(tls.cert)},
                    "private_key": {"filename": str(tls.key)},
                }
            ],
            "validation_context": {
                "trusted_ca": {"filename": str(tls.ca)},
                "match_typed_subject_alt_names": [_san_matcher(name)],
            },
        },
    }
    if tls.server_name:
        context["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def secure(clusters: list[dict[str, Any]], tls: UpstreamTls | None) -> list[dict[str, Any]]:
    """``clusters`` with the mesh's own upstreams dialled over mutual TLS (when set)."""
    if tls is None:
        return clusters
    return [_secured(cluster, tls) for cluster in clusters]


def _secured(cluster: dict[str, Any], tls: UpstreamTls) -> dict[str, Any]:
    alpn = SECURED.get(cluster["name"])
    if alpn is None:
        return cluster
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    address = endpoint["endpoint"]["address"]["socket_address"]
    target = f"{address['address']}:{address['port_value']}"
    return {**cluster, "transport_socket": transport_socket(tls, target, alpn)}
