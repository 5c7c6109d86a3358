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
from collections.abc import Mapping
from typing import Any

import numpy as np

from gateway.http import openai_fields as fields
from gateway.http.openai_answer import Choices, Generation
from gateway.http.openai_protocol import (
    DEFAULT_EMBEDDER,
    DEFAULT_LLM,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InvalidParam,
    TokenizeRequest,
    parse,
)
from meshserve.v1 import meshserve_pb2 as api
from shared.jsontext import kind

__all__ = ["DEFAULT_EMBEDDER", "DEFAULT_LLM", "Choices", "Generation", "InvalidParam", "kind"]

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


def _sampling(request: ChatCompletionRequest | CompletionRequest, body: Mapping[str, Any]) -> Any:
    """The request's SamplingParams with the fields openai_fields checks."""
    sampling = request.sampling()
    if sampling.n > 1 and sampling.HasField("temperature") and sampling.temperature == 0:
        raise InvalidParam("n", f"must be 1 when using greedy sampling, got {sampling.n}")
    sampling.logit_bias.update(fields.logit_bias(request.logit_bias))
    structured = (
        fields.response_format(request.response_format)
        or fields.structured_outputs(request.structured_outputs)
        or fields.guided(dict(body))
    )
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    return sampling


def chat_request(body: Mapping[str, Any]) -> tuple[api.ChatRequest, Generation]:
    """A ``/v1/chat/completions`` body as a ChatRequest and its answer's bookkeeping."""
    request = parse(ChatCompletionRequest, body)
    model = request.model or DEFAULT_LLM
    sampling = _sampling(request, body)
    if request.top_logprobs and not request.logprobs:
        raise InvalidParam("top_logprobs", "needs logprobs: true")
    if request.logprobs:
        sampling.logprobs = request.top_logprobs or 0
    tools = fields.tools(request.tools)
    fields.tool_choice(request.tool_choice, bool(tools))
    message = api.ChatRequest(
        messages=request.messages, model=model, sampling=sampling, tools=tools
    )
    generation = Generation(
        True,
        model,
        request.stream,
        request.n or 1,
        fields.stream_options(request.stream_options),
        logprobs=sampling.logprobs if request.logprobs else None,
    )
    return message, generation


def completion_request(body: Mapping[str, Any]) -> tuple[api.GenerateRequest, Generation]:
    """A ``/v1/completions`` body (one prompt string) as a GenerateRequest."""
    request = parse(CompletionRequest, body)
    model = request.model or DEFAULT_LLM
    sampling = _sampling(request, body)
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        problem = f"only best_of equal to n ({n}) is supported (every choice is returned)"
        raise InvalidParam("best_of", problem, "unsupported_parameter")
    if request.logprobs is not None:
        sampling.logprobs = request.logprobs
    if request.echo and request.logprobs is not None:
        problem = "echo with logprobs (the prompt's logprobs) is not supported"
        raise InvalidParam("echo", problem, "unsupported_parameter")
    generate = api.GenerateRequest(prompt=request.prompt, model=model, sampling=sampling)
    generation = Generation(
        False,
        model,
        request.stream,
        n,
        fields.stream_options(request.stream_options),
        logprobs=request.logprobs,
        echo=request.prompt if request.echo else "",
    )
    return generate, generation


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


def models_document(response: api.ListModelsResponse) -> dict[str, Any]:
    """The pipelines (ready ensembles) as OpenAI's model list; a LoRA adapter's
    names its ``parent``, as vLLM's does."""
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "meshserve"}
        | ({"parent": m.parent} if m.parent else {})
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
