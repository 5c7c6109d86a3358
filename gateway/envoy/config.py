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

from gateway.envoy import stats, torchserve
from gateway.envoy.access import JwtAuth, RateLimit, access_filters, route_rate_limits
from gateway.envoy.cors import cors_filters, cors_policy
from gateway.envoy.tracing import span_flush_runtime
from gateway.envoy.upstream_tls import UpstreamTls, secure
from gateway.envoy.wire import CLUSTER as WIRE_CLUSTER
from gateway.envoy.wire import wire_filters, wire_route

__all__ = ["EdgeSettings", "JwtAuth", "Limits", "RateLimit", "build_config"]

MESH_SERVICE = "meshserve.v1.MeshService"
ROUTE_SERVICE = "meshserve.v1.RouteService"
JOB_SERVICE = "meshserve.v1.JobService"
_TYPES = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True)
class Limits:
    """Timeouts and per-connection bounds: what an idle or slow client may hold."""

    request_headers_timeout_s: float = 10.0
    """A connection that has not sent a request's headers by then is closed (slowloris)."""
    stream_idle_timeout_s: float = 300.0
    """A request with no bytes either way for this long is reset; above a token stream's gaps."""
    connection_idle_timeout_s: float = 60.0
    """A connection with no request for this long is closed."""
    max_connections: int = 10_000
    """Open downstream connections on the listener (and the whole process)."""
    max_streams_per_connection: int = 1000
    """Concurrent HTTP/2 streams one connection may open."""
    connection_buffer_bytes: int = 1024 * 1024
    """Read and write buffer per connection before Envoy applies back-pressure."""
    premature_reset_streams: int = 10_000
    """HTTP/2 Rapid Reset guard: a connection is closed once half of at least this many
    of its streams were reset by the client within a second, unanswered."""
    http2_codec: str = "oghttp2"
    """Envoy's HTTP/2 codec: ``oghttp2``, or ``nghttp2``, which also closes a connection
    whose client resets more than 1000 streams at once or 33 a second after that."""


@dataclass(frozen=True)
class EdgeSettings:
    """Everything the edge needs; built from the mesh YAML or flags."""

    listen_host: str
    listen_port: int
    admin_socket: Path
    """Unix socket of Envoy's admin interface (mode 0600); no TCP port."""
    orchestrator: str
    """host:port of the orchestrator (gRPC)."""
    http_adapter: str
    """host:port of the HTTP adapter."""
    descriptor_set: Path
    """FileDescriptorSet of meshserve.v1 (see descriptors.py)."""
    shutdown_flag: Path
    """File main.py writes 1 into at shutdown: Envoy then answers new requests 503."""
    orchestrator_wire: str | None = None
    """host:port of the orchestrator's wire door (wire.py): unary ModelInfer goes
    there over HTTP/1.1; none: to the gRPC port like every other call."""
    max_request_bytes: int = 16 * 1024 * 1024
    request_timeout_s: float = 60.0
    auth: JwtAuth | None = None
    rate_limit: RateLimit | None = None
    limits: Limits = Limits()
    tls_cert: Path | None = None
    tls_key: Path | None = None
    otlp_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    """Share of requests without a sampled traceparent that Envoy starts a recorded trace for."""
    trace_store: str | None = None
    """host:port of the trace store's query port: /traces and Jaeger's /api go there."""
    access_log: bool = False
    """A stdout access-log line per request (EdgeConfig.access_log)."""
    extra_clusters: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    upstream_tls: UpstreamTls | None = None
    """Mutual TLS toward the orchestrator and the HTTP adapter (upstream_tls.py)."""
    cors_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the edge (cors.py); empty: CORS off."""
    torchserve_management: str | None = None
    """host:port of TorchServe's management listener (torchserve.py); none: off."""
    metrics: str | None = None
    """host:port of the listener that serves Envoy's statistics for Prometheus (stats.py)."""


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
    grpc_route = {
        "name": "grpc",
        "match": {
            "prefix": "/",
            "headers": [{"name": "content-type", "string_match": {"prefix": "application/grpc"}}],
        },
        # Streams have no overall timeout; gRPC callers bound calls with grpc-timeout.
        "route": {
            "cluster": "orchestrator",
            "timeout": "0s",
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
        },
        "typed_per_filter_config": no_buffer,
    }
    routes: list[dict[str, Any]] = [
        *([wire_route(grpc_route)] if settings.orchestrator_wire else []),
        grpc_route,
        # Token streams may run long: no overall timeout for generate and chat.
        {
            "name": "api_streams",
            "match": {"safe_regex": {"regex": "/api/v1/(generate|chat)"}},
            "route": {"cluster": "orchestrator", "timeout": "0s"},
        },
        {
            "name": "api",
            "match": {"prefix": "/api/v1/"},
            "route": {"cluster": "orchestrator", "timeout": timeout},
        },
        # Triton's generate extension streams tokens too: no overall timeout.
        {
            "name": "generate",
            "match": {"safe_regex": {"regex": _GENERATE_PATHS}},
            "route": {"cluster": "http_adapter", "timeout": "0s"},
            "typed_per_filter_config": no_transcoder,
        },
        {
            "name": "v2",
            "match": {"prefix": "/v2"},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # vLLM's health path, for the probes of its users.
        {
            "name": "health",
            "match": {"path": "/health"},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # vLLM's tokenizer paths, for the clients of its server.
        {
            "name": "tokenize",
            "match": {"safe_regex": {"regex": "/(de)?tokenize"}},
            "route": {"cluster": "http_adapter", "timeout": timeout},
            "typed_per_filter_config": no_transcoder,
        },
        # OpenAI streams (SSE) may run long: no overall timeout.
        {
            "name": "openai",
            "match": {"prefix": "/v1/"},
            "route": {"cluster": "http_adapter", "timeout": "0s"},
            "typed_per_filter_config": no_transcoder,
        },
        *_trace_routes(settings, timeout),
        *torchserve.inference_routes(timeout),
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 404, "body": {"inline_string": "no route for this path"}},
        },
    ]
    if settings.rate_limit is not None and settings.rate_limit.client_rps:
        for route in routes:
            if "route" in route:
                route["route"]["rate_limits"] = route_rate_limits(
                    route["name"], auth=settings.auth is not None
                )
    return routes


