"""OpenAI request JSON <-> meshserve.v1 messages, and the OpenAI response documents.

Request bodies are checked by their protocol classes (``openai_protocol``),
so a client gets a 400 that names the field (``error.param``); here they
become meshserve.v1 requests. Accepted beyond OpenAI's fields, as vLLM does:
``top_k``, ``repetition_penalty``, ``stop_token_ids``. vLLM's ``/tokenize``
and ``/detokenize`` bodies are read here too.

Nothing here knows aiohttp or gRPC: functions take dicts and protos.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.http.openai_protocol import (
    DEFAULT_EMBEDDER,
    DEFAULT_LLM,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InvalidParam,
    TokenizeRequest,
    kind,
    parse,
)
from meshserve.v1 import meshserve_pb2 as api
from shared.errors import Unavailable
from shared.trace_ids import current_trace_id

__all__ = ["DEFAULT_EMBEDDER", "DEFAULT_LLM", "InvalidParam", "kind"]

# The OpenAI error "type" for an HTTP status (the status itself comes from shared.errors).
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_document(status: int, message: str, exc: BaseException | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {message, type, param, code}}``."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": getattr(exc, "param", None),
            "code": getattr(exc, "error_code", None),
        }
    }


# --- request JSON -> MeshService requests (pure) --------------------------------------


def chat_request(body: Mapping[str, Any]) -> tuple[api.ChatRequest, Generation]:
    """A ``/v1/chat/completions`` body as a ChatRequest and its answer's bookkeeping."""
    request = parse(ChatCompletionRequest, body)
    model = request.model or DEFAULT_LLM
    message = api.ChatRequest(messages=request.messages, model=model, sampling=request.sampling())
    return message, Generation(True, model, request.stream, request.stream_options)


def completion_request(body: Mapping[str, Any]) -> tuple[api.GenerateRequest, Generation]:
    """A ``/v1/completions`` body (one prompt string) as a GenerateRequest."""
    request = parse(CompletionRequest, body)
    model = request.model or DEFAULT_LLM
    message = api.GenerateRequest(prompt=request.prompt, model=model, sampling=request.sampling())
    return message, Generation(False, model, request.stream, request.stream_options)


def embed_request(body: Mapping[str, Any]) -> tuple[api.EmbedRequest, str, int | None]:
    """A ``/v1/embeddings`` body as an EmbedRequest, the encoding and dimensions asked for."""
    request = parse(EmbeddingRequest, body)
    message = api.EmbedRequest(texts=request.input, model=request.model or DEFAULT_EMBEDDER)
    return message, request.encoding_format, request.dimensions


def tokenize_request(body: Mapping[str, Any]) -> api.TokenizeRequest:
    """A vLLM ``/tokenize`` body (a ``prompt`` or chat ``messages``) as a TokenizeRequest."""
    if ("messages" in body) == ("prompt" in body):
        raise InvalidParam("prompt", "send exactly one of prompt and messages")
    return parse(TokenizeRequest, body).message()


def detokenize_request(body: Mapping[str, Any]) -> api.DetokenizeRequest:
    """A vLLM ``/detokenize`` body (``tokens``) as a DetokenizeRequest."""
    request = parse(DetokenizeRequest, body)
    return api.DetokenizeRequest(model=request.model or DEFAULT_LLM, tokens=request.tokens)


def tokenize_document(response: api.TokenizeResponse) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer."""
    tokens = list(response.tokens)
    return {
        "count": len(tokens),
        "max_model_len": response.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


# --- TextDeltas -> OpenAI documents (pure) ----------------------------------------------


@dataclass
class Generation:
    """One chat or text completion being answered: its id and running token counts."""

    chat: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        # The request's trace id (the same 32 hex digits as a uuid): the id finds the trace.
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{current_trace_id() or uuid.uuid4().hex}"

    def absorb(self, delta: api.TextDelta) -> str | None:
        """Count ``delta``'s tokens; its finish reason, if it is the last one."""
        self.prompt_tokens = max(self.prompt_tokens, delta.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, delta.completion_tokens)
        if delta.finish_reason == "abort":
            raise Unavailable("the generation was aborted by the server; retry the request")
        return delta.finish_reason or None

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def document(self, text: str, finish: str) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(False), "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        """One streamed chunk: ``text`` (None: the role chunk, or the finish chunk)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if not self.chat:
            choice["text"] = text or ""
        elif finish is not None:
            choice["delta"] = {}
        else:
            role = {"role": "assistant", "content": ""}
            choice["delta"] = role if text is None else {"content": text}
        document = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            document["usage"] = None
        return document

    def chunks(self, delta: api.TextDelta) -> list[dict[str, Any]]:
        """The chunks one TextDelta becomes: its text, then the finish chunk if last."""
        finish = self.absorb(delta)
        out = [self.chunk(delta.text)] if delta.text else []
        return [*out, self.chunk(None, finish)] if finish else out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage()}


def models_document(response: api.ListModelsResponse) -> dict[str, Any]:
    """The pipelines (ready ensembles) as OpenAI's model list."""
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "meshserve"}
        for m in response.models
        if m.state == api.MODEL_STATE_READY and m.backend == "ensemble"
    ]
    return {"object": "list", "data": data}


def embeddings_document(
    response: api.EmbedResponse, encoding: str, dimensions: int | None
) -> dict[str, Any]:
    """An EmbedResponse as OpenAI's list of ``embedding`` objects."""
    if dimensions is not None and dimensions != response.dimensions:
        raise InvalidParam(
            "dimensions", f"model '{response.model}' returns {response.dimensions} dimensions"
        )
    data = []
    for index, embedding in enumerate(response.embeddings):
        vector: Any = list(embedding.values)
        if encoding == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    # The embedding pipeline does not report token counts.
    usage = {"prompt_tokens": 0, "total_tokens": 0}
    return {"object": "list", "data": data, "model": response.model, "usage": usage}
