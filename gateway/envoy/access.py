"""Who may call the edge, what they may call, and how often: Envoy's HTTP filters.

The order is the point: a request is authenticated (``jwt_authn``: 401), then
authorized (``rbac``: 403), and only then spends rate budget
(``local_ratelimit``: 429). Unauthenticated floods are refused before they
touch any bucket, so they cannot starve a valid client.

    jwt_authn        token verified; its claims go to dynamic metadata
    rbac             management calls need the admin role, the rest the user role
    local_ratelimit  one bucket per (route, client) plus a listener-wide ceiling

The client is the token's subject when auth is on, the peer address when it is
off. Claims are read from dynamic metadata, never from headers a caller could
send.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TYPES = "type.googleapis.com/envoy.extensions"
_JWT_FILTER = "envoy.filters.http.jwt_authn"
_PAYLOAD = "jwt_payload"

# Calls that change the mesh for everyone (Triton's management extensions).
_MANAGEMENT_GRPC = tuple(
    f"/inference.GRPCInferenceService/{method}"
    for method in (
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "LogSettings",
        "TraceSetting",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
    )
)
_MANAGEMENT_REST_PREFIXES = (
    "/v2/repository/models/",
    "/v2/logging",
    "/v2/systemsharedmemory/",
    "/v2/cudasharedmemory/",
    "/models",  # TorchServe's management API (its own listener: gateway/envoy/torchserve.py)
    "/api/v1/routes",  # traffic management: where every caller's requests go
    "/v1/load_lora_adapter",  # vLLM's adapter management (gateway/http/lora.py)
    "/v1/unload_lora_adapter",
    "/meshserve.v1.RouteService/",
)
_TRACE_SETTING = "/v2/(models/[^/]+(/versions/[^/]+)?/)?trace/setting"


@dataclass(frozen=True)
class Roles:
    """Which JWT claim carries a caller's roles, and the values that grant them."""

    claim: str = "roles"
    admin: str = "admin"
    user: str = "user"


@dataclass(frozen=True)
class JwtAuth:
    """JWT bearer tokens checked against a local JWKS file; roles None: any token may do all."""

    jwks_file: Path
    issuer: str = "meshserve-dev"
    audiences: tuple[str, ...] = ("meshserve",)
    roles: Roles | None = Roles()


@dataclass(frozen=True)
class RateLimit:
    """Token buckets refilled every second; 0 turns that bucket off."""

    global_rps: int = 0
    """The whole listener's ceiling."""
    client_rps: int = 0
    """Each client's budget on each route."""
    max_clients: int = 10_000
    """How many (route, client) buckets Envoy keeps; the least recently used go first."""


def _bucket(rps: int) -> dict[str, Any]:
    return {"max_tokens": rps, "tokens_per_fill": rps, "fill_interval": "1s"}


def route_rate_limits(route: str, auth: bool) -> list[dict[str, Any]]:
    """The descriptor a route's requests carry: (route, client)."""
    client: dict[str, Any] = (
        {
            "metadata": {
                "descriptor_key": "client",
                "metadata_key": {
                    "key": _JWT_FILTER,
                    "path": [{"key": _PAYLOAD}, {"key": "sub"}],
                },
                "source": "DYNAMIC",
            }
        }
        if auth
        else {"remote_address": {}}
    )
    route_key = {"generic_key": {"descriptor_key": "route", "descriptor_value": route}}
    return [{"actions": [route_key, client]}]


def _jwt(auth: JwtAuth) -> dict[str, Any]:
    return {
        "name": _JWT_FILTER,
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                "mesh": {
                    "issuer": auth.issuer,
                    "audiences": list(auth.audiences),
                    "local_jwks": {"filename": str(auth.jwks_file)},
                    "forward": False,
                    "payload_in_metadata": _PAYLOAD,
                }
            },
            "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "mesh"}}],
        },
    }


def _has_role(claim: str, role: str) -> dict[str, Any]:
    """The claim is a list that contains ``role``, or the string ``role`` itself."""
    path = [{"key": _PAYLOAD}, {"key": claim}]

    def matcher(value: dict[str, Any]) -> dict[str, Any]:
        metadata = {"filter": _JWT_FILTER, "path": path, "value": value}
        return {"sourced_metadata": {"metadata_matcher": metadata}}

    exact = {"string_match": {"exact": role}}
    return {
        "or_ids": {
            "ids": [matcher({"list_match": {"one_of": exact}}), matcher(exact)],
        }
    }


def _management() -> dict[str, Any]:
    # Matched after Envoy normalized the path (see the connection manager).
    def path(match: dict[str, Any]) -> dict[str, Any]:
        return {"url_path": {"path": match}}

    rules = [path({"exact": method, "ignore_case": True}) for method in _MANAGEMENT_GRPC]
    rules += [path({"prefix": p, "ignore_case": True}) for p in _MANAGEMENT_REST_PREFIXES]
    rules.append(path({"safe_regex": {"regex": _TRACE_SETTING}}))
    return {"or_rules": {"rules": rules}}


def _rbac(roles: Roles) -> dict[str, Any]:
    admin = _has_role(roles.claim, roles.admin)
    user = _has_role(roles.claim, roles.user)
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.rbac.v3.RBAC",
            "rules": {
                "action": "ALLOW",
                "policies": {
                    "admin": {"permissions": [{"any": True}], "principals": [admin]},
                    "user": {
                        "permissions": [{"not_rule": _management()}],
                        "principals": [user],
                    },
                },
            },
        },
    }


def _rate_limit(limit: RateLimit) -> dict[str, Any]:
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    config: dict[str, Any] = {
        "@type": f"{_TYPES}.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": "edge_rate_limit",
        "filter_enabled": always,
        "filter_enforced": always,
        "rate_limited_as_resource_exhausted": True,
        # Every request also spends from the listener's bucket: the global ceiling.
        "always_consume_default_token_bucket": True,
    }
    if limit.global_rps:
        config["token_bucket"] = _bucket(limit.global_rps)
    if limit.client_rps:
        config["max_dynamic_descriptors"] = limit.max_clients
        # An entry without a value is a wildcard: one bucket per distinct value.
        config["descriptors"] = [
            {"entries": [{"key": "route"}, {"key": key}], "token_bucket": _bucket(limit.client_rps)}
            for key in ("client", "remote_address")
        ]
    return {"name": "envoy.filters.http.local_ratelimit", "typed_config": config}


def access_filters(auth: JwtAuth | None, limit: RateLimit | None) -> list[dict[str, Any]]:
    """authenticate, authorize, then rate-limit: in that order."""
    filters: list[dict[str, Any]] = []
    if auth is not None:
        filters.append(_jwt(auth))
        if auth.roles is not None:
            filters.append(_rbac(auth.roles))
    if limit is not None and (limit.global_rps or limit.client_rps):
        filters.append(_rate_limit(limit))
    return filters