def _trace_routes(settings: EdgeSettings, timeout: str) -> list[dict[str, Any]]:
    """The trace store's page and Jaeger's query API (services/tracestore/query.py)."""
    if not settings.trace_store:
        return []
    off = {
        name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
        for name in ("envoy.filters.http.grpc_json_transcoder",)
    }
    return [
        {
            "name": "traces",
            "match": {
                "safe_regex": {"regex": "/traces(/.*)?|/api/(traces|services|operations)(/.*)?"}
            },
            "route": {"cluster": "tracestore", "timeout": timeout},
            "typed_per_filter_config": off,
        }
    ]


def _http_filters(settings: EdgeSettings) -> list[dict[str, Any]]:
    # grpc-web first: once it is plain gRPC, every later local reply (401, 429)
    # goes back as a gRPC status, re-encoded for the browser on the way out.
    # CORS before all: a preflight is answered before auth (it carries no token),
    # and local replies (401, 429) reach the page with CORS headers.
    filters: list[dict[str, Any]] = [
        *cors_filters(settings.cors_origins),
        {
            "name": "envoy.filters.http.grpc_web",
            "typed_config": {"@type": f"{_TYPES}.filters.http.grpc_web.v3.GrpcWeb"},
        },
    ]
    # 401, then 403, then 429: see access.py.
    filters += access_filters(settings.auth, settings.rate_limit)
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
                "services": [MESH_SERVICE, ROUTE_SERVICE, JOB_SERVICE],
                "convert_grpc_status": True,
                "print_options": {
                    "add_whitespace": False,
                    "always_print_primitive_fields": True,
                    "preserve_proto_field_names": True,
                    # Server streams (Generate, Chat) reach HTTP clients as Server-Sent Events.
                    "stream_sse_style_delimited": True,
                },
                "request_validation_options": {"reject_unknown_method": True},
                # A query parameter that names no field is ignored, as the adapter's
                # routes on this port ignore it (a cache buster, a tracking tag);
                # left to the transcoder it fails the call with a reset (503).
                "ignore_unknown_query_parameters": True,
                # "+" in a query is a space, as HTML forms and most clients mean it.
                "query_param_unescape_plus": True,
            },
        },
        *(wire_filters() if settings.orchestrator_wire else []),
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
        # Every answer names its request, the caller's x-request-id or Envoy's.
        "always_set_request_id_in_response": True,
        "route_config": {
            "name": "mesh",
            "virtual_hosts": [
                {
                    "name": "mesh",
                    "domains": ["*"],
                    "routes": _routes(settings),
                    **cors_policy(settings.cors_origins),
                }
            ],
        },
        "http_filters": _http_filters(settings),
        # The path roles are matched on is the path the adapter routes on:
        # /v2//repository/./models/x/unload cannot slip past the admin rule.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        **_timeouts(settings.limits),
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
            },
            # Requests that come without a trace: the share Envoy samples.
            "random_sampling": {"value": 100.0 * settings.trace_sample_ratio},
        }
    return manager


