"""The aiohttp application: KServe v2 REST and OpenAI routes over the orchestrator.

Handlers are translation only (path -> proto request -> a typed ``Upstream``
call -> JSON document). What every route shares (metrics, the server span,
the error map, the drain gate) is a list of middlewares, one concern each
(``middleware.py``); handlers raise ``shared.errors`` and never build an
error answer themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.http import batches, documents, generate, middleware, openai, rest, route_headers, sse
from gateway.http.lora import LoraApi
from gateway.http.torchserve import TorchServeApi
from gateway.http.torchserve_management import TorchServeManagement
from gateway.http.torchserve_store import ModelStore
from gateway.http.upstream import MeshClient, Upstream
from inference import grpc_service_pb2 as pb
from shared.errors import MeshError, Unimplemented
from shared.protojson import to_json

log = logging.getLogger(__name__)

T = TypeVar("T")

# Bodies up to this size are parsed and rendered on the event loop; larger
# ones in a worker thread, so one big tensor does not stall every other call.
_INLINE_BYTES = 256 * 1024


@dataclass
class AdapterState:
    """What the handlers share: the orchestrator client, limits, drain flag, metrics."""

    upstream: Upstream
    tracer: trace.Tracer
    max_body_bytes: int
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    draining: bool = False
    streams: sse.Streams = field(default_factory=sse.Streams)
    """The SSE answers in flight; shutdown cuts those that outlive the grace period."""
    model_store: ModelStore = field(default_factory=ModelStore)
    """TorchServe's model store and the repository its management API writes into."""

    def __post_init__(self) -> None:
        self.requests = Counter(
            "meshserve_http_requests",
            "HTTP requests answered, by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "meshserve_http_request_duration_seconds",
            "Time from request received to response ready",
            ["method", "route"],
            registry=self.registry,
        )


STATE = web.AppKey("state", AdapterState)


async def _offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size <= _INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _json(document: Any, status: int = 200) -> web.Response:
    return web.json_response(document, status=status)


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["name"], request.match_info.get("version", "")


def _too_large(limit: int) -> rest.PayloadTooLarge:
    # Built when needed only: an exception object per request is measurable.
    return rest.PayloadTooLarge(
        f"request body exceeds {limit} bytes (max_body_bytes of the HTTP adapter)"
    )


async def _read_body(request: web.Request) -> bytes:
    """The request body, size-checked and with its Content-Encoding undone."""
    limit = request.app[STATE].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    encoding = request.headers.get("Content-Encoding")
    return await _offload(len(body), rest.decode_body, body, encoding, limit)


def _upstream(request: web.Request) -> Upstream:
    return request.app[STATE].upstream


def _readiness(ready: bool, reason: str) -> web.Response:
    # The spec answers "not ready" with a 4xx; Triton uses 400.
    return _json({"ready": True}) if ready else _json({"ready": False, "error": reason}, 400)


async def server_live(request: web.Request) -> web.Response:
    """GET /v2/health/live: this process is up (the orchestrator may not be)."""
    return _json({"live": True})


async def server_ready(request: web.Request) -> web.Response:
    """GET /v2/health/ready: the orchestrator is ready and this adapter not draining."""
    if request.app[STATE].draining:
        return _readiness(False, "the HTTP adapter is shutting down")
    try:
        answer = await _upstream(request).server_ready()
    except MeshError as exc:
        return _readiness(False, exc.message)
    return _readiness(answer.ready, "the orchestrator is not ready")


async def vllm_health(request: web.Request) -> web.Response:
    """GET /health, as vLLM's server answers it: 200 with no body when the mesh
    can serve (a vLLM user's probes keep their path), else 503 with the reason."""
    answer = await server_ready(request)
    if answer.status == 200:
        return web.Response(status=200)
    return web.Response(status=503, body=answer.body, content_type="application/json")


