"""TorchServe's inference API over the mesh: ``/predictions``, ``/explanations``, ``/ping``.

A client written for TorchServe keeps its calls (``curl -T kitten.jpg
http://host/predictions/resnet``): the body becomes the ``body`` BYTES input of
a v2 request to the model (a model folder written from a .mar, served by the
``torchserve`` backend), the request's headers travel as ``header:<name>``
parameters (the handler reads them with ``context.get_request_header``), and
the handler's answer comes back as it sent it, with its content type and
status. ``/explanations`` is the same call with TorchServe's ``explain``
header set, so a handler's ``explain_handle`` answers it. A version in the
path is TorchServe's version (``1.0``), mapped to the model's version folder;
without one the model's default version answers.

Errors have TorchServe's shape, ``{"code", "type", "message"}``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web

from gateway.http.torchserve_store import ModelStore
from gateway.http.upstream import Upstream
from inference import grpc_service_pb2 as pb
from services.inference.torchserve import CONTENT_TYPE, HEADER_PREFIX, STATUS
from services.inference.torchserve_archive import INPUT, OUTPUT
from shared.errors import InvalidArgument, MeshError
from shared.tensors import decode_outputs, encode_inputs, parameter_value

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BodyReader = Callable[[web.Request], Awaitable[bytes]]

# Headers a handler never needs (hop-by-hop, or the mesh's own).
_SKIPPED_HEADERS = frozenset(
    {"host", "connection", "content-length", "transfer-encoding", "authorization", "expect"}
)
_ERROR_TYPES = {
    400: "BadRequestException",
    404: "ModelNotFoundException",
    409: "ConflictStatusException",
    429: "ServiceUnavailableException",
    500: "InternalServerException",
    501: "MethodNotAllowedException",
    503: "ServiceUnavailableException",
    504: "RequestTimeoutException",
}


def ts_error(status: int, message: str) -> web.Response:
    """An error answer in TorchServe's shape."""
    kind = _ERROR_TYPES.get(status, "InternalServerException")
    return web.json_response({"code": status, "type": kind, "message": message}, status=status)


def torchserve_errors(handler: Handler) -> Handler:
    """MeshErrors raised by ``handler`` as TorchServe's error documents."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except MeshError as exc:
            return ts_error(exc.http_status, exc.message)

    return wrapped


def _headers(request: web.Request) -> dict[str, str]:
    return {
        key.lower(): value
        for key, value in request.headers.items()
        if key.lower() not in _SKIPPED_HEADERS
    }


async def _body(request: web.Request, read_body: BodyReader) -> tuple[bytes, dict[str, str]]:
    """The request's data: the raw body, or a form's first field (TorchServe's
    ``data`` field in ``curl -F data=@kitten.jpg``), with its headers."""
    headers = _headers(request)
    if request.content_type.startswith("multipart/form-data"):
        form = await request.post()
        field = form.get("data") or next(iter(form.values()), None)
        if field is None:
            raise InvalidArgument("the form has no field; send the input as field 'data'")
        if isinstance(field, web.FileField):
            headers["content-type"] = field.content_type
            return field.file.read(), headers
        return str(field).encode(), headers
    return await read_body(request), headers


class TorchServeApi:
    """The inference API's routes."""

    def __init__(self, upstream: Upstream, read_body: BodyReader, store: ModelStore) -> None:
        self.upstream = upstream
        self.read_body = read_body
        self.store = store

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register the routes on ``router``."""
        router.add_get("/ping", torchserve_errors(self.ping))
        for path in ("/predictions/{name}", "/predictions/{name}/{version}"):
            router.add_post(path, torchserve_errors(self.predict))
            router.add_put(path, torchserve_errors(self.predict))
        for path in ("/explanations/{name}", "/explanations/{name}/{version}"):
            router.add_post(path, torchserve_errors(self.explain))

    async def ping(self, request: web.Request) -> web.Response:
        """GET /ping: Healthy when the mesh can serve."""
        try:
            ready = (await self.upstream.server_ready()).ready
        except MeshError:
            ready = False
        if ready:
            return web.json_response({"status": "Healthy"})
        return web.json_response({"status": "Unhealthy"}, status=500)

    async def predict(self, request: web.Request) -> web.Response:
        """POST|PUT /predictions/{name}[/{version}]: the handler's answer."""
        return await self._call(request, explain=False)

    async def explain(self, request: web.Request) -> web.Response:
        """POST /explanations/{name}[/{version}]: the handler's explanation."""
        return await self._call(request, explain=True)

    async def _call(self, request: web.Request, explain: bool) -> web.Response:
        name = request.match_info["name"]
        folder = await self.store.version_folder(name, request.match_info.get("version", ""))
        body, headers = await _body(request, self.read_body)
        if explain:
            headers["explain"] = "True"
        message = pb.ModelInferRequest(model_name=name, model_version=folder)
        encode_inputs(message, {INPUT: np.array([[body]], dtype=np.object_)})
        for key, value in headers.items():
            message.parameters[HEADER_PREFIX + key].string_param = value
        answer = await self.upstream.model_infer(message)
        return _response(answer)


def _response(answer: pb.ModelInferResponse) -> web.Response:
    output = decode_outputs(answer).get(OUTPUT)
    if output is None or output.size != 1:
        raise InvalidArgument(f"the model's answer has no single '{OUTPUT}' element")
    body: Any = output.reshape(-1)[0]
    payload = body if isinstance(body, bytes) else str(body).encode()
    parameters = {key: parameter_value(value) for key, value in answer.parameters.items()}
    status = int(parameters.get(STATUS) or 200)
    content_type = str(parameters.get(CONTENT_TYPE) or "application/octet-stream")
    response = web.Response(body=payload, status=status)
    response.headers["Content-Type"] = content_type
    return response