def _timeouts(limits: Limits) -> dict[str, Any]:
    """Slow or idle clients are let go; no overall request timeout here (streams
    may run for minutes: the routes bound unary calls)."""
    return {
        "request_headers_timeout": f"{limits.request_headers_timeout_s:g}s",
        "stream_idle_timeout": f"{limits.stream_idle_timeout_s:g}s",
        "common_http_protocol_options": {
            "idle_timeout": f"{limits.connection_idle_timeout_s:g}s",
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        "http2_protocol_options": {"max_concurrent_streams": limits.max_streams_per_connection},
    }


def _listener(settings: EdgeSettings) -> dict[str, Any]:
    chain: dict[str, Any] = {
        "filters": [
            {
                "name": "envoy.filters.network.connection_limit",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.network.connection_limit.v3.ConnectionLimit",
                    "stat_prefix": "edge_connections",
                    "max_connections": settings.limits.max_connections,
                },
            },
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": _connection_manager(settings),
            },
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
        # Each new connection goes to the worker with the fewest: a client's few
        # long-lived HTTP/2 connections otherwise land where the kernel's hash puts
        # them (3 and 1 of 4, say), and one worker carries most of the load while
        # the other waits (docs/performance.md).
        "connection_balance_config": {"exact_balance": {}},
        "filter_chains": [chain],
        "per_connection_buffer_limit_bytes": settings.limits.connection_buffer_bytes,
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
    if settings.orchestrator_wire:
        clusters.append(
            _cluster(WIRE_CLUSTER, settings.orchestrator_wire, http2=False, health=None)
        )
    if settings.otlp_endpoint:
        clusters.append(_cluster("otlp", settings.otlp_endpoint, http2=True, health=None))
    if settings.trace_store:
        clusters.append(_cluster("tracestore", settings.trace_store, http2=False, health=None))
    listeners = [_listener(settings), *_torchserve_listener(settings)]
    if settings.metrics:
        clusters.append(stats.admin_cluster(settings.admin_socket))
        listeners.append(stats.stats_listener(_address(settings.metrics)))
    bootstrap = {
        # Admin (drain, stats, quit) only for this user, never over TCP.
        "admin": {"address": {"pipe": {"path": str(settings.admin_socket), "mode": 0o600}}},
        "overload_manager": _overload(settings),
        "static_resources": {
            "listeners": listeners,
            "clusters": secure(clusters, settings.upstream_tls),
        },
    }
    bootstrap["layered_runtime"] = {"layers": _runtime_layers(settings)}
    return bootstrap


def _runtime_layers(settings: EdgeSettings) -> list[dict[str, Any]]:
    """Settings Envoy reads from its runtime rather than from its config."""
    # Envoy's default of 500 closes the connection of a client whose calls are
    # mostly cancelled or past their deadline, and with it every call in flight
    # on it: a client that cancels as it types, or one whose deadlines pass under
    # load, is not an attack. The guard stays, later; nghttp2's own limit on
    # resets would close such a client's connection sooner (docs/envoy.md).
    limits: dict[str, Any] = {
        "overload.premature_reset_total_stream_count": settings.limits.premature_reset_streams,
        "envoy.reloadable_features.http2_use_oghttp2": settings.limits.http2_codec == "oghttp2",
    }
    layers = [{"name": "limits", "static_layer": limits}]
    if settings.otlp_endpoint:
        layers.append(span_flush_runtime())
    return layers


def _torchserve_listener(settings: EdgeSettings) -> list[dict[str, Any]]:
    if not settings.torchserve_management:
        return []
    address = _address(settings.torchserve_management)
    timeout = f"{settings.request_timeout_s:g}s"
    return [torchserve.management_listener(_listener(settings), address, timeout)]


def _overload(settings: EdgeSettings) -> dict[str, Any]:
    monitors = "envoy.resource_monitors"
    return {
        "refresh_interval": "0.1s",
        "resource_monitors": [
            {
                "name": f"{monitors}.global_downstream_max_connections",
                "typed_config": {
                    "@type": f"{_TYPES}.resource_monitors.downstream_connections.v3."
                    "DownstreamConnectionsConfig",
                    "max_active_downstream_connections": settings.limits.max_connections,
                },
            },
            # main.py writes 1 here when the drain is over: new requests get 503
            # (UNAVAILABLE, which clients retry), not a reset (CANCELLED).
            {
                "name": f"{monitors}.injected_resource",
                "typed_config": {
                    "@type": f"{_TYPES}.resource_monitors.injected_resource.v3."
                    "InjectedResourceConfig",
                    "filename": str(settings.shutdown_flag),
                },
            },
        ],
        "actions": [
            {
                "name": "envoy.overload_actions.stop_accepting_requests",
                "triggers": [
                    {"name": f"{monitors}.injected_resource", "threshold": {"value": 0.5}}
                ],
            }
        ],
    }