async def server_metadata(request: web.Request) -> web.Response:
    """GET /v2."""
    answer = await _upstream(request).server_metadata()
    return _json(to_json(answer))


async def model_metadata(request: web.Request) -> web.Response:
    """GET /v2/models/{name}[/versions/{version}]."""
    name, version = _model(request)
    answer = await _upstream(request).model_metadata(
        pb.ModelMetadataRequest(name=name, version=version)
    )
    return _json(to_json(answer))


async def model_ready(request: web.Request) -> web.Response:
    """GET /v2/models/{name}[/versions/{version}]/ready."""
    name, version = _model(request)
    answer = await _upstream(request).model_ready(pb.ModelReadyRequest(name=name, version=version))
    return _readiness(answer.ready, f"model '{name}' is not ready")


async def model_config(request: web.Request) -> web.Response:
    """GET /v2/models/{name}[/versions/{version}]/config."""
    name, version = _model(request)
    answer = await _upstream(request).model_config(
        pb.ModelConfigRequest(name=name, version=version)
    )
    return _json(documents.model_config(answer))


async def model_statistics(request: web.Request) -> web.Response:
    """GET /v2/models[/{name}[/versions/{version}]]/stats."""
    name = request.match_info.get("name", "")
    message = pb.ModelStatisticsRequest(name=name, version=request.match_info.get("version", ""))
    answer = await _upstream(request).model_statistics(message)
    return _json(to_json(answer))


async def repository_index(request: web.Request) -> web.Response:
    """POST /v2/repository/index."""
    message = documents.index_request(await _read_body(request))
    answer = await _upstream(request).repository_index(message)
    return _json(documents.repository_index(answer))


async def model_load(request: web.Request) -> web.Response:
    """POST /v2/repository/models/{name}/load."""
    message = documents.load_request(request.match_info["name"], await _read_body(request))
    await _upstream(request).load(message)
    return _json({})


async def model_unload(request: web.Request) -> web.Response:
    """POST /v2/repository/models/{name}/unload."""
    message = documents.unload_request(request.match_info["name"], await _read_body(request))
    await _upstream(request).unload(message)
    return _json({})


async def log_settings(request: web.Request) -> web.Response:
    """GET (read) or POST (change) /v2/logging: the orchestrator's log settings."""
    body = await _read_body(request) if request.method == "POST" else b""
    answer = await _upstream(request).log_settings(documents.log_settings_request(body))
    return _json(documents.log_settings(answer))


async def trace_settings(request: web.Request) -> web.Response:
    """GET (read) or POST (change) /v2[/models/{name}]/trace/setting."""
    body = await _read_body(request) if request.method == "POST" else b""
    message = documents.trace_settings_request(request.match_info.get("name", ""), body)
    answer = await _upstream(request).trace_setting(message)
    return _json(documents.trace_settings(answer))


async def region_status(request: web.Request) -> web.Response:
    """GET /v2/systemsharedmemory[/region/{region}]/status."""
    message = pb.SystemSharedMemoryStatusRequest(name=request.match_info.get("region", ""))
    answer = await _upstream(request).region_status(message)
    return _json(documents.region_status(answer))


async def region_register(request: web.Request) -> web.Response:
    """POST /v2/systemsharedmemory/region/{region}/register."""
    body = await _read_body(request)
    message = documents.region_register_request(request.match_info["region"], body)
    await _upstream(request).region_register(message)
    return _json({})


async def region_unregister(request: web.Request) -> web.Response:
    """POST /v2/systemsharedmemory[/region/{region}]/unregister."""
    message = pb.SystemSharedMemoryUnregisterRequest(name=request.match_info.get("region", ""))
    await _upstream(request).region_unregister(message)
    return _json({})


async def cuda_shared_memory(request: web.Request) -> web.Response:
    """/v2/cudasharedmemory/...: not served (tensors on a GPU travel in the body)."""
    raise Unimplemented(
        "CUDA shared memory is not supported by meshserve; send tensors in the request "
        "body or in system shared memory"
    )


