"""Triton's generate extension: text in, text out, for an LLM pipeline.

::

    POST /v2/models/{name}[/versions/{version}]/generate          one JSON answer
    POST /v2/models/{name}[/versions/{version}]/generate_stream   SSE, an event per text delta

A request is ``{"text_input": ..., "parameters": {...}}``, as Triton takes it,
and also reads the other inputs of Triton's vLLM backend, so its clients work
unchanged: sampling settings in ``parameters`` (temperature, top_p, top_k,
max_tokens, stop, stop_token_ids, seed, repetition_penalty, presence_penalty,
frequency_penalty, min_p, min_tokens, ignore_eos) or in the JSON
string ``sampling_parameters`` (``parameters`` wins; max_tokens is 16 unless
set, as there), and ``stream`` and
``exclude_input_in_output``, top-level or in ``parameters``. Other fields are
refused, naming them: a setting this server would drop silently is a bug
report waiting to happen.

As in the vLLM backend, a whole answer (``/generate``, or ``generate_stream``
with ``stream: false``) is the prompt followed by the generated text, unless
``exclude_input_in_output`` is true; streamed events carry only new text.
Every answer names the model and the version that ran (``text_output``,
``finish_reason`` and the token counts beside them).

The call is the pipeline's ``ModelStreamInfer`` on the orchestrator (inputs
``PROMPT`` and ``SAMPLING``; outputs ``TEXT_DELTA``, ``FINISH_REASON`` and the
token counts), so a version in the path is honoured. The first response is
awaited before the answer starts, so errors found up front (unknown model,
prompt too long, a bad setting) keep their HTTP status and ``{"error": ...}``
body; a later one arrives as a ``data: {"error": ...}`` event, as Triton
sends it. A client that goes away cancels the call, and with it the
generation.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo

from gateway.http import sse
from gateway.http.documents import json_object
from gateway.http.openai_protocol import InvalidParam, sampling_params
from gateway.http.upstream import Upstream
from inference import grpc_service_pb2 as pb
from shared import jsontext
from shared.errors import InvalidArgument, MeshError
from shared.jsontext import kind
from shared.tensors import decode_outputs, encode_inputs

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "min_tokens",
    "ignore_eos",
)
DEFAULT_MAX_TOKENS = 16
"""Tokens generated when the request names no max_tokens (vLLM's SamplingParams
default, so the vLLM backend's, where the pipeline itself would run to
max_model_len)."""
_SWITCHES = ("stream", "exclude_input_in_output")
_FIELDS = ("text_input", "parameters", "sampling_parameters", *_SWITCHES)

BodyReader = Callable[[web.Request], Awaitable[bytes]]


@dataclass(frozen=True)
class GenerateCall:
    """One generate request: the pipeline's request and how to answer it."""

    request: pb.ModelInferRequest
    prompt: str
    stream: bool
    """False: generate_stream answers in one event."""
    echo: bool
    """A whole answer starts with the prompt."""

    def whole(self, text: str) -> str:
        """The whole answer of a generation that produced ``text``."""
        return self.prompt + text if self.echo else text


def _text_input(value: Any, info: ValidationInfo) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"text_input: expected a non-empty string, got {kind(value)}")
    if not value:
        raise InvalidArgument("text_input: expected a non-empty string, got an empty one")
    return value


def _object(value: Any, info: ValidationInfo) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{info.field_name}: expected an object, got {kind(value)}")
    return value


def _sampling_parameters(value: Any, info: ValidationInfo) -> dict[str, Any]:
    """The vLLM backend's ``sampling_parameters``: a JSON object, or that object as a string."""
    if isinstance(value, str):
        try:
            value = jsontext.parse(value)
        except ValueError as exc:
            raise InvalidArgument(f"sampling_parameters: not valid JSON: {exc}") from exc
    if value is not None and not isinstance(value, dict):
        raise InvalidArgument(f"sampling_parameters: expected a JSON object, got {kind(value)}")
    return value or {}


