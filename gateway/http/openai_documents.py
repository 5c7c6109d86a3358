"""OpenAI request JSON <-> meshserve.v1 messages, and the OpenAI response documents.

Requests are checked here so a client gets a 400 that names the field
(``error.param``). Accepted beyond OpenAI's fields, as vLLM does: ``top_k``,
``repetition_penalty``, ``stop_token_ids``. Fields the mesh cannot honour
(``n`` > 1, frequency/presence penalties, logprobs, tools, ``echo``, ...) are
refused with ``unsupported_parameter`` unless they carry their neutral value;
fields that do not change the answer (``user``, ``metadata``, ...) and unknown
ones are ignored, as vLLM ignores them. vLLM's ``/tokenize`` and ``/detokenize``
bodies are read here too.

Nothing here knows aiohttp or gRPC: functions take dicts and protos.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshserve.v1 import meshserve_pb2 as api
from shared.errors import InvalidArgument, Unavailable

DEFAULT_LLM = "llm"
DEFAULT_EMBEDDER = "text_embedding"
_INT32 = 2**31 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Field -> the values that ask for nothing this server lacks.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
# vLLM's /tokenize fields the mesh's tokenizer step does not take, and their neutral values.
_TOKENIZE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "return_token_strs": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
}
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


class InvalidParam(InvalidArgument):
    """A request field is wrong; ``param`` names it in the OpenAI error body."""

    def __init__(self, param: str, message: str, error_code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.error_code = error_code


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


def kind(value: Any) -> str:
    """The JSON type name of a parsed value, for error messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParam(name, f"expected a number, got {kind(value)}")
    if not low <= value <= high:
        raise InvalidParam(name, f"must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: int = _INT32) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"expected an integer, got {kind(value)}")
    if not low <= value <= high:
        raise InvalidParam(name, f"must be between {low} and {high}, got {value}")
    return value


def _strings(body: Mapping[str, Any], name: str) -> list[str]:
    value = body.get(name)
    values = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise InvalidParam(name, "expected a non-empty string or a list of non-empty strings")
    return values


def _reject_unsupported(
    body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]] = _NEUTRAL
) -> None:
    for name, neutral in table.items():
        value = body.get(name)
        if not any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral):
            accepted = ", ".join(json.dumps(n) for n in neutral[1:])
            message = f"not supported by this server (accepted: {accepted})"
            raise InvalidParam(name, message, "unsupported_parameter")


def sampling_params(body: Mapping[str, Any]) -> api.SamplingParams:
    """The sampling fields of a (chat) completion request."""
    _reject_unsupported(body)
    params = api.SamplingParams(stop=_strings(body, "stop"))
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _INT32 for i in ids
    ):
        raise InvalidParam("stop_token_ids", "expected a list of token ids (integers >= 0)")
    params.stop_token_ids.extend(ids)
    floats = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.01, 10.0),
    }
    if floats["top_p"] == 0.0:
        raise InvalidParam("top_p", "must be greater than 0")
    limit = _integer(body, "max_tokens", 1)
    ints = {
        # max_completion_tokens is the newer name; it wins when both are sent.
        "max_tokens": _integer(body, "max_completion_tokens", 1) or limit,
        "top_k": _integer(body, "top_k", -1),
        "seed": _integer(body, "seed", -_INT32 - 1),
    }
    for name, value in {**floats, **ints}.items():
        if value is not None:
            setattr(params, name, value)
    return params


def _model(body: Mapping[str, Any], default: str) -> str:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParam("model", f"expected a string, got {kind(model)}")
    return model or default


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidParam(where, f"expected a string or a list of text parts, got {kind(value)}")
    texts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise InvalidParam(f"{where}[{i}]", "only parts of type 'text' are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidParam(f"{where}[{i}].text", "expected a string")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(value: Any) -> list[api.ChatMessage]:
    """OpenAI ``messages`` (string or text-part content) as ChatMessages."""
    if not isinstance(value, list) or not value:
        raise InvalidParam("messages", "expected a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidParam(where, f"expected an object, got {kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidParam(f"{where}.role", f"expected one of {sorted(_ROLES)}, got {role!r}")
        if "content" not in message:
            raise InvalidParam(f"{where}.content", "required")
        content = _content(message["content"], f"{where}.content")
        messages.append(api.ChatMessage(role=_ROLES[role], content=content))
    return messages


def _streaming(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise InvalidParam("stream", f"expected a boolean, got {kind(stream)}")
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool):
        raise InvalidParam("stream_options", "expected an object with boolean include_usage")
    return stream, usage


def chat_request(body: Mapping[str, Any]) -> tuple[api.ChatRequest, Generation]:
    """A ``/v1/chat/completions`` body as a ChatRequest and its answer's bookkeeping."""
    model = _model(body, DEFAULT_LLM)
    message = api.ChatRequest(
        messages=chat_messages(body.get("messages")), model=model, sampling=sampling_params(body)
    )
    return message, Generation(True, model, *_streaming(body))


def completion_request(body: Mapping[str, Any]) -> tuple[api.GenerateRequest, Generation]:
    """A ``/v1/completions`` body (one prompt string) as a GenerateRequest."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        problem = "expected one non-empty string (token arrays and batches are not supported)"
        raise InvalidParam("prompt", problem)
    model = _model(body, DEFAULT_LLM)
    message = api.GenerateRequest(prompt=prompt, model=model, sampling=sampling_params(body))
    return message, Generation(False, model, *_streaming(body))


def embed_request(body: Mapping[str, Any]) -> tuple[api.EmbedRequest, str, int | None]:
    """A ``/v1/embeddings`` body as an EmbedRequest, the encoding and dimensions asked for."""
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        problem = "expected a string or a list of strings (token arrays are not supported)"
        raise InvalidParam("input", problem)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidParam("encoding_format", f"expected 'float' or 'base64', got {encoding!r}")
    request = api.EmbedRequest(texts=texts, model=_model(body, DEFAULT_EMBEDDER))
    return request, encoding, _integer(body, "dimensions", 1)


def tokenize_request(body: Mapping[str, Any]) -> api.TokenizeRequest:
    """A vLLM ``/tokenize`` body (a ``prompt`` or chat ``messages``) as a TokenizeRequest."""
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise InvalidParam("prompt", "send exactly one of prompt and messages")
    # The ids are the pipeline's, as it feeds its engine: vLLM's defaults are
    # what it does; asking for anything else is refused, not ignored.
    _reject_unsupported(body, {**_TOKENIZE_NEUTRAL, "add_special_tokens": (None, not chat)})
    model = _model(body, DEFAULT_LLM)
    if chat:
        return api.TokenizeRequest(model=model, messages=chat_messages(body["messages"]))
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise InvalidParam("prompt", "expected a non-empty string")
    return api.TokenizeRequest(model=model, prompt=prompt)


def detokenize_request(body: Mapping[str, Any]) -> api.DetokenizeRequest:
    """A vLLM ``/detokenize`` body (``tokens``) as a DetokenizeRequest."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32 for t in tokens
    ):
        raise InvalidParam("tokens", "expected a list of token ids (integers >= 0)")
    return api.DetokenizeRequest(model=_model(body, DEFAULT_LLM), tokens=tokens)


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
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

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
