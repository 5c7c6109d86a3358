"""CORS at the edge: Envoy answers browsers' preflights for the origins in the mesh YAML.

Envoy alone (the real binary through ``gateway.envoy.main``, auth on), its
upstreams left unreachable: a preflight never reaches them, and a request the
edge refuses (401) must still reach an allowed page with CORS headers.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.envoy.config import build_config
from gateway.envoy.credentials import write_jwt_keys
from gateway.envoy.main import EdgeConfig, settings_from
from tests.harness import ServiceProcess

ALLOWED = "https://app.example.com"


def _edge(root: Path, *cors: str) -> ServiceProcess:
    jwks, _ = write_jwt_keys(root)
    origins = [arg for origin in cors for arg in ("--cors-origins", origin)]
    return ServiceProcess(
        "gateway.envoy.main",
        [
            "--orchestrator",
            "127.0.0.1:9",
            "--http-adapter",
            "127.0.0.1:9",
            "--jwks-file",
            str(jwks),
            "--access-log",
            "false",
            "--grace-period-s",
            "0.5",
            *origins,
        ],
    )


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    service = _edge(tmp_path_factory.mktemp("cors"), ALLOWED, "http://localhost:3000")
    yield service.address
    service.stop()


def _call(edge: str, method: str, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(edge, timeout=10)
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def _preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }


def test_a_preflight_from_an_allowed_origin_is_answered_by_the_edge(edge: str) -> None:
    for path in ("/v2/models/add_sub/infer", "/api/v1/embed", "/v1/chat/completions"):
        reply = _call(edge, "OPTIONS", path, _preflight(ALLOWED))
        assert reply.status == 200, path
        assert reply.headers["access-control-allow-origin"] == ALLOWED
        assert "POST" in reply.headers["access-control-allow-methods"]
        allowed_headers = reply.headers["access-control-allow-headers"]
        assert "authorization" in allowed_headers
        assert "content-type" in allowed_headers
        assert int(reply.headers["access-control-max-age"]) > 0
    second = _call(edge, "OPTIONS", "/v1/models", _preflight("http://localhost:3000", "GET"))
    assert second.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_an_origin_not_listed_gets_no_cors_headers(edge: str) -> None:
    for origin in ("https://evil.example.com", "https://app.example.com.evil.net"):
        reply = _call(edge, "OPTIONS", "/v2/models/add_sub/infer", _preflight(origin))
        assert "access-control-allow-origin" not in reply.headers, origin


def test_a_refused_request_still_reaches_the_allowed_page_with_cors_headers(edge: str) -> None:
    reply = _call(edge, "GET", "/v2/models", {"Origin": ALLOWED})
    assert reply.status == 401
    assert reply.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in reply.headers["access-control-expose-headers"]


def test_cors_is_off_unless_origins_are_configured(tmp_path: Path) -> None:
    # The generated config alone: no filter, no policy (a second Envoy would add seconds).
    settings = settings_from(EdgeConfig.model_validate({}), tmp_path)
    assert settings.cors_origins == ()
    text = json.dumps(build_config(settings))
    assert "envoy.filters.http.cors" not in text
    assert "CorsPolicy" not in text
    with pytest.raises(ValidationError, match="cors_origins"):
        EdgeConfig.model_validate({"cors_origins": ["app.example.com/path"]})
