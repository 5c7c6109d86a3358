"""The Envoy configuration of the mesh's edge, generated from one settings object.

One listener carries everything:

    content-type application/grpc*  -> orchestrator (native gRPC and grpc-web)
    /api/v1/...                     -> orchestrator, meshserve.v1 transcoded to JSON
    /v2/...                         -> HTTP adapter (KServe v2 REST, Triton's generate)
    /v1/..., /health                -> HTTP adapter (OpenAI-compatible, as vLLM serves it)
    /tokenize, /detokenize          -> HTTP adapter (vLLM's tokenizer paths)
    anything else                   -> 404 {"error": ...}

Local replies (401, 404, 413, 429...) are JSON ``{"error": ...}`` for HTTP
clients; for gRPC and grpc-web Envoy turns the same replies into gRPC
statuses (UNAUTHENTICATED, RESOURCE_EXHAUSTED...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MESH_SERVICE = "meshserve.v1.MeshService"
_TYPES = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True)
class JwtAuth:
    """JWT bearer tokens checked against a local JWKS file."""

    jwks_file: Path
    issuer: str = "meshserve-dev"
    audiences: tuple[str, ...] = ("meshserve",)


@dataclass(frozen=True)
class RateLimit:
    """A token bucket shared by all requests on the listener."""

    max_tokens: int
    tokens_per_fill: int
    fill_interval_s: float = 1.0


@dataclass(frozen=True)
class EdgeSettings:
    """Everything the edge needs; built from the mesh YAML or flags."""

    listen_host: str
    listen_port: int
    admin_port: int
    orchestrator: str
    """host:port of the orchestrator (gRPC)."""
    http_adapter: str
    """host:port of the HTTP adapter."""
    descriptor_set: Path
    """FileDescriptorSet of meshserve.v1 (see descriptors.py)."""
    max_request_bytes: int = 16 * 1024 * 1024
    request_timeout_s: float = 60.0
    auth: JwtAuth | None = None
    rate_limit: RateLimit | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    otlp_endpoint: str | None = None
    access_log: bool = True
    max_connections: int = 10_000
    extra_clusters: tuple[dict[str, Any], ...] = field(default_factory=tuple)


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _cluster(name: str, target: str, http2: bool, health: dict[str, Any] | None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(target)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    if health is not None:
        cluster["health_checks"] = [
            {
                "timeout": "1s",
                "interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                **health,
            }
        ]
    return cluster


# Triton's generate extension (the HTTP adapter's generate.py).
_GENERATE_PATHS = "/v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?"


def _routes(settings: EdgeSettings) -> list[dict[str, Any]]:
    no_buffer = {
        "envoy.filters.http.buffer": {
            "@type": f"{_TYPES}.filters.http.buffer.v3.BufferPerRoute",
            "disabled": True,
        }
    }
    # The adapter's routes are plain HTTP: the transcoder must not claim them.
    no_transcoder = {
        "envoy.filters.http.grpc_json_transcoder": {
            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
            "disabled": True,
        }
    }
    timeout = f"{settings.request_timeout_s:g}s"
    return [
        {
            "match": {
                "prefix": "/",
                "headers": [
                    {"name": "content-type", "string_match": {"prefix": "application/grpc"}}
                ],
            },
            # Streams have no overall timeout; gRPC callers bound calls with grpc-timeout.
            "route": {
                "cluster": "orchestrator",
                "timeout": "0s",
                "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            },
            "typed_per_filter_config": no_buffer,
        },
        # Token streams may run long: no overall timeout for generate and chat.
        {
            "match": {"safe_regex": {"regex": "/api/v1/(generate|chat)"}},
            "route": {"cluster": "orchestrator", "timeout": "0s"},
        },
        {"match": {"prefix": "/api/v1/"}, "route": {"cluster": "orchestrator", "timeout": timeout}},
        # Triton's generate extension streams tokens too: no overall timeout.
        {
            "match": {"safe_regex": {"regex": _GENERATE_PATHS}},
            "route": {"cluster": "http_adapter", "timeout": "0s"},
            "typed_per_filter_config": no_transcoder,
        },
        {
            "match": {"prefix": "/v2"},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # vLLM's health path, for the probes of its users.
        {
            "match": {"path": "/health"},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # vLLM's tokenizer paths, for the clients of its server.
        {
            "match": {"safe_regex": {"regex": "/(de)?tokenize"}},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # OpenAI streams (SSE) may run long: no overall timeout.
        {
            "match": {"prefix": "/v1/"},
            "route": {"cluster": "http_adapter", "timeout": "0s"},
            "typed_per_filter_config": no_transcoder,
        },
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 404, "body": {"inline_string": "no route for this path"}},
        },
    ]


def _http_filters(settings: EdgeSettings) -> list[dict[str, Any]]:
    # grpc-web first: once it is plain gRPC, every later local reply (401, 429)
    # goes back as a gRPC status, re-encoded for the browser on the way out.
    filters: list[dict[str, Any]] = [
        {
            "name": "envoy.filters.http.grpc_web",
            "typed_config": {"@type": f"{_TYPES}.filters.http.grpc_web.v3.GrpcWeb"},
        }
    ]
    if settings.rate_limit is not None:
        limit = settings.rate_limit
        filters.append(
            {
                "name": "envoy.filters.http.local_ratelimit",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.local_ratelimit.v3.LocalRateLimit",
                    "stat_prefix": "edge_rate_limit",
                    "token_bucket": {
                        "max_tokens": limit.max_tokens,
                        "tokens_per_fill": limit.tokens_per_fill,
                        "fill_interval": f"{limit.fill_interval_s:g}s",
                    },
                    "filter_enabled": {
                        "default_value": {"numerator": 100, "denominator": "HUNDRED"}
                    },
                    "filter_enforced": {
                        "default_value": {"numerator": 100, "denominator": "HUNDRED"}
                    },
                    "rate_limited_as_resource_exhausted": True,
                },
            }
        )
    if settings.auth is not None:
        auth = settings.auth
        filters.append(
            {
                "name": "envoy.filters.http.jwt_authn",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.jwt_authn.v3.JwtAuthentication",
                    "providers": {
                        "mesh": {
                            "issuer": auth.issuer,
                            "audiences": list(auth.audiences),
                            "local_jwks": {"filename": str(auth.jwks_file)},
                            "forward": False,
                        }
                    },
                    "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "mesh"}}],
                },
            }
        )
    filters += [
        {
            "name": "envoy.filters.http.buffer",
            "typed_config": {
                "@type": f"{_TYPES}.filters.http.buffer.v3.Buffer",
                "max_request_bytes": settings.max_request_bytes,
            },
        },
        {
            "name": "envoy.filters.http.grpc_json_transcoder",
            "typed_config": {
                "@type": f"{_TYPES}.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
                "proto_descriptor": str(settings.descriptor_set),
                "services": [MESH_SERVICE],
                "convert_grpc_status": True,
                "print_options": {
                    "add_whitespace": False,
                    "always_print_primitive_fields": True,
                    "preserve_proto_field_names": True,
                    # Server streams (Generate, Chat) reach HTTP clients as Server-Sent Events.
                    "stream_sse_style_delimited": True,
                },
                "request_validation_options": {"reject_unknown_method": True},
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
        },
    ]
    return filters


def _connection_manager(settings: EdgeSettings) -> dict[str, Any]:
    manager: dict[str, Any] = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        "generate_request_id": True,
        "route_config": {
            "name": "mesh",
            "virtual_hosts": [{"name": "mesh", "domains": ["*"], "routes": _routes(settings)}],
        },
        "http_filters": _http_filters(settings),
        # Every local reply an HTTP client sees is JSON; gRPC callers get statuses.
        "local_reply_config": {
            "body_format": {
                "json_format": {"error": "%LOCAL_REPLY_BODY%"},
                "content_type": "application/json",
            }
        },
    }
    if settings.access_log:
        manager["access_log"] = [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {"@type": f"{_TYPES}.access_loggers.stream.v3.StdoutAccessLog"},
            }
        ]
    if settings.otlp_endpoint:
        manager["tracing"] = {
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
                    "service_name": "envoy",
                },
            }
        }
    return manager


def _listener(settings: EdgeSettings) -> dict[str, Any]:
    chain: dict[str, Any] = {
        "filters": [
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": _connection_manager(settings),
            }
        ]
    }
    if settings.tls_cert and settings.tls_key:
        chain["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2", "http/1.1"],
                    "tls_certificates": [
                        {
                            "certificate_chain": {"filename": str(settings.tls_cert)},
                            "private_key": {"filename": str(settings.tls_key)},
                        }
                    ],
                },
            },
        }
    return {
        "name": "edge",
        "address": _address(f"{settings.listen_host}:{settings.listen_port}"),
        "filter_chains": [chain],
    }


def build_config(settings: EdgeSettings) -> dict[str, Any]:
    """The whole Envoy bootstrap as a dict (dump it as YAML or JSON)."""
    clusters = [
        _cluster(
            "orchestrator", settings.orchestrator, http2=True, health={"grpc_health_check": {}}
        ),
        _cluster(
            "http_adapter",
            settings.http_adapter,
            http2=False,
            health={"http_health_check": {"path": "/v2/health/live"}},
        ),
        *settings.extra_clusters,
    ]
    if settings.otlp_endpoint:
        clusters.append(_cluster("otlp", settings.otlp_endpoint, http2=True, health=None))
    return {
        "admin": {"address": _address(f"127.0.0.1:{settings.admin_port}")},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": f"{_TYPES}.resource_monitors.downstream_connections.v3."
                        "DownstreamConnectionsConfig",
                        "max_active_downstream_connections": settings.max_connections,
                    },
                }
            ]
        },
        "static_resources": {"listeners": [_listener(settings)], "clusters": clusters},
    }
