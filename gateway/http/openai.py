"""The OpenAI-compatible API (``/v1/...``) over the orchestrator's ``meshserve.v1.MeshService``.

::

    POST /v1/chat/completions -> MeshService.Chat      (stream of TextDelta)
    POST /v1/completions      -> MeshService.Generate  (stream of TextDelta)
    POST /v1/embeddings       -> MeshService.Embed
    GET  /v1/models[/{model}] -> MeshService.ListModels (the ready pipelines)
    POST /tokenize            -> MeshService.Tokenize  (vLLM's paths and bodies)
    POST /detokenize          -> MeshService.Detokenize

Translation lives in ``openai_documents``; this module is the aiohttp and
gRPC side. Calls share the KServe v2 client's channels to the orchestrator,
so they carry the same ``traceparent`` and deadline. Errors are rendered by
the app's middleware, in OpenAI's shape for paths under ``/v1/`` and for
``/tokenize`` and ``/detokenize``.

Streams are SSE: ``data: {chunk}`` per text delta, ``data: [DONE]`` last.
The first delta is awaited before the response starts, so errors the
orchestrator raises up front (unknown model, prompt too long) keep their
HTTP status; later ones arrive as a ``data: {"error": ...}`` event. When
the client goes away, the gRPC call is cancelled and with it the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.http import sse
from gateway.http.openai_answer import Choices, Generation
from gateway.http.openai_documents import (
    InvalidParam,
    chat_request,
    completion_request,
    detokenize_request,
    embed_request,
    embeddings_document,
    error_document,
    models_document,
    tokenize_document,
    tokenize_request,
)
from gateway.http.upstream import MeshClient
from meshserve.v1 import meshserve_pb2 as api
from shared import jsontext
from shared.errors import InvalidArgument, MeshError, NotFound

PREFIX = "/v1/"
"""Paths under this prefix answer errors in OpenAI's shape..."""
VLLM_PATHS = frozenset({"/tokenize", "/detokenize"})
"""...and so do vLLM's own paths served here."""


def speaks_openai(path: str) -> bool:
    """Whether errors on ``path`` take OpenAI's shape."""
    return path.startswith(PREFIX) or path in VLLM_PATHS


NO_TOOL_FORMAT = "has no tool format"
"""How the tokenizer step says a chat template renders no tools."""

# Bodies up to this size are parsed on the event loop; larger ones in a thread.
_INLINE_BYTES = 256 * 1024

BodyReader = Callable[[web.Request], Awaitable[bytes]]


@dataclass
class _Chunks:
    """A streamed (chat) completion as SSE: its chunks, the usage if asked, ``[DONE]``."""

    generation: Generation
    trailer: bytes = sse.DONE

    def documents(self, delta: api.TextDelta) -> list[dict[str, Any]]:
        """The chunks of ``delta`` (a chat choice's first ones follow its role chunk)."""
        return self.generation.chunks(delta)

    def closing(self) -> list[dict[str, Any]]:
        """The usage chunk, when ``stream_options.include_usage``."""
        return [self.generation.usage_chunk()] if self.generation.include_usage else []

    def failed(self, error: MeshError) -> dict[str, Any]:
        """The error in OpenAI's shape."""
        return error_document(error.http_status, error.message, error)


async def _collect(
    generation: Generation, first: api.TextDelta, rest: AsyncIterator[api.TextDelta]
) -> web.Response:
    choices = Choices(generation)
    choices.add(first)
    async for delta in rest:
        choices.add(delta)
    return web.json_response(choices.document())


def _tools_refused(error: InvalidArgument) -> InvalidArgument:
    """The tokenizer step's refusal of tools, naming the field as OpenAI's errors do."""
    if NO_TOOL_FORMAT in error.message:
        # The step's words after its own "tools: " (the field is named once).
        words = error.message.split("tools: ", 1)[-1]
        return InvalidParam("tools", words, "unsupported_parameter")
    return error


class OpenAIApi:
    """The ``/v1`` route handlers: JSON body -> MeshService call -> OpenAI document."""

    def __init__(self, mesh: MeshClient, read_body: BodyReader) -> None:
        self.mesh = mesh
        self._read_body = read_body

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await self._read_body(request)
        if len(raw) > _INLINE_BYTES:
            return await asyncio.to_thread(jsontext.parse_object, raw)
        return jsontext.parse_object(raw)

    async def _generate(
        self,
        request: web.Request,
        stream: AsyncGenerator[api.TextDelta, None],
        generation: Generation,
    ) -> web.StreamResponse:
        # Leaving this block (done, failed, or cancelled when the client
        # disconnects) closes the stream, which cancels the RPC.
        async with contextlib.aclosing(stream) as deltas:
            # Errors raised before the first delta still get their own HTTP status.
            try:
                first = await anext(deltas, api.TextDelta(finish_reason="stop"))
            except InvalidArgument as exc:
                raise _tools_refused(exc) from exc
            if generation.stream:
                return await sse.respond(request, _Chunks(generation), first, deltas)
            return await _collect(generation, first, deltas)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        message, generation = chat_request(await self._body(request))
        return await self._generate(request, self.mesh.chat(message), generation)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        message, generation = completion_request(await self._body(request))
        return await self._generate(request, self.mesh.generate(message), generation)

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings."""
        message, encoding, dimensions = embed_request(await self._body(request))
        answer = await self.mesh.embed(message)
        return web.json_response(embeddings_document(answer, encoding, dimensions))

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models."""
        answer = await self.mesh.list_models(api.ListModelsRequest(ready_only=True))
        return web.json_response(models_document(answer))

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}."""
        answer = await self.mesh.list_models(api.ListModelsRequest(ready_only=True))
        name = request.match_info["model"]
        for model in models_document(answer)["data"]:
            if model["id"] == name:
                return web.json_response(model)
        raise NotFound(f"model '{name}' is not served here")

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (vLLM's): the ids an LLM pipeline makes of a prompt or chat."""
        answer = await self.mesh.tokenize(tokenize_request(await self._body(request)))
        return web.json_response(tokenize_document(answer))

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize (vLLM's): token ids back to text."""
        answer = await self.mesh.detokenize(detokenize_request(await self._body(request)))
        return web.json_response({"prompt": answer.text})

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Mount the routes under /v1, and vLLM's /tokenize and /detokenize."""
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/embeddings", self.embeddings)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model}", self.model)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)


def error_response(status: int, message: str, exc: BaseException | None = None) -> web.Response:
    """An error in OpenAI's shape (for the app's middleware)."""
    return web.json_response(error_document(status, message, exc), status=status)