def _flag(value: Any, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{name}: expected a boolean, got {kind(value)}")
    return value


class GenerateRequest(BaseModel):
    """Triton's generate body (as its vLLM backend reads it); a wrong field raises
    InvalidArgument naming it (the validators' errors pass pydantic untouched)."""

    model_config = ConfigDict(validate_default=False)

    text_input: Annotated[str, BeforeValidator(_text_input)] = Field(None, validate_default=True)
    parameters: Annotated[dict[str, Any], BeforeValidator(_object)] = {}
    sampling_parameters: Annotated[dict[str, Any], BeforeValidator(_sampling_parameters)] = {}
    stream: Annotated[bool | None, BeforeValidator(lambda v: _flag(v, "stream"))] = None
    exclude_input_in_output: Annotated[
        bool | None, BeforeValidator(lambda v: _flag(v, "exclude_input_in_output"))
    ] = None

    def switch(self, name: str) -> bool | None:
        """``stream`` or ``exclude_input_in_output``: from ``parameters``, else top-level."""
        if name in self.parameters:
            return _flag(self.parameters[name], name)
        value: bool | None = getattr(self, name)
        return value

    def settings(self) -> dict[str, Any]:
        """The sampling settings (``parameters`` over ``sampling_parameters``; null: unset)."""
        settings = dict(self.sampling_parameters)
        settings.update((k, v) for k, v in self.parameters.items() if k not in _SWITCHES)
        return {k: v for k, v in settings.items() if v is not None}


def generate_request(name: str, version: str, body: Mapping[str, Any]) -> GenerateCall:
    """A generate request body as the pipeline's ModelInferRequest (checked here, so
    a mistake is a 400 that names the field)."""
    unknown = sorted(set(body) - set(GenerateRequest.model_fields))
    if unknown:
        raise InvalidArgument(f"unexpected field '{unknown[0]}' (accepted: {', '.join(_FIELDS)})")
    fields = GenerateRequest.model_validate(body)
    settings = fields.settings()
    unknown = sorted(set(settings) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidArgument(
            f"parameters.{unknown[0]}: not a setting this server takes "
            f"(accepted: {', '.join(SAMPLING_KEYS + _SWITCHES)})"
        )
    settings.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    try:
        sampling_params(settings)  # the same checks and bounds as the OpenAI API's
    except InvalidParam as exc:
        raise InvalidArgument(f"parameters.{exc.message}") from exc
    prompt = fields.text_input
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    encode_inputs(
        request,
        {
            "PROMPT": np.array([prompt.encode()], dtype=object),
            "SAMPLING": np.array([json.dumps(settings).encode()], dtype=object),
        },
    )
    return GenerateCall(
        request,
        prompt,
        stream=fields.switch("stream") is not False,
        echo=not fields.switch("exclude_input_in_output"),
    )


def _first(outputs: dict[str, np.ndarray], name: str) -> Any:
    array = outputs.get(name)
    return None if array is None or array.size == 0 else array.reshape(-1)[0]


@dataclass
class Answer:
    """What the responses of one generation add up to."""

    model_name: str = ""
    model_version: str = ""
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def absorb(self, response: pb.ModelInferResponse) -> str:
        """Take in one response; returns its new text."""
        outputs = decode_outputs(response)
        self.model_name, self.model_version = response.model_name, response.model_version
        text = _decoded(_first(outputs, "TEXT_DELTA"))
        self.text += text
        self.finish_reason = _decoded(_first(outputs, "FINISH_REASON")) or self.finish_reason
        for counted in ("prompt_tokens", "completion_tokens"):
            count = _first(outputs, counted.upper())
            if count is not None:
                setattr(self, counted, int(count))
        return text

    def document(self, text: str, last: bool) -> dict[str, Any]:
        """A response object: ``text`` as ``text_output``; the last one adds how it ended."""
        document: dict[str, Any] = {
            "model_name": self.model_name,
            "model_version": self.model_version,
            "text_output": text,
        }
        if last:
            document["finish_reason"] = self.finish_reason or "stop"
            document["prompt_tokens"] = self.prompt_tokens
            document["completion_tokens"] = self.completion_tokens
        return document


def _decoded(value: Any) -> str:
    return "" if value is None else bytes(value).decode(errors="replace")


@dataclass
class _Events:
    """A generate_stream answer as SSE: an event per new text, the last with how it
    ended; without streaming, one event with the whole answer."""

    call: GenerateCall
    answer: Answer = field(default_factory=Answer)
    ended: bool = False
    trailer: bytes = b""

    def documents(self, response: pb.ModelInferResponse) -> list[dict[str, Any]]:
        """The event of one response, if it says anything new."""
        text = self.answer.absorb(response)
        # The event that brings the finish reason is the last (a response after
        # it with no text adds nothing).
        if not self.call.stream or not (text or (self.answer.finish_reason and not self.ended)):
            return []
        self.ended = bool(self.answer.finish_reason)
        return [self.answer.document(text, last=self.ended)]

    def closing(self) -> list[dict[str, Any]]:
        """Without streaming, the whole answer."""
        if self.call.stream:
            return []
        return [self.answer.document(self.call.whole(self.answer.text), last=True)]

    def failed(self, error: MeshError) -> dict[str, Any]:
        """The error as Triton sends it mid-stream."""
        return {"error": error.message}


class GenerateApi:
    """The generate routes: JSON body -> the pipeline's ModelStreamInfer -> Triton's documents."""

    def __init__(self, upstream: Upstream, read_body: BodyReader) -> None:
        self.upstream = upstream
        self._read_body = read_body

    async def _call(self, request: web.Request) -> GenerateCall:
        info = request.match_info
        body = json_object(await self._read_body(request), f"generate '{info['name']}'")
        return generate_request(info["name"], info.get("version", ""), body)

    async def generate(self, request: web.Request) -> web.Response:
        """POST .../generate: the whole answer."""
        call = await self._call(request)
        answer = Answer()
        async with contextlib.aclosing(self.upstream.stream_infer(call.request)) as responses:
            async for response in responses:
                answer.absorb(response)
        return web.json_response(answer.document(call.whole(answer.text), last=True))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """POST .../generate_stream: an SSE event per response (one, if not streaming)."""
        call = await self._call(request)
        async with contextlib.aclosing(self.upstream.stream_infer(call.request)) as responses:
            # Errors raised before the first response still get their own HTTP status.
            first = await anext(responses, None)
            content_type = "text/event-stream; charset=utf-8"
            return await sse.respond(request, _Events(call), first, responses, content_type)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Mount the routes beside the KServe v2 ones."""
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            router.add_post(prefix + "/generate", self.generate)
            router.add_post(prefix + "/generate_stream", self.generate_stream)