async def infer(request: web.Request) -> web.Response:
    """POST /v2/models/{name}[/versions/{version}]/infer: JSON or binary tensors."""
    name, version = _model(request)
    body = await _read_body(request)
    header_length = request.headers.get(rest.HEADER_LENGTH)
    call = await _offload(len(body), rest.parse_infer, name, version, body, header_length)
    route_headers.take(request.headers, call.request)
    answer = await _upstream(request).model_infer(call.request)
    size = sum(len(raw) for raw in answer.raw_output_contents)
    payload, json_length = await _offload(size, rest.render_infer, call, answer)
    if json_length is None:
        response = web.Response(body=payload, content_type="application/json")
    else:
        response = web.Response(body=payload, content_type="application/octet-stream")
        response.headers[rest.HEADER_LENGTH] = str(json_length)
    route_headers.announce(answer, response.headers)
    # Compressed only when the caller asks (Accept-Encoding: gzip or deflate).
    response.enable_compression()
    return response


def build_app(state: AdapterState) -> web.Application:
    """The routes of the KServe v2 REST API (with Triton's extensions, generate among
    them) and the OpenAI API."""
    layers = [
        middleware.measuring(state.requests, state.latency),
        middleware.tracing(state.tracer),
        middleware.errors,
        middleware.drain_gate(lambda: state.draining),
    ]
    app = web.Application(middlewares=layers, client_max_size=state.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(middleware.identify)
    app[sse.STREAMS] = state.streams
    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    app.router.add_get("/v2/health/live", server_live)
    app.router.add_get("/v2/health/ready", server_ready)
    app.router.add_get("/v2", server_metadata)
    app.router.add_get("/health", vllm_health)
    # Before {name}: "stats" is the all-models statistics route, not a model.
    app.router.add_get("/v2/models/stats", model_statistics)
    for prefix in (model, version):
        app.router.add_get(prefix, model_metadata)
        app.router.add_get(prefix + "/ready", model_ready)
        app.router.add_get(prefix + "/config", model_config)
        app.router.add_get(prefix + "/stats", model_statistics)
        app.router.add_post(prefix + "/infer", infer)
    app.router.add_route("GET", "/v2/logging", log_settings)
    app.router.add_route("POST", "/v2/logging", log_settings)
    for path in ("/v2/trace/setting", model + "/trace/setting"):
        app.router.add_route("GET", path, trace_settings)
        app.router.add_route("POST", path, trace_settings)
    for region in ("", "/region/{region}"):
        app.router.add_get(f"/v2/systemsharedmemory{region}/status", region_status)
        app.router.add_post(f"/v2/systemsharedmemory{region}/unregister", region_unregister)
        app.router.add_get(f"/v2/cudasharedmemory{region}/status", cuda_shared_memory)
        app.router.add_post(f"/v2/cudasharedmemory{region}/unregister", cuda_shared_memory)
    app.router.add_post("/v2/systemsharedmemory/region/{region}/register", region_register)
    app.router.add_post("/v2/cudasharedmemory/region/{region}/register", cuda_shared_memory)
    app.router.add_post("/v2/repository/index", repository_index)
    app.router.add_post("/v2/repository/models/{name}/load", model_load)
    app.router.add_post("/v2/repository/models/{name}/unload", model_unload)
    generate.GenerateApi(state.upstream, _read_body).add_routes(app.router)
    openai.OpenAIApi(MeshClient(state.upstream), _read_body).add_routes(app.router)
    LoraApi(state.upstream, _read_body).add_routes(app.router)  # vLLM's adapter paths
    TorchServeApi(state.upstream, _read_body, state.model_store).add_routes(app.router)
    management = TorchServeManagement(state.upstream, state.model_store)
    management.add_routes(app.router)  # Envoy exposes these on their own listener
    app.on_cleanup.append(lambda _: management.close())
    batches.mount(app)
    return app
